"""The fidelity table is measured; pin what each built-in serializer does with each type."""

from __future__ import annotations

import pathlib

import pytest
from _builtins import BUILTINS

import serializers

pytestmark = pytest.mark.timeout(60)

TO_BYTES = "converted (bytearray → bytes)"
# probe: (pickle, cloudpickle, restricted-pickle, msgpack, json, msgspec)
EXPECTED = {
    "None": ("exact",) * 6,
    "int beyond 64 bits": ("exact", "exact", "exact", "exact", "refused", "refused"),
    "float nan/inf": ("exact", "exact", "exact", "exact", "refused", "exact"),
    "bytes": ("exact", "exact", "exact", "exact", "refused", "exact"),
    "bytearray": ("exact", "exact", "exact", TO_BYTES, "refused", TO_BYTES),
    "tuple": ("exact", "exact", "exact", "exact", "converted (tuple → list)", "converted (tuple → list)"),
    "dict, int keys": ("exact", "exact", "exact", "exact", "refused", "exact"),
    "set": ("exact", "exact", "exact", "exact", "refused", "converted (set → list)"),
    "datetime": ("exact", "exact", "exact", "exact", "refused", "exact"),
    "numpy.ndarray": ("exact", "exact", "exact", "exact", "refused", "exact"),
    "class instance": ("exact", "exact", "refused", "refused", "refused", "converted (Point → dict)"),
    "lambda": ("refused", "exact", "refused", "refused", "refused", "refused"),
}
NAMES = BUILTINS


@pytest.mark.parametrize("probe", EXPECTED)
def test_fidelity(probe):
    got = tuple(str(serializers.fidelity(name)[probe]) for name in NAMES)
    assert got == EXPECTED[probe]


def test_no_serializer_is_silently_lossy():
    for name in NAMES:
        assert all(v.verdict != "lossy" for v in serializers.fidelity(name).values()), name


def test_readme_shows_the_measured_table():
    readme = (pathlib.Path(__file__).parents[2] / "README.md").read_text()
    assert serializers.fidelity_table(NAMES) in readme


def test_the_judge_calls_records_turned_into_bare_bytes_lossy_and_does_not_raise():
    import numpy as np

    from serializers._fidelity import judge

    records = np.zeros(3, dtype=[("a", "<i4"), ("b", "<f8")])
    assert judge({"x": records}, {"x": records.view("V12")})[0] == "lossy"  # numpy refuses to compare the two
