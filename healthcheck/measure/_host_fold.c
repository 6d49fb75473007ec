/* The DDP monitor's host pass over a bucket in one call: the folded sketch, the squared norm and the division.
 *
 * Why C: on a host that runs more ranks than it has cores, the numpy pass (healthcheck/measure/host_pass.py)
 * made ~15 numpy calls a bucket, and each call met the interpreter and numpy cold (~10 us apiece after the
 * step's activations), so a 263K-element bucket cost ~560 us cold against ~220 us here. It reads the bucket
 * once and, with a divisor, writes it back divided (IEEE division, round to nearest: torch's div_ bits; a
 * power-of-two divisor multiplies by its reciprocal, which is the same value rounded once).
 *
 * The rows are healthcheck.measure.sketch_layout.row_table's, the same table the Triton kernel reads: per row
 * (base, lo, hi, r) in int64 and a float32 sign. Segment position t = q*p + j of a row is bucket element
 * base + t, held when lo <= t < hi; it adds tau[t] * x to bin (j + r) mod p, times the row's sign. The bins
 * are accumulated in a doubled buffer (bin j + r without a modulo; the halves are added at the end), in the
 * bucket's precision; a row's squares in the bucket's precision too (m terms a bin), then added in float64.
 *
 *   fold(x, tau, meta, eps, acc, m, divisor) -> float
 *
 * x: a writable C-contiguous float32 or float64 buffer (divided in place when divisor != 1); tau: float32, at
 * least m*p long; meta: int64 [rows * 4]; eps: float32 [rows]; acc: float32 [p], overwritten with the sketch.
 * Returns sum(x*x) of x as it was. The GIL is released while it runs.
 *
 *   square_sum(x, lo, hi) -> float
 *
 * sum(x[lo:hi]**2) of a C-contiguous float32 or float64 buffer, in float64: after the all-reduce, this rank's
 * slice of the averaged bucket (its part of ||mean gradient||^2).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* x86-64: AVX2 and AVX-512 clones of the row loop, picked at load time (the wheel stays portable); elsewhere the
 * compiler's default target only. */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define ROW_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define ROW_CLONES
#endif

/* One row of one dtype. The in-place and read-only loops are separate so that each keeps its pointers
 * unaliased and vectorizes. */
#define FOLD_ROW(NAME, T)                                                                                     \
    ROW_CLONES                                                                                                \
    static void NAME(T *x, const float *tau, const int64_t *row, float sign, Py_ssize_t p, Py_ssize_t m,      \
                     T *acc2, T *sq, T divisor, int mode) {                                                   \
        const int64_t base = row[0], lo = row[1], hi = row[2];                                                \
        T *restrict a = acc2 + row[3];                                                                        \
        const T e = (T)sign;                                                                                  \
        const T inverse = (T)1 / divisor;                                                                     \
        for (Py_ssize_t q = 0; q < m; q++) {                                                                  \
            const int64_t start = (int64_t)q * p;                                                             \
            const int64_t jlo = lo > start ? lo - start : 0;                                                  \
            const int64_t jhi = hi - start < p ? hi - start : p;                                              \
            if (jlo >= jhi) continue;                                                                         \
            T *restrict xq = x + base + start;                                                                \
            const float *restrict tq = tau + start;                                                           \
            T *restrict s = sq;                                                                               \
            if (mode == 0) {                                                                                  \
                for (int64_t j = jlo; j < jhi; j++) {                                                         \
                    const T v = xq[j];                                                                        \
                    a[j] += e * ((T)tq[j] * v);                                                               \
                    s[j] += v * v;                                                                           \
                }                                                                                             \
            } else if (mode == 1) {                                                                           \
                for (int64_t j = jlo; j < jhi; j++) {                                                         \
                    const T v = xq[j];                                                                        \
                    a[j] += e * ((T)tq[j] * v);                                                               \
                    s[j] += v * v;                                                                           \
                    xq[j] = v * inverse;                                                                      \
                }                                                                                             \
            } else {                                                                                          \
                for (int64_t j = jlo; j < jhi; j++) {                                                         \
                    const T v = xq[j];                                                                        \
                    a[j] += e * ((T)tq[j] * v);                                                               \
                    s[j] += v * v;                                                                           \
                    xq[j] = v / divisor;                                                                      \
                }                                                                                             \
            }                                                                                                 \
        }                                                                                                     \
    }

FOLD_ROW(fold_row_f32, float)
FOLD_ROW(fold_row_f64, double)

/* mode: 0 no division, 1 multiply by the exact reciprocal of a power of two, 2 IEEE division. */
static int division_mode(double divisor) {
    if (divisor == 1.0) return 0;
    int exponent;
    return frexp(divisor, &exponent) == 0.5 ? 1 : 2;
}

/* A row's squares (fp32 sums of m terms for an fp32 bucket) added in float64, eight partial sums. */
#define SUM_SQUARES(NAME, T)                                                                                  \
    static double NAME(const T *sq, Py_ssize_t p) {                                                           \
        double part[8] = {0, 0, 0, 0, 0, 0, 0, 0}, total = 0.0;                                               \
        Py_ssize_t j = 0;                                                                                     \
        for (; j + 8 <= p; j += 8)                                                                            \
            for (int i = 0; i < 8; i++) part[i] += (double)sq[j + i];                                         \
        for (; j < p; j++) part[0] += (double)sq[j];                                                          \
        for (int i = 0; i < 8; i++) total += part[i];                                                         \
        return total;                                                                                         \
    }

SUM_SQUARES(sum_squares_f32, float)
SUM_SQUARES(sum_squares_f64, double)

/* The squares of x[0:n] added in float64, eight partial sums (an fp32 value's square is exact in float64). */
#define SQUARE_SUM(NAME, T)                                                                                   \
    ROW_CLONES                                                                                                \
    static double NAME(const T *restrict x, Py_ssize_t n) {                                                   \
        double part[8] = {0, 0, 0, 0, 0, 0, 0, 0}, total = 0.0;                                               \
        Py_ssize_t j = 0;                                                                                     \
        for (; j + 8 <= n; j += 8)                                                                            \
            for (int i = 0; i < 8; i++) part[i] += (double)x[j + i] * (double)x[j + i];                       \
        for (; j < n; j++) part[0] += (double)x[j] * (double)x[j];                                            \
        for (int i = 0; i < 8; i++) total += part[i];                                                         \
        return total;                                                                                         \
    }

SQUARE_SUM(square_sum_f32, float)
SQUARE_SUM(square_sum_f64, double)

static int check_rows(const int64_t *meta, Py_ssize_t rows, Py_ssize_t n, Py_ssize_t p, Py_ssize_t m) {
    for (Py_ssize_t i = 0; i < rows; i++) {
        const int64_t *row = meta + 4 * i;
        if (row[1] < 0 || row[1] > row[2] || row[2] > (int64_t)m * p || row[3] < 0 || row[3] >= p ||
            (row[1] < row[2] && (row[0] + row[1] < 0 || row[0] + row[2] > n))) {
            PyErr_Format(PyExc_ValueError, "fold: row %zd (base %lld, lo %lld, hi %lld, r %lld) does not fit a "
                         "bucket of %zd elements with p = %zd, m = %zd", i, (long long)row[0], (long long)row[1],
                         (long long)row[2], (long long)row[3], n, p, m);
            return -1;
        }
    }
    return 0;
}

static int is_format(const Py_buffer *view, const char *formats) {
    const char *f = view->format == NULL ? "B" : view->format;
    if (*f == '<' || *f == '=' || *f == '@') f++;
    return f[0] != '\0' && f[1] == '\0' && strchr(formats, f[0]) != NULL;
}

static PyObject *fold(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *objects[5];
    Py_ssize_t m;
    double divisor;
    if (!PyArg_ParseTuple(args, "OOOOOnd:fold", &objects[0], &objects[1], &objects[2], &objects[3], &objects[4], &m,
                          &divisor))
        return NULL;
    static const int flags[5] = {
        PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | PyBUF_WRITABLE, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT,
        PyBUF_C_CONTIGUOUS | PyBUF_FORMAT, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT,
        PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | PyBUF_WRITABLE};
    static const char *names[5] = {"x", "tau", "meta", "eps", "acc"};
    static const char *formats[5] = {"fd", "f", "lq", "f", "f"};
    Py_buffer views[5];
    int held = 0;
    PyObject *result = NULL;
    for (; held < 5; held++) {
        if (PyObject_GetBuffer(objects[held], &views[held], flags[held]) < 0) goto done;
        if (!is_format(&views[held], formats[held]) || (held == 2 && views[held].itemsize != 8)) {
            PyErr_Format(PyExc_TypeError, "fold: %s has format %s", names[held], views[held].format);
            held++;
            goto done;
        }
    }
    Py_buffer *x = &views[0], *tau = &views[1], *meta = &views[2], *eps = &views[3], *acc = &views[4];
    const Py_ssize_t n = x->len / x->itemsize, p = acc->len / 4, rows = eps->len / 4;
    if (m < 1 || p < 1 || meta->len != rows * 4 * 8 || tau->len / 4 < m * p || !isfinite(divisor) || divisor == 0) {
        PyErr_Format(PyExc_ValueError, "fold: inconsistent shapes (p = %zd, m = %zd, %zd rows, %zd table entries, "
                     "tau %zd) or divisor %g", p, m, rows, meta->len / 8, tau->len / 4, divisor);
        goto done;
    }
    if (check_rows(meta->buf, rows, n, p, m) < 0) goto done;
    const int mode = division_mode(divisor);
    double sqnorm = 0.0;
    int failed = 0;
    Py_BEGIN_ALLOW_THREADS
    /* Doubled bins, then a row's squares: one allocation per call (tens of KiB). */
    const size_t item = (size_t)x->itemsize;
    char *scratch = calloc(3 * (size_t)p, item);
    if (scratch == NULL) {
        failed = 1;
    } else {
        const int64_t *table = meta->buf;
        const float *signs = eps->buf;
        float *out = acc->buf;
        if (item == 4) {
            float *acc2 = (float *)scratch, *sq = acc2 + 2 * p;
            for (Py_ssize_t i = 0; i < rows; i++) {
                memset(sq, 0, (size_t)p * item);
                fold_row_f32(x->buf, tau->buf, table + 4 * i, signs[i], p, m, acc2, sq, (float)divisor, mode);
                sqnorm += sum_squares_f32(sq, p);
            }
            for (Py_ssize_t j = 0; j < p; j++) out[j] = acc2[j] + acc2[j + p];
        } else {
            double *acc2 = (double *)scratch, *sq = acc2 + 2 * p;
            for (Py_ssize_t i = 0; i < rows; i++) {
                memset(sq, 0, (size_t)p * item);
                fold_row_f64(x->buf, tau->buf, table + 4 * i, signs[i], p, m, acc2, sq, divisor, mode);
                sqnorm += sum_squares_f64(sq, p);
            }
            for (Py_ssize_t j = 0; j < p; j++) out[j] = (float)(acc2[j] + acc2[j + p]);
        }
        free(scratch);
    }
    Py_END_ALLOW_THREADS
    result = failed ? PyErr_NoMemory() : PyFloat_FromDouble(sqnorm);
done:
    for (int i = 0; i < held; i++) PyBuffer_Release(&views[i]);
    return result;
}

/* square_sum(x, lo, hi) -> float: sum(x[lo:hi]**2) in float64, for the DDP monitor's slice of the all-reduced
 * bucket (its part of ||mean gradient||^2). One call where a torch slice and dot cost several dispatches. */
static PyObject *square_sum(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *object;
    Py_ssize_t lo, hi;
    if (!PyArg_ParseTuple(args, "Onn:square_sum", &object, &lo, &hi)) return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(object, &view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) return NULL;
    PyObject *result = NULL;
    const Py_ssize_t n = view.itemsize > 0 ? view.len / view.itemsize : 0;
    if (!is_format(&view, "fd")) {
        PyErr_Format(PyExc_TypeError, "square_sum: x has format %s", view.format);
    } else if (lo < 0 || lo > hi || hi > n) {
        PyErr_Format(PyExc_ValueError, "square_sum: [%zd, %zd) is not within %zd elements", lo, hi, n);
    } else {
        double total;
        Py_BEGIN_ALLOW_THREADS
        total = view.itemsize == 4 ? square_sum_f32((const float *)view.buf + lo, hi - lo)
                                   : square_sum_f64((const double *)view.buf + lo, hi - lo);
        Py_END_ALLOW_THREADS
        result = PyFloat_FromDouble(total);
    }
    PyBuffer_Release(&view);
    return result;
}

static PyMethodDef methods[] = {
    {"fold", fold, METH_VARARGS,
     "fold(x, tau, meta, eps, acc, m, divisor) -> float: the sketch into acc, sum(x*x), x /= divisor in place."},
    {"square_sum", square_sum, METH_VARARGS, "square_sum(x, lo, hi) -> float: sum(x[lo:hi]**2) in float64."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_host_fold",
    .m_doc = "The DDP monitor's host pass in C (see _host_fold.c).",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__host_fold(void) { return PyModule_Create(&module); }
