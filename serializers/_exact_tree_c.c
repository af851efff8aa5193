/* serializer="auto"'s look at an object, in C: whether msgspec (decoding into Any) gives it back exactly.
 *
 * The same answer as serializers._exact_tree.carried_exactly_python for every object (tests/serializing/test_exact_tree.py
 * compares the two): read that module's docstring for the rules. It stops at the first value that does not
 * qualify, and only reads the object: the GIL is held throughout and nothing it calls runs Python code or makes
 * an object the garbage collector tracks (a collection could run a finalizer that changes the object under the
 * walk, which holds borrowed references): it raises no exception on the way (the clears below only guard against
 * what these C types never do, and memory running out), the set below is made before the walk starts, and what
 * it holds are ints. A container held by its parent alone (reference count one) cannot be
 * met twice; only the others are remembered, by address, to tell a container met twice.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#define MAX_DEPTH 100  /* serializers._exact_tree.MAX_DEPTH */
#define SHARED_LENGTH 64  /* serializers._exact_tree.SHARED_LENGTH */

static PyObject *largest_int;  /* 2**64 - 1 */
static PyObject *nbytes_name;  /* "nbytes", interned */
static PyObject *dtype_name;  /* "dtype", interned */

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
    PyLong_AsLongLongAndOverflow(value, &overflow);  /* sets overflow, raises nothing, for an int */
    if (overflow == 0)
        return 1;
    if (overflow < 0)
        return 0;
    return PyObject_RichCompareBool(value, largest_int, Py_LE) == 1;  /* two ints: long_richcompare, in C */
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
    PyObject *large;   /* a C type (numpy.ndarray) taken where its nbytes exceed large_above, or None */
    long long large_above;
    PyObject *large_dtypes;  /* a tuple: the dtypes (by identity) of the large ones taken */
    PyObject *seen;    /* the set of the addresses of containers held elsewhere too, met so far */
} Walk;

/* 1 if this container, or long string, (held by others than its parent too) is met for the first time, else 0 */
static int
first_meeting(Walk *w, PyObject *container)
{
    PyObject *address = PyLong_FromVoidPtr(container);
    if (address == NULL)
        goto failed;
    int found = PySet_Contains(w->seen, address);
    int added = found == 0 ? PySet_Add(w->seen, address) : 0;
    Py_DECREF(address);
    if (found < 0 || added < 0)
        goto failed;
    return !found;
failed:  /* out of memory (MemoryError is made in advance): not carried (pickle is) */
    PyErr_Clear();
    return 0;
}

/* the values most containers hold, checked without a call: str, float, an int of up to 60 bits */
#if PY_VERSION_HEX >= 0x030C0000
#define SMALL_INT(v) (Py_IS_TYPE(v, &PyLong_Type) && PyUnstable_Long_IsCompact((PyLongObject *)(v)))
#else
#define SMALL_INT(v) (Py_IS_TYPE(v, &PyLong_Type) && Py_SIZE(v) >= -2 && Py_SIZE(v) <= 2)
#endif
#define SHORT_OR_ONCE(v) (Py_REFCNT(v) == 1 || PyUnicode_GET_LENGTH(v) < SHARED_LENGTH)
#define QUICK(v) ((Py_IS_TYPE(v, &PyUnicode_Type) && SHORT_OR_ONCE(v)) || Py_IS_TYPE(v, &PyFloat_Type) \
                  || SMALL_INT(v))

static int
walk(Walk *w, PyObject *value, int depth)
{
    PyTypeObject *kind = Py_TYPE(value);
    if (kind == &PyFloat_Type || kind == &PyBool_Type || value == Py_None)
        return 1;
    if (kind == &PyUnicode_Type || kind == &PyBytes_Type) {  /* one met twice would be written twice */
        Py_ssize_t length = kind == &PyUnicode_Type ? PyUnicode_GET_LENGTH(value) : PyBytes_GET_SIZE(value);
        return Py_REFCNT(value) == 1 || length < SHARED_LENGTH || first_meeting(w, value);
    }
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
            if (key_kind == &PyUnicode_Type ? !(SHORT_OR_ONCE(key) || first_meeting(w, key))
                                            : !(key_kind == &PyLong_Type && int_fits(key)))
                return 0;  /* a long key met in many dicts would be written in each */
            if (!QUICK(item) && !walk(w, item, depth + 1))
                return 0;
        }
        return 1;
    }
    if ((PyObject *)kind == w->large) {
        /* numpy's own C getters (large is a C type: checked on the way in): an int, the array's dtype */
        PyObject *nbytes = PyObject_GetAttr(value, nbytes_name);
        long long n = nbytes == NULL || !PyLong_CheckExact(nbytes) ? -1 : PyLong_AsLongLong(nbytes);
        Py_XDECREF(nbytes);
        if (PyErr_Occurred())
            PyErr_Clear();
        if (n <= w->large_above)
            return 0;
        PyObject *dtype = PyObject_GetAttr(value, dtype_name);
        if (dtype == NULL) {
            PyErr_Clear();
            return 0;
        }
        int taken = 0;
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(w->large_dtypes) && !taken; i++)
            taken = PyTuple_GET_ITEM(w->large_dtypes, i) == dtype;
        Py_DECREF(dtype);
        return taken;
    }
    return is_leaf(value, w->leaves);
}

PyDoc_STRVAR(carried_exactly_doc,
"carried_exactly(obj, leaves, large=None, large_above=0, large_dtypes=(), /)\n--\n\n"
"Whether msgspec gives obj back exactly (serializers._exact_tree); leaves: a tuple of types taken as they are;\n"
"large: a type defined in C taken where its nbytes exceed large_above and its dtype is one of large_dtypes.");

static PyObject *
carried_exactly(PyObject *self, PyObject *args)
{
    PyObject *obj, *leaves, *large = Py_None, *large_dtypes = NULL;
    long long large_above = 0;
    if (!PyArg_ParseTuple(args, "OO!|OLO!:carried_exactly", &obj, &PyTuple_Type, &leaves, &large, &large_above,
                          &PyTuple_Type, &large_dtypes))
        return NULL;
    if (large != Py_None && (!PyType_Check(large) || PyType_HasFeature((PyTypeObject *)large, Py_TPFLAGS_HEAPTYPE))) {
        /* a class defined in Python could run code from its nbytes while the walk holds borrowed references */
        PyErr_SetString(PyExc_TypeError, "carried_exactly: large must be a type defined in C (numpy.ndarray) or None");
        return NULL;
    }
    PyObject *owned = NULL;  /* the empty tuple made here, where none was given */
    if (large_dtypes == NULL)
        large_dtypes = owned = PyTuple_New(0);
    Walk w = {leaves, large, large_above, large_dtypes, PySet_New(NULL)};
    if (w.seen == NULL || large_dtypes == NULL) {
        Py_XDECREF(w.seen);
        Py_XDECREF(owned);
        return NULL;
    }
    int carried = walk(&w, obj, 0);
    Py_DECREF(w.seen);
    Py_XDECREF(owned);
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
    largest_int = PyLong_FromUnsignedLongLong(0xFFFFFFFFFFFFFFFFULL);
    nbytes_name = PyUnicode_InternFromString("nbytes");
    dtype_name = PyUnicode_InternFromString("dtype");
    if (largest_int == NULL || nbytes_name == NULL || dtype_name == NULL)
        return NULL;
    return PyModule_Create(&module);
}
