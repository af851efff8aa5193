/* restricted-pickle's two walks in C: the fast walk of serializers._restricted.plain (is_plain) and the
 * full walk of serializers._restricted.scan (full_walk), each answering as its Python implementation.
 *
 * Both only read the bytes of an immutable bytes object (the caller copies anything else first: a view
 * the sender can still write to could change between the walk and the load), never call back into
 * Python, and release the GIL on payloads of 1 MiB and more.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static uint64_t
little_endian(const unsigned char *p, int width)
{
    uint64_t value = 0;
    for (int i = width - 1; i >= 0; i--)
        value = (value << 8) | p[i];
    return value;
}

/* ---- The fast walk of serializers._restricted.plain, in C: whether a pickle holds nothing but plain data.
 *
 * The same answer as serializers._restricted.plain.is_plain_python for every input (tests/serializing/test_pickle_plain.py
 * compares the two on random, mutated and edge-case pickles), an opcode at a time instead of a
 * regular expression: read that module's docstring for the rules and why they suffice. In short,
 * a payload is plain when it reaches STOP through these opcodes only:
 *
 * - scalars: BINFLOAT, SHORT_BINUNICODE, BININT, BININT1, BININT2, NONE, NEWTRUE, NEWFALSE;
 * - MEMOIZE, the memo reads BINGET and LONG_BINGET, and MARK, APPEND(S), SETITEM(S), ADDITEMS,
 *   EMPTY_DICT, EMPTY_LIST, EMPTY_SET, EMPTY_TUPLE, LIST, DICT, POP, POP_MARK;
 * - TUPLE1/2/3 right after at least that many scalars (MEMOIZE and FRAME between them aside);
 * - length-prefixed strings and bytes of at most 255 bytes, LONG1, and BYTEARRAY8 of any length,
 *   each length within the bytes present;
 * - PROTO, and FRAME as the C unpickler reads frames from a file: no opcode may run past the end of
 *   its frame, and no FRAME may start inside another.
 *
 * It only reads the bytes of an immutable bytes object and allocates nothing.
 */

#define LONGEST_KEY 255 /* longest str or bytes a plain payload holds */

/* Where the length-prefixed opcode at `at` (a length of `width` bytes) ends, or -1 when it is not
 * plain: its length runs past `limit` or is negative, or it is longer than LONGEST_KEY (but for
 * BYTEARRAY8, never a key). */
static Py_ssize_t
past_counted(const unsigned char *p, Py_ssize_t at, int width, Py_ssize_t limit)
{
    Py_ssize_t start = at + 1 + width;
    if (start > limit)
        return -1;
    unsigned char code = p[at];
    uint64_t length = little_endian(p + at + 1, width);
    if (code == 'T' && (length & 0x80000000u))
        return -1; /* BINSTRING's length is signed: a negative one is malformed */
    if (code != 0x96 && length > LONGEST_KEY)
        return -1;
    if (length > (uint64_t)(limit - start))
        return -1;
    return start + (Py_ssize_t)length;
}

/* 1 when plain, 0 when not shown plain (the full walk decides). */
static int
plain_walk(const unsigned char *p, Py_ssize_t size)
{
    Py_ssize_t at = 0, limit = size, past;
    int framed = 0;
    Py_ssize_t scalars = 0; /* scalars pushed just before `at`, for TUPLE1/2/3 */

    if (size > 0 && p[0] == 0x80)
        at = 2; /* a leading PROTO, unchecked as the Python walk skips it */
    for (;;) {
        if (at >= limit) {
            if (!framed || limit == size)
                return 0; /* the payload ended before STOP */
            limit = size; /* the frame ended between two opcodes */
            framed = 0;
            continue;
        }
        unsigned char code = p[at];
        switch (code) {
        case 'G': /* BINFLOAT */
            if (limit - at < 9)
                return 0;
            at += 9;
            scalars++;
            break;
        case 0x8c: /* SHORT_BINUNICODE */
            if (limit - at < 2 || limit - at - 2 < p[at + 1])
                return 0;
            at += 2 + p[at + 1];
            scalars++;
            break;
        case 'J': /* BININT */
            if (limit - at < 5)
                return 0;
            at += 5;
            scalars++;
            break;
        case 'K': /* BININT1 */
            if (limit - at < 2)
                return 0;
            at += 2;
            scalars++;
            break;
        case 'M': /* BININT2 */
            if (limit - at < 3)
                return 0;
            at += 3;
            scalars++;
            break;
        case 'N': case 0x88: case 0x89: /* NONE NEWTRUE NEWFALSE */
            at += 1;
            scalars++;
            break;
        case 0x94: /* MEMOIZE: leaves the stack alone */
            at += 1;
            break;
        case 'h': /* BINGET */
            if (limit - at < 2)
                return 0;
            at += 2;
            scalars = 0;
            break;
        case 'j': /* LONG_BINGET */
            if (limit - at < 5)
                return 0;
            at += 5;
            scalars = 0;
            break;
        /* MARK APPENDS SETITEMS EMPTY_DICT EMPTY_LIST APPEND SETITEM EMPTY_SET ADDITEMS LIST DICT POP
         * POP_MARK EMPTY_TUPLE */
        case '(': case 'e': case 'u': case '}': case ']': case 'a': case 's': case 0x8f: case 0x90:
        case 'l': case 'd': case '0': case '1': case ')':
            at += 1;
            scalars = 0;
            break;
        case 0x85: case 0x86: case 0x87: /* TUPLE1 TUPLE2 TUPLE3 */
            if (scalars < code - 0x84)
                return 0;
            at += 1;
            scalars = 0;
            break;
        case 'C': case 'U': case 0x8a: /* SHORT_BINBYTES SHORT_BINSTRING LONG1 */
        case 'X': case 'B': case 'T': /* BINUNICODE BINBYTES BINSTRING */
        case 0x8d: case 0x8e: case 0x96: /* BINUNICODE8 BINBYTES8 BYTEARRAY8 */
            past = past_counted(p, at, code == 'C' || code == 'U' || code == 0x8a ? 1
                                   : code == 'X' || code == 'B' || code == 'T' ? 4 : 8, limit);
            if (past < 0)
                return 0;
            at = past;
            scalars = 0;
            break;
        case '.': /* STOP */
            return 1;
        case 0x95: { /* FRAME */
            if (framed || limit - at < 9)
                return 0; /* a FRAME inside a frame, or a truncated one */
            uint64_t length = little_endian(p + at + 1, 8);
            at += 9;
            if (length > (uint64_t)(size - at))
                return 0;
            limit = at + (Py_ssize_t)length;
            framed = 1;
            break; /* leaves the stack alone: a tuple's items may straddle it */
        }
        case 0x80: /* PROTO */
            if (limit - at < 2)
                return 0;
            at += 2;
            scalars = 0;
            break;
        default:
            return 0;
        }
    }
}

PyDoc_STRVAR(is_plain_doc,
"is_plain(raw: bytes) -> bool\n\n"
"True if ``raw`` reaches STOP through plain-data opcodes only, every declared length in bounds\n"
"(serializers._restricted.plain's fast walk, in C).");

static PyObject *
is_plain(PyObject *module, PyObject *raw)
{
    (void)module;
    if (!PyBytes_CheckExact(raw)) {
        PyErr_Format(PyExc_TypeError, "is_plain() takes bytes, not %.100s", Py_TYPE(raw)->tp_name);
        return NULL;
    }
    const unsigned char *p = (const unsigned char *)PyBytes_AS_STRING(raw);
    Py_ssize_t size = PyBytes_GET_SIZE(raw);
    int plain;
    if (size >= (1 << 20)) {
        Py_BEGIN_ALLOW_THREADS /* bytes are immutable: nothing can change them meanwhile */
        plain = plain_walk(p, size);
        Py_END_ALLOW_THREADS
    }
    else {
        plain = plain_walk(p, size);
    }
    return PyBool_FromLong(plain);
}

/* ---- The full walk of serializers._restricted.scan, in C, for the binary opcodes pickle protocol 5 writes.
 *
 * full_walk(raw) answers as serializers._restricted.scan.full_walk_python would, or not at all:
 * True or False (whether the probe pass must run) where that walk returns the same, None where
 * it would refuse the payload, or where the payload holds an opcode this walk leaves to it (text
 * opcodes: GLOBAL, INST, PUT, GET, INT, LONG, FLOAT, STRING, UNICODE). The caller then runs the
 * Python walk, which decides and words the refusal. So this walk only ever speeds up payloads the
 * Python walk accepts; tests/serializing/test_pickle_scan.py compares the two on random and mutated pickles.
 *
 * It runs pickle's stack machine on summaries of the values, as the Python walk does (its module
 * docstring explains the rules): a tag (plain value, global, a call's arguments holding a global,
 * a value a call built, a list, dict or set the payload built), a nesting depth and a hashing cost.
 * The opcode tables come from the Python module (configure()), which builds them from pickletools.
 * It reads only the bytes of an immutable bytes object; its stack, marks and memo grow with the
 * opcodes read (at most one entry each per opcode).
 */

/* value tags, as _pickle_scan's */
enum { PLAIN, GLOBAL, ARGS, BUILT, LIST, DICT, SET };
#define BUILD_TARGET (-1)

/* stack effects, in _pickle_scan's order (configure() passes each opcode's as that module numbers it) */
enum {
    E_PUSH, E_PUSH_GLOBAL, E_STACK_GLOBAL, E_MARK, E_POP, E_POP_MARK, E_DUP, E_PUT, E_MEMOIZE, E_GET,
    E_TUPLE_MARK, E_TUPLE_N, E_LIST, E_DICT, E_FROZENSET, E_APPEND, E_APPENDS, E_SETITEM, E_SETITEMS,
    E_ADDITEMS, E_BUILD, E_REDUCE, E_NEWOBJ, E_NEWOBJ_EX, E_OBJ, E_INST, E_NOTHING,
};

/* arguments[code]: 0 unknown or refused; FIXED | width; PREFIXED | width (| SIGNED, | STRING);
 * LINES for text arguments (left to the Python walk) */
#define FIXED 0x100
#define PREFIXED 0x200
#define SIGNED 0x400
#define STRING 0x800
#define LINES 0x1000

#define LONG4 0x8b
#define NOTED_INT_BYTES 256 /* scan.NOTED_INT_BYTES */
#define FRAME 0x95
#define STOP '.'

static int arguments[256];
static unsigned char effects[256];
static unsigned char pushed[256];
/* _pickle_scan's MAX_NESTING, HASH_WORK_PER_BYTE, COMPARED_BYTES and CONTAINER_WORK */
static int max_nesting;
static int64_t hash_work_per_byte, compared_bytes, container_work = 1;
static int configured;

typedef struct {
    int tag;
    int nesting;
    int64_t work;
} Value;

typedef struct {
    Value *items;
    Py_ssize_t size, capacity;
} Values;

typedef struct {
    Py_ssize_t *items;
    Py_ssize_t size, capacity;
} Marks;

/* What the walk answers: the probe pass is needed or not; the Python walk must decide; no memory. */
enum { NO_PROBE = 0, PROBE = 1, UNDECIDED = -1, NO_MEMORY = -2 };

static int
grow(void **items, Py_ssize_t *capacity, Py_ssize_t needed, size_t item_size)
{
    if (needed <= *capacity)
        return 0;
    Py_ssize_t capacity_now = *capacity ? *capacity : 64;
    while (capacity_now < needed)
        capacity_now *= 2;
    void *moved = realloc(*items, (size_t)capacity_now * item_size);
    if (moved == NULL)
        return -1;
    *items = moved;
    *capacity = capacity_now;
    return 0;
}

static int
push(Values *stack, Value value)
{
    if (grow((void **)&stack->items, &stack->capacity, stack->size + 1, sizeof(Value)) < 0)
        return -1;
    stack->items[stack->size++] = value;
    return 0;
}

static int64_t
min64(int64_t a, int64_t b)
{
    return a < b ? a : b;
}

/* Sums of hashing work saturate at budget + 1: each item is at most budget + 1 (and budget at most
 * 16 bytes of work per payload byte), so an exact sum of a payload's worth of them would overflow
 * int64 from ~760 MB of payload on. Past budget + 1 the answer is the same: refused. */

#define REFUSE return UNDECIDED
#define AS_VALUE(v) do { if ((v).tag == GLOBAL || (v).tag == ARGS) REFUSE; } while (0)
/* the C unpickler pops nothing from below the latest mark; neither does the walk */
#define ABOVE_MARK(count) \
    do { if (stack->size - (marks->size ? marks->items[marks->size - 1] : 0) < (count)) REFUSE; } while (0)

/* A tuple (or, with built=1, a call's result) of items[0..n). */
static int
combine(const Value *items, Py_ssize_t n, int built, int64_t budget, Value *out)
{
    int tag = PLAIN, nesting = 0;
    int64_t work = 1;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!built) {
            if (items[i].tag == ARGS)
                return -1;
            if (items[i].tag == GLOBAL)
                tag = ARGS;
        }
        if (items[i].nesting > nesting)
            nesting = items[i].nesting;
        work = min64(work + items[i].work, budget + 1); /* as Python's min(sum, budget + 1): no overflow */
    }
    if (nesting >= max_nesting)
        return -1;
    out->tag = built ? BUILT : tag;
    out->nesting = nesting + 1;
    out->work = work;
    return 0;
}

static int
full_walk_of(const unsigned char *raw, Py_ssize_t size, Values *stack, Marks *marks, Values *memo, Py_ssize_t *longest)
{
    Py_ssize_t at = 0, count = 0, frame_end = 0, filled = 0;
    if (size > (((int64_t)1 << 61) - 4096) / hash_work_per_byte)
        REFUSE; /* a budget past 2**61: left to the Python walk (sums of two stay within int64) */
    int64_t budget = hash_work_per_byte * size + 4096;
    int needs_probe = 0, tracking = 0;
    const Value plain = {PLAIN, 0, 1};

    while (at < size) {
        int code = raw[at];
        Py_ssize_t start = at + 1, end;
        int argument = arguments[code];
        if (argument & FIXED) {
            end = start + (argument & 0xff);
        }
        else if (argument & PREFIXED) {
            int width = argument & 0xff;
            if (width > size - start)
                REFUSE;
            uint64_t length = little_endian(raw + start, width);
            if ((argument & SIGNED) && width == 4 && (length & 0x80000000u))
                REFUSE;
            if (length > (uint64_t)(size - start - width))
                REFUSE;
            end = start + width + (Py_ssize_t)length;
        }
        else {
            REFUSE; /* unknown, refused, or a text argument: the Python walk decides */
        }
        if (end > size)
            REFUSE;
        if (end > frame_end && frame_end > at)
            REFUSE; /* runs past the end of its frame */
        if (code == FRAME) {
            if (at < frame_end)
                REFUSE;
            uint64_t length = little_endian(raw + start, 8);
            if (length > (uint64_t)(size - end))
                REFUSE;
            frame_end = end + (Py_ssize_t)length;
        }
        int effect = effects[code];
        Value value;
        Py_ssize_t mark, n;
        switch (effect) {
        case E_PUSH:
            if (code == LONG4) {
                if (end - start - 4 > *longest)
                    *longest = end - start - 4; /* the longest int's bytes (scan.full_walk's noted) */
                value.tag = PLAIN; value.nesting = 0; value.work = 1 + (end - start) / 8;
                tracking = 1;
            }
            else if (end - start > compared_bytes && (argument & STRING)) {
                value.tag = PLAIN; value.nesting = 0; value.work = 1 + (end - start) / compared_bytes;
                tracking = 1;
            }
            else {
                value.tag = pushed[code]; value.nesting = 0;
                value.work = value.tag == LIST || value.tag == DICT || value.tag == SET ? container_work : 1;
            }
            if (push(stack, value) < 0)
                return NO_MEMORY;
            break;
        case E_SETITEMS: case E_APPENDS: case E_ADDITEMS:
            if (!marks->size)
                REFUSE;
            mark = marks->items[--marks->size];
            if (mark > stack->size)
                mark = stack->size; /* the stack went below the mark (the C unpickler raises) */
            if (tracking) {
                int64_t charged = 0;
                for (Py_ssize_t i = mark; i < stack->size; i++) {
                    AS_VALUE(stack->items[i]);
                    if (effect == E_ADDITEMS || (effect == E_SETITEMS && (i - mark) % 2 == 0))
                        charged = min64(charged + stack->items[i].work, budget + 1);
                }
                budget -= charged;
                stack->size = mark;
                if (!stack->size)
                    REFUSE;
                Value target = stack->items[stack->size - 1];
                if (target.tag == GLOBAL || target.tag == ARGS)
                    REFUSE;
                int takes = effect == E_SETITEMS ? DICT : effect == E_APPENDS ? LIST : SET;
                needs_probe = needs_probe || target.tag != takes;
            }
            else {
                n = stack->size - mark;
                if (effect == E_ADDITEMS)
                    budget -= n;
                else if (effect == E_SETITEMS)
                    budget -= n / 2;
                stack->size = mark;
                if (!stack->size)
                    REFUSE;
            }
            break;
        case E_GET: case E_MEMOIZE: case E_PUT: {
            Py_ssize_t index;
            if (effect == E_MEMOIZE)
                index = filled;
            else
                index = (Py_ssize_t)little_endian(raw + start, (int)(end - start)); /* BINGET/LONG_BINGET/BINPUT/... */
            if (effect == E_GET) {
                if (index >= memo->size || memo->items[index].tag < 0)
                    REFUSE;
                if (push(stack, memo->items[index]) < 0)
                    return NO_MEMORY;
                break;
            }
            if (effect == E_PUT && index > count)
                REFUSE;
            if (!stack->size)
                REFUSE;
            if (index >= memo->size) {
                if (grow((void **)&memo->items, &memo->capacity, index + 1, sizeof(Value)) < 0)
                    return NO_MEMORY;
                for (Py_ssize_t i = memo->size; i <= index; i++)
                    memo->items[i].tag = -1; /* empty */
                memo->size = index + 1;
            }
            if (memo->items[index].tag < 0)
                filled++;
            memo->items[index] = stack->items[stack->size - 1];
            break;
        }
        case E_MARK:
            if (grow((void **)&marks->items, &marks->capacity, marks->size + 1, sizeof(Py_ssize_t)) < 0)
                return NO_MEMORY;
            marks->items[marks->size++] = stack->size;
            break;
        case E_SETITEM: case E_APPEND: case E_BUILD: {
            Py_ssize_t popped = effect == E_SETITEM ? 2 : 1;
            ABOVE_MARK(popped + 1);
            if (tracking) {
                AS_VALUE(stack->items[stack->size - 1]);
                stack->size--;
                if (effect == E_SETITEM) {
                    AS_VALUE(stack->items[stack->size - 1]);
                    budget -= stack->items[stack->size - 1].work;
                    stack->size--;
                }
                Value target = stack->items[stack->size - 1];
                if (target.tag == GLOBAL || target.tag == ARGS)
                    REFUSE;
                int takes = effect == E_SETITEM ? DICT : effect == E_APPEND ? LIST : BUILD_TARGET;
                needs_probe = needs_probe || target.tag != takes;
            }
            else {
                stack->size -= popped;
                budget -= effect == E_SETITEM;
            }
            break;
        }
        case E_TUPLE_MARK: case E_TUPLE_N:
            if (effect == E_TUPLE_N) {
                n = code - 0x84; /* TUPLE1, TUPLE2, TUPLE3 */
                ABOVE_MARK(n);
                mark = stack->size - n;
            }
            else {
                if (!marks->size)
                    REFUSE;
                mark = marks->items[--marks->size];
                if (mark > stack->size)
                    mark = stack->size;
            }
            if (combine(stack->items + mark, stack->size - mark, 0, budget, &value) < 0)
                REFUSE;
            stack->size = mark;
            if (push(stack, value) < 0)
                return NO_MEMORY;
            tracking = 1;
            break;
        case E_REDUCE: case E_NEWOBJ: case E_NEWOBJ_EX: {
            tracking = 1;
            ABOVE_MARK(effect == E_NEWOBJ_EX ? 3 : 2);
            Value parts[2];
            parts[0] = stack->items[--stack->size]; /* the arguments */
            parts[1] = plain; /* keyword arguments */
            if (effect == E_NEWOBJ_EX) {
                parts[1] = stack->items[--stack->size];
                AS_VALUE(parts[1]);
            }
            if (effect != E_REDUCE || parts[0].tag == GLOBAL)
                AS_VALUE(parts[0]); /* only a call's own arguments may hold a global */
            Value callable = stack->items[--stack->size];
            if (callable.tag != GLOBAL) /* ARGS, or a value the payload built: the Python walk says which */
                REFUSE;
            if (combine(parts, 2, 1, budget, &value) < 0)
                REFUSE;
            if (push(stack, value) < 0)
                return NO_MEMORY;
            break;
        }
        case E_STACK_GLOBAL:
            if (stack->size < 2)
                REFUSE;
            stack->size -= 2; /* module and name; as the Python walk, without a mark check */
            value.tag = GLOBAL; value.nesting = 0; value.work = 1;
            if (push(stack, value) < 0)
                return NO_MEMORY;
            tracking = 1;
            break;
        case E_LIST: case E_DICT: case E_FROZENSET: case E_POP_MARK: {
            if (!marks->size)
                REFUSE;
            mark = marks->items[--marks->size];
            if (mark > stack->size)
                mark = stack->size;
            if (effect == E_POP_MARK) {
                stack->size = mark;
                break;
            }
            int64_t charged = 0;
            for (Py_ssize_t i = mark; i < stack->size; i++) {
                AS_VALUE(stack->items[i]);
                if (effect == E_FROZENSET || (effect == E_DICT && (i - mark) % 2 == 0))
                    charged = min64(charged + stack->items[i].work, budget + 1);
            }
            int any = stack->size > mark;
            stack->size = mark;
            if (effect != E_LIST)
                budget -= charged;
            if (effect == E_FROZENSET && any) {
                value.tag = PLAIN; value.nesting = 0; value.work = min64(1 + charged, budget + 1);
                tracking = 1;
            }
            else {
                value.tag = effect == E_LIST ? LIST : effect == E_DICT ? DICT : PLAIN;
                value.nesting = 0; value.work = effect == E_FROZENSET ? 1 : container_work;
            }
            if (push(stack, value) < 0)
                return NO_MEMORY;
            break;
        }
        case E_OBJ:
            tracking = 1;
            if (!marks->size)
                REFUSE;
            mark = marks->items[--marks->size];
            if (mark > stack->size)
                mark = stack->size;
            if (stack->size <= mark || stack->items[mark].tag != GLOBAL)
                REFUSE; /* OBJ calls the class it names, never a value the payload built */
            for (Py_ssize_t i = mark + 1; i < stack->size; i++)
                AS_VALUE(stack->items[i]);
            if (combine(stack->items + mark, stack->size - mark, 1, budget, &value) < 0)
                REFUSE;
            stack->size = mark;
            if (push(stack, value) < 0)
                return NO_MEMORY;
            break;
        case E_POP:
            /* As the C unpickler does: POP right after MARK removes the mark, not a value. */
            if (marks->size && marks->items[marks->size - 1] == stack->size) {
                marks->size--;
            }
            else {
                ABOVE_MARK(1);
                stack->size--;
            }
            break;
        case E_DUP:
            ABOVE_MARK(1);
            if (push(stack, stack->items[stack->size - 1]) < 0)
                return NO_MEMORY;
            break;
        case E_NOTHING:
            if (code == STOP) {
                if (stack->size != 1 || marks->size)
                    REFUSE;
                AS_VALUE(stack->items[0]);
                return needs_probe ? PROBE : NO_PROBE;
            }
            break; /* PROTO, FRAME */
        default: /* GLOBAL, INST: text arguments, refused above */
            REFUSE;
        }
        if (budget < 0)
            REFUSE;
        at = end;
        count++;
    }
    REFUSE; /* no STOP */
}

PyDoc_STRVAR(full_walk_doc,
"full_walk(raw: bytes, noted: list | None = None) -> bool | None\n\n"
"Whether the probe pass must run, as serializers._restricted.scan's Python walk answers; None where that\n"
"walk must decide (it refuses the payload, or the payload holds a text opcode). Where it answers and a\n"
"LONG4 int is longer than scan.NOTED_INT_BYTES, noted[0] becomes the longest one's bytes, as the Python\n"
"walk notes them.");

static PyObject *
full_walk(PyObject *module, PyObject *args)
{
    (void)module;
    PyObject *raw, *noted = Py_None;
    if (!PyArg_ParseTuple(args, "O|O", &raw, &noted))
        return NULL;
    if (noted != Py_None && !(PyList_CheckExact(noted) && PyList_GET_SIZE(noted) == 1)) {
        PyErr_SetString(PyExc_TypeError, "full_walk(): noted must be a list of one item, or None");
        return NULL;
    }
    if (!PyBytes_CheckExact(raw)) {
        PyErr_Format(PyExc_TypeError, "full_walk() takes bytes, not %.100s", Py_TYPE(raw)->tp_name);
        return NULL;
    }
    if (!configured) {
        PyErr_SetString(PyExc_RuntimeError, "full_walk() before configure()");
        return NULL;
    }
    Values stack = {NULL, 0, 0}, memo = {NULL, 0, 0};
    Marks marks = {NULL, 0, 0};
    const unsigned char *p = (const unsigned char *)PyBytes_AS_STRING(raw);
    Py_ssize_t size = PyBytes_GET_SIZE(raw);
    int answer;
    Py_ssize_t longest = 0;
    if (size >= (1 << 20)) {
        Py_BEGIN_ALLOW_THREADS /* bytes are immutable: nothing can change them meanwhile */
        answer = full_walk_of(p, size, &stack, &marks, &memo, &longest);
        Py_END_ALLOW_THREADS
    }
    else {
        answer = full_walk_of(p, size, &stack, &marks, &memo, &longest);
    }
    free(stack.items);
    free(marks.items);
    free(memo.items);
    if (answer == NO_MEMORY)
        return PyErr_NoMemory();
    if (answer == UNDECIDED)
        Py_RETURN_NONE;
    if (noted != Py_None && longest > NOTED_INT_BYTES) {
        PyObject *bytes = PyLong_FromSsize_t(longest);
        if (bytes == NULL)
            return NULL;
        PyList_SetItem(noted, 0, bytes); /* steals the reference */
    }
    return PyBool_FromLong(answer == PROBE);
}

PyDoc_STRVAR(configure_doc,
"configure(arguments: bytes, effects: bytes, pushed: bytes, max_nesting: int, hash_work_per_byte: int,\n"
"          compared_bytes: int, container_work: int = <as before>) -> None\n\n"
"The opcode tables, 256 entries each: arguments as little-endian uint16 (see the C source), each\n"
"opcode's stack effect, and the tag a push opcode pushes; then the walk's limits (container_work\n"
"keeps its value when not given).");

static PyObject *
configure(PyObject *module, PyObject *args)
{
    (void)module;
    const char *argument_table, *effect_table, *pushed_table;
    Py_ssize_t argument_size, effect_size, pushed_size;
    int nesting;
    long long per_byte, compared, container = container_work;
    if (!PyArg_ParseTuple(args, "y#y#y#iLL|L", &argument_table, &argument_size, &effect_table, &effect_size,
                          &pushed_table, &pushed_size, &nesting, &per_byte, &compared, &container))
        return NULL;
    if (argument_size != 512 || effect_size != 256 || pushed_size != 256) {
        PyErr_SetString(PyExc_ValueError, "configure() takes tables of 256 entries");
        return NULL;
    }
    /* tests raise per_byte to bring the work sums' saturation within reach of small payloads */
    if (nesting < 1 || per_byte < 1 || per_byte > ((long long)1 << 52) || compared < 1 || container < 1
        || container > ((long long)1 << 40)) {
        PyErr_SetString(PyExc_ValueError, "configure(): limits out of range");
        return NULL;
    }
    for (int code = 0; code < 256; code++) {
        arguments[code] = (unsigned char)argument_table[2 * code] | ((unsigned char)argument_table[2 * code + 1] << 8);
        effects[code] = (unsigned char)effect_table[code];
        pushed[code] = (unsigned char)pushed_table[code];
        if (effects[code] > E_NOTHING) {
            PyErr_SetString(PyExc_ValueError, "configure(): unknown stack effect");
            return NULL;
        }
    }
    max_nesting = nesting;
    hash_work_per_byte = per_byte;
    compared_bytes = compared;
    container_work = container;
    configured = 1;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"is_plain", is_plain, METH_O, is_plain_doc},
    {"full_walk", full_walk, METH_VARARGS, full_walk_doc},
    {"configure", configure, METH_VARARGS, configure_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "serializers._restricted._walks_c",
    "restricted-pickle's two walks in C: is_plain (serializers._restricted.plain), full_walk (serializers._restricted.scan).",
    -1, methods,
};

PyMODINIT_FUNC
PyInit__walks_c(void)
{
    return PyModule_Create(&module);
}
