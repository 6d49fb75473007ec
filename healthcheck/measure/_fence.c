/* A full memory fence and an atomic claim, for the shared-memory exchange of a step's rows
 * (healthcheck/measure/shared_rows.py).
 *
 * fence: a rank writes its row with numpy (plain stores) and then a stamp saying the row is complete; another
 * rank reads the stamp and then the row. x86 keeps each core's stores in order for the others, but weaker memory
 * models (Arm, POWER) may show the stamp before the row. A sequentially consistent fence between the two, on
 * both sides, rules that out everywhere. Without this extension the exchange is not used (the all-gather is).
 *
 * raise_to: the step's metrics are computed by one rank of the host and read by the others. Whichever ranks find
 * every row in may compute them; a compare-and-swap on a shared int64 picks exactly one.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

static PyObject *fence(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    Py_RETURN_NONE;
}

/* raise_to(buffer, offset, value) -> bool: atomically set the aligned int64 at byte ``offset`` of the writable
 * ``buffer`` to ``value`` if it holds less; whether this call did (exactly one of several racing calls does). */
static PyObject *raise_to(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer view;
    Py_ssize_t offset;
    long long value;
    if (!PyArg_ParseTuple(args, "w*nL:raise_to", &view, &offset, &value)) return NULL;
    if (offset < 0 || offset % 8 != 0 || offset > view.len - 8 || ((uintptr_t)view.buf + (uintptr_t)offset) % 8 != 0) {
        PyErr_Format(PyExc_ValueError, "raise_to: offset %zd is not an aligned int64 of a %zd-byte buffer", offset,
                     view.len);
        PyBuffer_Release(&view);
        return NULL;
    }
    int64_t *word = (int64_t *)((char *)view.buf + offset);
    int64_t current = __atomic_load_n(word, __ATOMIC_SEQ_CST);
    int won = 0;
    /* A failed exchange reloads current: retry only while it is still below value. */
    while (current < (int64_t)value) {
        if (__atomic_compare_exchange_n(word, &current, (int64_t)value, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
            won = 1;
            break;
        }
    }
    PyBuffer_Release(&view);
    return PyBool_FromLong(won);
}

static PyMethodDef methods[] = {
    {"fence", fence, METH_NOARGS, "fence() -> None: a sequentially consistent memory fence."},
    {"raise_to", raise_to, METH_VARARGS,
     "raise_to(buffer, offset, value) -> bool: atomically raise the int64 at offset to value if below; whether it did."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_fence",
    .m_doc = "A full memory fence and an atomic claim (see _fence.c).",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__fence(void) { return PyModule_Create(&module); }
