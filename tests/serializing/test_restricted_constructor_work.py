"""What restricted-pickle's allowed constructors build is paid for, whatever their arguments' encoded size.

Pickle's memo lets a payload spell one large argument once and pass it to a constructor again and
again for five bytes a call (``BINGET`` the constructor, ``BINGET`` the arguments, ``REDUCE``). So
the encoded size of a call says nothing of its cost: issue 25 decoded a 43 KB frame into 8,000
structured dtypes of 256 fields each (+201 MB, 2.7 s). Every call is charged to the load's work
budget (``_restricted.allowlist.WORK_PER_BYTE`` units per payload byte) for what it costs.

:func:`constructor_cases` holds such a payload for every constructor on the allow-list
(``_restricted.allowlist._SPECS``): a constructor added there without a case here fails
:func:`test_every_allowed_constructor_has_a_hostile_case`. Each case is decoded in a child process
with its address space capped and must stay within the bounds docs/security.md states:
:data:`MEMORY_PER_BYTE` bytes of memory and :data:`CPU_PER_BYTE` of CPU per input byte, plus
constants for the budget's floor. ``python benchmarks/fuzz_hostile.py --amplification`` prints the
measured table.
"""

from __future__ import annotations

import collections
import ctypes
import gc
import io
import pickle
import pickletools
import time
import tracemalloc
from typing import Any, Dict, List, Tuple

import pytest
from _child import run_in_child
from _hostile import outcome, payload

import serializers
from serializers._restricted import allowlist as _allowlist
from serializers._restricted import guards as _guards
from serializers._restricted import scan as _scan

# The bounds: per input byte, plus constants for the budget's floor (1 MiB units: 8 MiB built, ~20 ms).
MEMORY_PER_BYTE = 256
MEMORY_CONSTANT = 16 << 20
CPU_PER_BYTE = 10e-6  # seconds; the worst measured is ~1.7 µs (two loaded cores), the issue-25 attack 63 µs
CPU_CONSTANT = 0.2
TARGET_BYTES = 32 << 10  # each hostile payload is about this long (fuzz_hostile --amplification: 1 MiB)
REFUSED = {"ContentRefusedError", "DecodeError"}
AS_KEYS = ", as keys"  # how the label of a :func:`used_as_keys` payload ends
WITH_TORCH = ("numpy", "torch")
FIELDS_256 = [(f"f{i}", "<f8") for i in range(256)]


def ops(value: Any) -> bytes:
    """The binary opcodes that push ``value``, without memo writes or reads (the payload keeps its own
    slots) or frames."""
    file = io.BytesIO()
    pickler = pickle.Pickler(file, protocol=5)
    pickler.fast = True  # no memo: a value used twice is spelled twice
    pickler.dump(value)
    data = file.getvalue()
    starts = [pos for _, _, pos in pickletools.genops(data)] + [len(data)]
    return b"".join(data[a:b] for a, b in zip(starts, starts[1:]) if data[a] not in b"\x80\x95.")


def stack_global(module: str, name: str) -> bytes:
    """A global by binary opcodes (text ones would leave the walk to Python: the C walk reads binary ones)."""
    return ops(module) + ops(name) + b"\x93"


def args(*values: Any) -> bytes:
    """The opcodes of an argument tuple of plain values."""
    return b"(" + b"".join(ops(v) for v in values) + b"t"


def _call(module: str, name: str, arguments: bytes) -> bytes:
    return stack_global(module, name) + arguments + b"R"


# (module, name) -> [(label, argument tuple opcodes, call opcode)]; a class or a nested call among the
# arguments is spelled out by hand. One case per way a constructor's cost can grow with its arguments.
def constructor_cases() -> Dict[Tuple[str, str], List[Tuple[str, bytes, bytes]]]:
    ints = list(range(20_000))
    none = [None] * 20_000
    pairs = {i: i for i in range(20_000)}
    big = (1 << 14_300) - 1
    timedelta = _call("datetime", "timedelta", args(0, 3600))
    tensor = _call("serializers._rebuild", "tensor", args("float32", (16,), bytearray(64), False))
    cases: Dict[Tuple[str, str], List[Tuple[str, bytes, bytes]]] = {
        ("builtins", "set"): [("20,000 ints", args(ints), b"R"), ("empty", b")", b"R")],
        ("builtins", "frozenset"): [("20,000 ints", args(tuple(ints)), b"R"), ("empty", b")", b"R")],
        ("builtins", "complex"): [("two floats", args(1.5, 2.5), b"R")],
        ("builtins", "bytearray"): [
            ("64 KB bytes", args(bytes(64 << 10)), b"R"),
            ("64 KB text", args("x" * (64 << 10), "latin-1"), b"R"),
        ],
        ("builtins", "slice"): [("three ints", args(1, 2, 3), b"R"), ("a 14,300-bit int", args(big), b"R")],
        ("builtins", "range"): [("three ints", args(0, 1 << 62, 3), b"R"), ("a 14,300-bit int", args(big), b"R")],
        ("builtins", "object"): [("REDUCE", b")", b"R"), ("NEWOBJ", b")", b"\x81")],
        **{
            ("builtins", name): [("empty", b")", b"R")]
            for name in ("list", "dict", "tuple", "int", "float", "str", "bytes", "bool")
        },
        ("collections", "OrderedDict"): [("20,000 pairs", args(pairs), b"R"), ("empty", b")", b"R")],
        ("collections", "Counter"): [("20,000 ints", args(ints), b"R"), ("empty", b")", b"R")],
        ("collections", "defaultdict"): [
            ("list factory, 20,000 pairs", b"(" + stack_global("builtins", "list") + ops(pairs) + b"t", b"R"),
            ("empty", b")", b"R"),
        ],
        ("collections", "deque"): [
            ("20,000 items", args(none), b"R"),
            ("maxlen", args(none, 10), b"R"),
            ("empty", b")", b"R"),
        ],
        ("datetime", "datetime"): [("fields", args(2024, 1, 2, 3, 4, 5, 6), b"R")],
        ("datetime", "date"): [("fields", args(2024, 1, 2), b"R")],
        ("datetime", "time"): [("fields", args(3, 4, 5, 6), b"R")],
        ("datetime", "timedelta"): [("fields", args(1, 2, 3), b"R")],
        ("datetime", "timezone"): [("an offset", b"(" + timedelta + b"t", b"R")],
        ("decimal", "Decimal"): [
            # the longest it takes (4,300 digits: longer are refused, as comparing equal ones costs their length)
            ("4,400 characters", args("9" * 4_400), b"R"),
            ("a 4,300-digit tuple", args((0, (9,) * 4_300, 0)), b"R"),
            ("a 4,300-digit list", args((0, [9] * 4_300, 0)), b"R"),
            ("short text", args("1.5"), b"R"),
        ],
        ("fractions", "Fraction"): [
            ("4,300/4,300 digits", args("7" * 4300 + "/" + "3" * 4299 + "1"), b"R"),
            ("14,300-bit ints", args(big, big - 2), b"R"),
            ("short text", args("1/3"), b"R"),
        ],
        ("torch", "Size"): [("20,000 sizes", args(tuple(ints)), b"R"), ("empty", b")", b"R")],
        ("torch", "device"): [("cpu", args("cpu"), b"R"), ("cuda:1", args("cuda", 1), b"R")],
        ("serializers._rebuild", "ndarray"): [
            ("256 fields, empty", args(FIELDS_256, (0,), "C", b""), b"R"),
            ("unicode over a bytearray", args("<U1", (16_384,), "C", bytearray(64 << 10)), b"R"),
            ("64 KB bytes copied", args("|u1", (64 << 10,), "C", bytes(64 << 10)), b"R"),
            ("32 dimensions", args("|u1", (1,) * 32, "F", bytearray(1)), b"R"),
        ],
        ("serializers._rebuild", "numpy_scalar"): [
            ("256 fields", args(FIELDS_256, bytes(2048)), b"R"),
            ("|S65536", args("|S65536", bytes(64 << 10)), b"R"),
            ("<U16384", args("<U16384", bytes(64 << 10)), b"R"),
            ("<f8", args("<f8", bytes(8)), b"R"),
        ],
        ("serializers._rebuild", "numpy_dtype"): [("256 fields", args(FIELDS_256), b"R"), ("<f8", args("<f8"), b"R")],
        ("serializers._rebuild", "tensor"): [
            ("64 KB bytes copied", args("float32", (16_384,), bytes(64 << 10), False), b"R"),
            ("over a bytearray", args("float32", (16,), bytearray(64), True), b"R"),
            ("32 dimensions", args("uint8", (1,) * 32, bytearray(1), False), b"R"),
        ],
        ("serializers._rebuild", "parameter"): [("a tensor", b"(" + tensor + ops(True) + b"t", b"R")],
        ("serializers._rebuild", "uuid"): [("an int", args(2**128 - 1), b"R")],
    }
    return cases


def repeated_call(
    module: str, name: str, arguments: bytes, opcode: bytes = b"R", calls: int = 0, size: int = TARGET_BYTES
) -> bytes:
    """A payload that memoizes the constructor and ``arguments`` once, then calls it ``calls`` times
    (by default: enough for about ``size`` bytes), five bytes a call, into one list."""
    head = stack_global(module, name) + b"\x94" + b"0" + arguments + b"\x94" + b"0"  # memo slots 0 and 1
    if not calls:
        calls = max(1000, (size - len(head)) // 5)
    return payload(head + b"](" + b"h\x00h\x01" + opcode + (b"h\x00h\x01" + opcode) * (calls - 1) + b"e")


def used_as_keys(module: str, name: str, arguments: bytes, opcode: bytes = b"R", size: int = TARGET_BYTES) -> bytes:
    """A payload that builds two values by equal calls, then a set of the first and as many uses of the
    second (two bytes each) as the walk lets through, padded to about ``size`` bytes: each use hashes
    the value and compares it with the first (equal, not the same object)."""
    head = stack_global(module, name) + b"\x94" + b"0" + arguments + b"\x94" + b"0"
    head += (b"h\x00h\x01" + opcode + b"\x94" + b"0") * 2  # memo slots 2 and 3

    def build(uses: int) -> bytes:
        pad = max(0, size - len(head) - 2 * uses - 16)
        return payload(
            head
            + b"B"
            + pad.to_bytes(4, "little")
            + bytes(pad)
            + b"0"
            + b"\x8f("
            + b"h\x02"
            + b"h\x03" * uses
            + b"\x90"
        )

    low, high = 1, (size - len(head)) // 2  # the most uses the walk accepts: it charges each the same
    while low < high:
        middle = (low + high + 1) // 2
        try:
            _scan.full_walk(build(middle))
            low = middle
        except _scan.ScanError:
            high = middle - 1
    return build(low)


def _needs_torch(key: Tuple[str, str]) -> bool:
    return key[0] == "torch" or key[1] in ("tensor", "parameter")


def hostile_payloads(torch: bool, size: int = TARGET_BYTES, as_keys: bool = False) -> Dict[str, Tuple[bytes, bytes]]:
    """``label -> (payload, a small warm-up payload of the same calls)`` for every case (with or without torch):
    :func:`repeated_call` payloads, or with ``as_keys`` :func:`used_as_keys` ones."""
    out = {}
    for key, cases in constructor_cases().items():
        if _needs_torch(key) != torch:
            continue
        for label, arguments, opcode in cases:
            warm = repeated_call(*key, arguments, opcode, calls=3)
            if as_keys:
                out[f"{'.'.join(key)}: {label}{AS_KEYS}"] = (used_as_keys(*key, arguments, opcode, size=size), warm)
            else:
                out[f"{'.'.join(key)}: {label}"] = (repeated_call(*key, arguments, opcode, size=size), warm)
    return out


def _rss_peak_reset() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")  # resets VmHWM to the current RSS (Linux)
        return True
    except OSError:
        return False


def _status(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _release() -> None:
    gc.collect(1)  # a refused decode leaves cycles (exception, traceback, frames); a full collection is slow
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # pragma: no cover - not glibc
        pass


Measured = Tuple[str, int, float, int, str]


def measure(cases: Dict[str, Tuple[bytes, bytes]]) -> Dict[str, Measured]:
    """In the child: ``label -> (outcome, input bytes, CPU seconds, peak bytes, the warm-up's outcome)``.

    The peak is the larger of tracemalloc's peak (Python objects, numpy data, decimal digits) and the
    growth of the peak RSS over a decode (where Linux lets a process reset it: it counts torch's
    allocations too, but not memory an earlier decode freed and this one reused).
    """
    s = serializers.get("restricted-pickle")
    results = {}
    for label, (data, warm) in cases.items():
        warmed = outcome(lambda warm=warm: s.loads(warm))  # first-use costs (imports, caches) are not the payload's
        _release()
        rss = _rss_peak_reset()
        before = _status("VmRSS")
        start = time.process_time()
        result = outcome(lambda data=data: s.loads(data))
        cpu = time.process_time() - start
        peak = _status("VmHWM") - before if rss else 0
        _release()
        tracemalloc.start()
        outcome(lambda data=data: s.loads(data))
        peak = max(peak, tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
        _release()
        results[label] = (result, len(data), cpu, peak, warmed)
    return results


def measure_all(size: int = TARGET_BYTES, memory_budget: int = 1 << 30) -> Dict[str, Measured]:
    """Every case, both kinds of payload, of about ``size`` bytes, in two child processes (one with torch)."""
    results = {}
    for torch in (False, True):
        payloads = {**hostile_payloads(torch, size), **hostile_payloads(torch, size, as_keys=True)}
        results.update(
            run_in_child(
                measure, payloads, memory_budget=memory_budget, timeout=900, preload=WITH_TORCH if torch else ("numpy",)
            )
        )
    return results


def _over_bounds(results: Dict[str, Measured]) -> Dict[str, str]:
    bad = {}
    for label, (result, size, cpu, peak, warmed) in results.items():
        if warmed != "ok":  # the case must exercise the constructor: three calls of it decode
            bad[label] = f"three calls: {warmed}"
        elif result not in REFUSED and result != "ok":
            bad[label] = result
        elif peak > MEMORY_PER_BYTE * size + MEMORY_CONSTANT or cpu > CPU_PER_BYTE * size + CPU_CONSTANT:
            bad[label] = f"{peak / size:.0f} bytes and {cpu / size * 1e6:.2f} µs per input byte ({result})"
    return bad


# -- the tests ---------------------------------------------------------------------------------


def test_every_allowed_constructor_has_a_hostile_case():
    missing = set(_allowlist._SPECS) - set(constructor_cases())
    assert not missing, f"add a hostile case for {sorted(missing)} to constructor_cases()"
    assert not set(constructor_cases()) - set(_allowlist._SPECS), "a case for a constructor no longer allowed"


def _decode_all(payloads: Dict[str, bytes]) -> Dict[str, Tuple[str, str, float]]:
    s = serializers.get("restricted-pickle")
    results = {}
    for label, data in payloads.items():
        start = time.process_time()
        try:
            s.loads(data)
            results[label] = ("ok", "", time.process_time() - start)
        except Exception as exc:  # its type and message
            results[label] = (type(exc).__name__, str(exc), time.process_time() - start)
    return results


def test_the_issue_25_dtype_bomb_is_refused():
    """43 KB of ``numpy_dtype(fields)`` calls on one memoized 256-field list: 8,000 dtypes, +201 MB before."""
    fields = args(FIELDS_256)
    payloads = {
        "numpy_dtype": repeated_call("serializers._rebuild", "numpy_dtype", fields, calls=8000),
        "ndarray": repeated_call("serializers._rebuild", "ndarray", fields[:-1] + args((0,), "C", b"")[1:], calls=8000),
        "numpy_scalar": repeated_call(
            "serializers._rebuild", "numpy_scalar", fields[:-1] + args(bytes(2048))[1:], calls=8000
        ),
    }
    results = run_in_child(_decode_all, payloads, memory_budget=128 << 20)
    for label, (result, message, cpu) in results.items():
        assert result == "DecodeError" and "work budget" in message, (label, result, message)
        assert cpu < 1.0, (label, cpu)


class _Reduced:
    """Pickled by CPython's own pickler as ``func(*args)``, memoized by identity: one argument, many calls."""

    def __init__(self, func: Any, arguments: Tuple[Any, ...]) -> None:
        self.func, self.arguments = func, arguments

    def __reduce__(self) -> Any:
        return self.func, self.arguments


class _Filled:
    """A deque given an item by APPENDS after its call: the load then runs the probe pass."""

    def __reduce__(self) -> Any:
        import collections

        return collections.deque, (), None, iter([1])


def _hashing_and_probing_payloads() -> Dict[str, bytes]:
    import collections
    import fractions

    import torch

    size = _Reduced(torch.Size, (tuple(range(20_000)),))
    fraction = _Reduced(fractions.Fraction, (3**9000, 7**5000))
    twins = [_Reduced(frozenset, (tuple(range(20_000)),)) for _ in range(2)]
    text = "y" * 200_000
    long, pairs = [0] * 20_000, [(0, 0)] * 20_000  # (one list each, memoized: every call refers to it)
    return {
        # a set (Counter, OrderedDict) of references to one value whose hash is not cached: each use hashed it whole
        "set of one torch.Size": pickle.dumps(_Reduced(set, ([size] * 20_000,)), protocol=5),
        "Counter of one torch.Size": pickle.dumps(_Reduced(collections.Counter, ([size] * 20_000,)), protocol=5),
        "OrderedDict of one torch.Size": pickle.dumps(
            _Reduced(collections.OrderedDict, ([(size, 0)] * 20_000,)), protocol=5
        ),
        "set of one Fraction": pickle.dumps(_Reduced(set, ([fraction] * 40_000,)), protocol=5),
        # two equal frozensets, not the same object: each use of the second compares them member by member
        "set of two equal frozensets": pickle.dumps(_Reduced(set, ([twins[0], twins[1]] * 20_000,)), protocol=5),
        "Counter of two equal strings": pickle.dumps(
            _Reduced(collections.Counter, ([text, "".join(["y"] * 200_000)] * 100_000,)), protocol=5
        ),
        "set of two equal bytes": pickle.dumps(
            _Reduced(set, ([text.encode(), bytes(bytearray(text.encode()))] * 100_000,)), protocol=5
        ),
        # the probe pass: many calls on one memoized list, each looked at whole before any charge
        "deque calls in the probe pass": pickle.dumps(
            [_Filled()] + [_Reduced(collections.deque, (long,)) for _ in range(10_000)], protocol=5
        ),
        "defaultdict calls in the probe pass": pickle.dumps(
            [_Filled()] + [_Reduced(collections.defaultdict, (None, pairs)) for _ in range(5_000)], protocol=5
        ),
    }


def test_values_whose_hash_is_not_cached_and_calls_in_the_probe_pass_are_charged():
    """An attacker's finds: a set of 20,000 references to one torch.Size of 20,000 sizes (a tuple subclass the
    hashing charge took for one word), a range with a 2.4-million-bit length or a Fraction (neither caches its
    hash), references to two equal frozensets or two equal long strings (compared member by member, byte by byte,
    for each reference: 5.5 s for 200 KB; a Counter of two 2-million-character strings 83 s for 8 MB), and deque or
    defaultdict calls on one memoized list once the probe pass runs (it looked at each list whole, uncharged): up to
    200 µs per input byte before (a 130 KB payload took 25 s), each refused now."""
    results = run_in_child(_decode_all, _hashing_and_probing_payloads(), memory_budget=1 << 30, preload=WITH_TORCH)
    for label, (result, message, cpu) in results.items():
        assert result == "DecodeError" and "work budget" in message, (label, result, message)
        assert cpu < 1.0, (label, cpu)
    huge = _call("builtins", "range", args(0, 1 << 20_000))
    with pytest.raises(serializers.ContentRefusedError, match="at most 14300 bits"):
        serializers.get("restricted-pickle").loads(payload(huge))


@pytest.fixture(scope="module")
def measured() -> Dict[str, Measured]:
    return measure_all()


@pytest.mark.timeout(900)  # the module's measurements (~40 s on two idle cores) run in the first test
def test_allowed_constructors_stay_within_the_documented_bounds(measured):
    results = {label: m for label, m in measured.items() if not label.endswith(AS_KEYS)}
    assert len(results) == sum(len(cases) for cases in constructor_cases().values())
    bad = _over_bounds(results)
    assert not bad, f"over {MEMORY_PER_BYTE} bytes or {CPU_PER_BYTE * 1e6:.0f} µs per input byte: {bad}"


@pytest.mark.timeout(900)
def test_what_constructors_build_costs_no_more_used_as_keys(measured):
    """Hashing a value, and comparing it with an equal one, can cost what building it did, each use: a
    structured dtype compares its fields, a frozenset its members, a torch.Size hashes its sizes. The
    walk charges each use for what the call's arguments hold (a tuple's items; a list, dict or set
    ``CONTAINER_WORK``), so as many uses as it lets through stay within the same bounds."""
    results = {label: m for label, m in measured.items() if label.endswith(AS_KEYS)}
    assert len(results) == sum(len(cases) for cases in constructor_cases().values())
    bad = _over_bounds(results)
    assert not bad, f"over {MEMORY_PER_BYTE} bytes or {CPU_PER_BYTE * 1e6:.0f} µs per input byte: {bad}"


def test_normal_values_built_by_constructors_still_decode():
    """The budget refuses payloads that reuse arguments, not many small values each spelled out: enough of
    each kind that what they are charged passes the budget's floor (1 MiB units), so the budget per byte
    decides, for the smallest encoding of each (an empty deque or OrderedDict: five bytes)."""
    import collections
    import datetime
    import decimal
    import fractions
    import uuid

    import numpy as np
    import torch

    s = serializers.get("restricted-pickle")
    values = [
        [collections.OrderedDict() for _ in range(30_000)],
        [collections.deque() for _ in range(20_000)],
        [collections.Counter() for _ in range(10_000)],
        [collections.defaultdict(list) for _ in range(30_000)],
        [datetime.datetime(2024, 1, 1, 0, 0, i % 60) for i in range(10_000)],
        [decimal.Decimal(i) / 7 for i in range(20_000)],
        [fractions.Fraction(i, 7) for i in range(10_000)],
        [uuid.UUID(int=i) for i in range(20_000)],
        [np.float64(i) for i in range(10_000)],
        [np.zeros(0, dtype=[("a", "<f8"), ("b", "<i4")]) for _ in range(5_000)],
        [torch.zeros(0) for _ in range(5_000)],
        [torch.nn.Parameter(torch.ones(1)) for _ in range(2_000)],
    ]
    for value in values:
        decoded = s.loads(s.dumps(value))
        assert len(decoded) == len(value) and type(decoded[0]) is type(value[0])


def test_torch_dtype_globals_build_nothing():
    """The other globals a payload may name, torch dtypes, are looked up, not built: no work to charge."""
    torch = pytest.importorskip("torch")
    from serializers._rebuild import _TORCH_DTYPES

    guards = _guards._Guards(set())
    for name in _TORCH_DTYPES:
        value = torch.__dict__.get(name)
        if value is not None:
            assert guards.lookup("torch", name, False) is value, name


def _pair_of_kind(kind: str, key: bytes) -> bytes:
    """A 2-item iterable of ``kind`` whose first item (the key OrderedDict and defaultdict hash) is ``key``'s value."""
    one = b"K\x01"
    if kind == "deque":
        return stack_global("collections", "deque") + key + one + b"\x86\x85R"  # deque((key, 1))
    if kind == "dict":
        return b"}" + key + one + b"s" + b"K\x02" + one + b"s"  # {key: 1, 2: 1}
    if kind == "frozenset":
        return b"(" + key + one + b"\x91"  # frozenset({key, 1})
    raise ValueError(kind)


def _pairs_hash_bomb(constructor: str, kind: str, levels: int, uses: int = 1) -> bytes:
    """``constructor([pair] * uses)`` where the pair is a ``kind`` (memoized: one spelling, ``uses`` references) whose
    key is a tuple of ``levels`` DUP TUPLE2 (2 bytes a level, 2**levels tuples to hash)."""
    chain = b"K\x00" + b"2\x86" * levels
    head = stack_global("collections", constructor) + b"("
    if constructor == "defaultdict":
        head += b"N"  # no factory
    items = b"]" + b"(" + _pair_of_kind(kind, chain) + b"\x94" + b"h\x00" * (uses - 1) + b"e"
    return payload(head + items + b"tR")


def _decode_pair_bombs() -> Dict[str, Tuple[str, str, float]]:
    return _decode_all(
        {
            f"{constructor} of a {kind}{' used 20,000 times' if uses > 1 else ''}": _pairs_hash_bomb(
                constructor, kind, levels, uses
            )
            for constructor in ("OrderedDict", "defaultdict")
            for kind, levels, uses in (("deque", 40, 1), ("dict", 14, 20_000), ("frozenset", 14, 20_000))
        }
    )


def test_pairs_that_hide_their_key_from_the_hashing_charge_are_refused():
    """An attacker's find: OrderedDict takes any 2-item iterable as a (key, value) pair and hashes its first item,
    but only tuple and list pairs were charged: ``OrderedDict([deque((t, 1))])``, ``t`` a chain of 60 DUP TUPLE2,
    182 bytes that hashed 2**60 tuples inside one C call (the receiver never returned, signals unanswered); and a
    dict or frozenset pair, its key charged once where it was built, then referenced again and again, each reference
    hashing it anew. A pair of any other kind is refused now, in OrderedDict as in defaultdict. (A chain of 40 levels
    here: were it let through, the child would run past its timeout.)"""
    results = run_in_child(_decode_pair_bombs, timeout=60, memory_budget=1 << 30)
    for label, (result, message, cpu) in results.items():
        assert result == "ContentRefusedError", (label, result, message)
        assert "pairs other than (key, value) tuples or lists" in message, (label, message)
        assert cpu < 1.0, (label, cpu)
    pairs = collections.OrderedDict([((1, 2), 3), ("k", [4])])
    restricted = serializers.get("restricted-pickle")
    assert restricted.loads(pickle.dumps(pairs)) == pairs
    # (through the constructor with its pairs, not SETITEMS: what the check above looks at)
    called = pickle.dumps(_Reduced(collections.OrderedDict, ([((1, 2), 3), ["k", [4]]],)), protocol=5)
    assert restricted.loads(called) == pairs
    called = pickle.dumps(_Reduced(collections.defaultdict, (None, [("a", 1), ["b", 2]])), protocol=5)
    assert restricted.loads(called) == {"a": 1, "b": 2}


def _scalars_and_numbers_payloads() -> Dict[str, Tuple[str, str, float]]:
    import decimal
    import fractions

    from serializers import _rebuild

    data = bytearray(b"s" * 65_536)  # one memoized bytearray, two "S" scalars over it
    scalars = [_Reduced(_rebuild.numpy_scalar, ("|S65536", data)) for _ in range(2)]
    over_bytes = [_Reduced(_rebuild.numpy_scalar, ("|S65536", bytes(data))) for _ in range(2)]
    # a 4,300-digit Decimal and a Fraction of two ~2,030-bit ints, their hashes made equal as the helper did not
    # need to: refused whatever the hashes, as their comparison is what costs
    digits = "7" * 4_300
    big = fractions.Fraction((1 << 2030) + 1, (1 << 2029) + 3)
    small = fractions.Fraction((1 << 255) + 1, 3)
    cases = {
        "S scalars over a bytearray": pickle.dumps(_Reduced(set, ([scalars[0]] + [scalars[1]] * 2_000,)), protocol=5),
        "a Decimal, then a 2,030-bit Fraction": pickle.dumps(
            [decimal.Decimal(digits), _Reduced(fractions.Fraction, (big.numerator, big.denominator))], protocol=5
        ),
        "a 2,030-bit Fraction, then a Decimal": pickle.dumps(
            [_Reduced(fractions.Fraction, (big.numerator, big.denominator)), decimal.Decimal(digits)], protocol=5
        ),
        "a Fraction of text, then a Decimal": pickle.dumps(
            [_Reduced(fractions.Fraction, (f"{big.numerator}/{big.denominator}",)), decimal.Decimal(digits)], protocol=5
        ),
        "a Decimal and a 256-bit Fraction": pickle.dumps(
            [decimal.Decimal(digits), _Reduced(fractions.Fraction, (small.numerator, small.denominator))], protocol=5
        ),
        "a 2,030-bit Fraction alone": pickle.dumps(
            _Reduced(fractions.Fraction, (big.numerator, big.denominator)), protocol=5
        ),
        "an S scalar over bytes": pickle.dumps(_Reduced(_rebuild.numpy_scalar, ("|S4", b"abcd")), protocol=5),
        # the set constructor's own charge: numpy's bytes_ (a bytes subclass) compared whole, as bytes is
        "set() of two equal S scalars over bytes": pickle.dumps(
            _Reduced(set, ([over_bytes[0]] + [over_bytes[1]] * 20_000,)), protocol=5
        ),
    }
    return _decode_all(cases)


def test_scalars_over_a_bytearray_and_a_big_fraction_beside_a_decimal_are_refused():
    """A helper's finds. (1) Two equal numpy ``S`` scalars over one memoized bytearray, in a set with thousands of
    one-byte references: the walk charges a bytes argument's size to each use of what it built, not a bytearray's,
    and each insertion compared the two whole (1 MB, 5.6 s); a scalar's data is bytes, as the encoder writes it. (2)
    A 4,300-digit Decimal and a Fraction of ~2,030-bit parts with equal hashes: 43 µs a comparison, one per byte
    (104 KB, 4.6 s); beside a Decimal a Fraction holds at most 256 bits a part, in either order. (3) The set
    constructor's charge took numpy's ``bytes_`` scalars for cheap hashes; they are compared whole, as bytes."""
    results = run_in_child(_scalars_and_numbers_payloads, memory_budget=1 << 30, preload=WITH_TORCH)
    refused, message, _ = results["S scalars over a bytearray"]
    assert refused in REFUSED and "a numpy scalar's data: expected bytes, got bytearray" in message, message
    for label in ("a Decimal, then a 2,030-bit Fraction", "a 2,030-bit Fraction, then a Decimal"):
        assert results[label][0] in REFUSED and "a Fraction of more than 256 bits" in results[label][1], results[label]
    assert "a Fraction of more than 256 bits" in results["a Fraction of text, then a Decimal"][1], results
    refused, message, _ = results["set() of two equal S scalars over bytes"]
    assert refused == "DecodeError" and "work budget" in message, message
    for label in ("a Decimal and a 256-bit Fraction", "a 2,030-bit Fraction alone", "an S scalar over bytes"):
        assert results[label][0] == "ok", (label, results[label])
