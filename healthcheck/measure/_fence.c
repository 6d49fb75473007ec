/* A full memory fence, for the shared-memory exchange of a step's rows (healthcheck/measure/shared_rows.py).
 *
 * Why: a rank writes its row with numpy (plain stores) and then a stamp saying the row is complete; another rank
 * reads the stamp and then the row. x86 keeps each core's stores in order for the others, but weaker memory
 * models (Arm, POWER) may show the stamp before the row. A sequentially consistent fence between the two, on
 * both sides, rules that out everywhere. Without this extension the exchange is not used (the all-gather is).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

static PyObject *fence(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"fence", fence, METH_NOARGS, "fence() -> None: a sequentially consistent memory fence."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_fence",
    .m_doc = "A full memory fence (see _fence.c).",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__fence(void) { return PyModule_Create(&module); }
