/* serializer="auto"'s look at an object, in C: whether msgspec (decoding into Any) gives it back exactly.
 *
 * The same answer as serializers._exact_tree.carried_exactly_python for every object (tests/test_exact_tree.py
 * compares the two): read that module's docstring for the rules. It only reads the object (no call back into
 * Python, the GIL held throughout, so nothing can change under it), and stops at the first value that does not
 * qualify. A container held by its parent alone (reference count one) cannot be met twice; only the others are
 * remembered, in a set made at the first of them, to tell a container met twice.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#define MAX_DEPTH 100  /* serializers._exact_tree.MAX_DEPTH */

static int
int_fits(PyObject *value)
{
#if PY_VERSION_HEX >= 0x030C0000
    if (PyUnstable_Long_IsCompact((PyLongObject *)value))  /* one digit: 30 bits */
        return 1;
#else
    if (Py_SIZE(value) >= -2 && Py_SIZE(value) <= 2)  /* two digits at most: 60 bits */
        return 1;
#endif
    int overflow = 0;
    PyLong_AsLongLongAndOverflow(value, &overflow);
    if (overflow == 0)
        return 1;
    if (overflow < 0)
        return 0;
    PyLong_AsUnsignedLongLong(value);  /* below 2**64 */
    if (PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    return 1;
}

static int
is_leaf(PyObject *value, PyObject *leaves)
{
    Py_ssize_t n = PyTuple_GET_SIZE(leaves);
    for (Py_ssize_t i = 0; i < n; i++)
        if ((PyObject *)Py_TYPE(value) == PyTuple_GET_ITEM(leaves, i))
            return 1;
    return 0;
}

typedef struct {
    PyObject *leaves;  /* a tuple of types */
    PyObject *large;   /* a type (numpy.ndarray) taken where its nbytes exceed large_above, or None */
    long long large_above;
    PyObject *seen;    /* NULL, or the set of the addresses of containers held elsewhere too */
} Walk;

/* 1 if this container (held by others than its parent too) is met for the first time, else 0 */
static int
first_meeting(Walk *w, PyObject *container)
{
    if (w->seen == NULL && (w->seen = PySet_New(NULL)) == NULL)
        goto failed;
    PyObject *address = PyLong_FromVoidPtr(container);
    if (address == NULL)
        goto failed;
    int found = PySet_Contains(w->seen, address);
    int added = found == 0 ? PySet_Add(w->seen, address) : 0;
    Py_DECREF(address);
    if (found < 0 || added < 0)
        goto failed;
    return !found;
failed:  /* out of memory: not carried (pickle is) */
    PyErr_Clear();
    return 0;
}

/* the values most containers hold, checked without a call: str, float, an int of up to 60 bits */
#if PY_VERSION_HEX >= 0x030C0000
#define SMALL_INT(v) (Py_IS_TYPE(v, &PyLong_Type) && PyUnstable_Long_IsCompact((PyLongObject *)(v)))
#else
#define SMALL_INT(v) (Py_IS_TYPE(v, &PyLong_Type) && Py_SIZE(v) >= -2 && Py_SIZE(v) <= 2)
#endif
#define QUICK(v) (Py_IS_TYPE(v, &PyUnicode_Type) || Py_IS_TYPE(v, &PyFloat_Type) || SMALL_INT(v))

static int
walk(Walk *w, PyObject *value, int depth)
{
    PyTypeObject *kind = Py_TYPE(value);
    if (kind == &PyUnicode_Type || kind == &PyFloat_Type || kind == &PyBool_Type || value == Py_None
        || kind == &PyBytes_Type)
        return 1;
    if (kind == &PyLong_Type)
        return int_fits(value);
    if (kind == &PyList_Type || kind == &PyDict_Type) {
        if (depth >= MAX_DEPTH || (Py_REFCNT(value) != 1 && !first_meeting(w, value)))
            return 0;
    }
    if (kind == &PyList_Type) {
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(value); i++) {
            PyObject *item = PyList_GET_ITEM(value, i);
            if (!QUICK(item) && !walk(w, item, depth + 1))
                return 0;
        }
        return 1;
    }
    if (kind == &PyDict_Type) {
        Py_ssize_t position = 0;
        PyObject *key, *item;
        while (PyDict_Next(value, &position, &key, &item)) {
            PyTypeObject *key_kind = Py_TYPE(key);
            if (!(key_kind == &PyUnicode_Type || (key_kind == &PyLong_Type && int_fits(key))))
                return 0;
            if (!QUICK(item) && !walk(w, item, depth + 1))
                return 0;
        }
        return 1;
    }
    if ((PyObject *)kind == w->large) {
        PyObject *nbytes = PyObject_GetAttrString(value, "nbytes");  /* numpy's own C getter */
        long long n = nbytes == NULL ? -1 : PyLong_AsLongLong(nbytes);
        Py_XDECREF(nbytes);
        if (PyErr_Occurred())
            PyErr_Clear();
        return n > w->large_above;
    }
    return is_leaf(value, w->leaves);
}

PyDoc_STRVAR(carried_exactly_doc,
"carried_exactly(obj, leaves, large=None, large_above=0, /)\n--\n\n"
"Whether msgspec gives obj back exactly (serializers._exact_tree); leaves: a tuple of types taken as they are;\n"
"large: a type taken where its nbytes exceed large_above.");

static PyObject *
carried_exactly(PyObject *self, PyObject *args)
{
    PyObject *obj, *leaves, *large = Py_None;
    long long large_above = 0;
    if (!PyArg_ParseTuple(args, "OO!|OL:carried_exactly", &obj, &PyTuple_Type, &leaves, &large, &large_above))
        return NULL;
    Walk w = {leaves, large, large_above, NULL};
    int carried = walk(&w, obj, 0);
    Py_XDECREF(w.seen);
    return PyBool_FromLong(carried);
}

static PyMethodDef methods[] = {
    {"carried_exactly", carried_exactly, METH_VARARGS, carried_exactly_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "serializers._exact_tree_c",
    "serializer='auto''s look at an object in C: carried_exactly (serializers._exact_tree).",
    -1, methods,
};

PyMODINIT_FUNC
PyInit__exact_tree_c(void)
{
    return PyModule_Create(&module);
}
