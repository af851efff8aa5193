"""User type codecs through msgpack (ext type) and json (tagged object)."""

from __future__ import annotations

from fractions import Fraction

import pytest

import serializers
from serializers import DecodeError, EncodeError

pytestmark = pytest.mark.timeout(30)


class Money:
    def __init__(self, cents: int, currency: str) -> None:
        self.cents, self.currency = cents, currency

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Money) and (self.cents, self.currency) == (other.cents, other.currency)


class Euro(Money):
    pass


@pytest.fixture
def money_codec():
    serializers.register_type(Money, lambda m: [m.cents, m.currency], lambda v: Money(*v), name="money")
    yield
    serializers.unregister_type("money")


@pytest.mark.parametrize("name", ["msgpack", "json"])
def test_registered_type_round_trips(name, money_codec):
    s = serializers.get(name)
    value = {"price": Money(1999, "EUR"), "list": [Money(1, "USD")]}
    assert s.loads(s.dumps(value)) == value


@pytest.mark.parametrize("name", ["msgpack", "json"])
def test_subclass_uses_base_codec(name, money_codec):
    s = serializers.get(name)
    assert s.loads(s.dumps(Euro(5, "EUR"))) == Money(5, "EUR")


def test_json_refuses_a_dict_of_the_callers_that_reads_as_a_tag(money_codec):
    """An attacker's find: a trusted sender's own dict of exactly the tag's two keys decoded as a registered type
    (``{"__objcomm_type__": "money", "value": [1, "EUR"]}`` arrived as ``Money(1, "EUR")``). It is refused, with where;
    the same keys among others, or the tag's name as a value, still travel as they are."""
    s = serializers.get("json")
    lookalike = {"__objcomm_type__": "money", "value": [1, "EUR"]}
    with pytest.raises(EncodeError, match=r"the dict at \$\['rows'\]\[1\]: its keys"):
        s.dumps({"rows": [Money(2, "USD"), lookalike]})
    fine = {"a": {"__objcomm_type__": "money", "value": 1, "more": 2}, "b": "__objcomm_type__", "c": Money(3, "EUR")}
    assert s.loads(s.dumps(fine)) == fine
    assert serializers.get("msgpack").loads(serializers.get("msgpack").dumps(lookalike)) == lookalike
    # what a codec writes is looked at too (a reviewer's find): a tag-shaped dict there decoded as a tag
    serializers.register_type(Euro, lambda m: lookalike, lambda v: Euro(1, "EUR"), name="euro-lookalike")
    try:
        with pytest.raises(EncodeError, match="its keys"):
            s.dumps([Euro(1, "EUR")])
    finally:
        serializers.unregister_type("euro-lookalike")


def test_json_reads_a_tag_spelled_with_escapes_as_the_tag(money_codec):
    """An attacker's find: ``{"\\u005f_objcomm_type__": ...}`` (the same key, one character escaped) skipped the
    codecs, and arrived as a plain dict that no honest sender can write: a tag however spelt is now a tag, decoded by
    its codec (its validation included) or refused as one whose codec this rank lacks."""
    s = serializers.get("json")
    escaped = b'{"\\u005f_objcomm_typ\\u0065__": "money", "value": [7, "EUR"]}'
    assert s.loads(escaped) == Money(7, "EUR")
    assert s.loads(memoryview(escaped)) == Money(7, "EUR")
    assert s.loads(escaped.decode()) == Money(7, "EUR")
    with pytest.raises(DecodeError, match="no codec of that name"):
        s.loads(b'{"\\u005f_objcomm_type__": "no.such.codec", "value": 1}')
    assert s.loads(b'{"text": "\\u0001 \\u00e9"}') == {"text": "\x01 \u00e9"}  # other escapes: as they were


@pytest.mark.parametrize("name", ["msgpack", "json"])
def test_unregistered_type_is_refused(name):
    with pytest.raises(EncodeError, match="Money"):
        serializers.get(name).dumps({"m": Money(1, "EUR")})


@pytest.mark.parametrize("name", ["msgpack", "json"])
def test_decoding_without_the_codec_says_which(name, money_codec):
    data = bytes(serializers.get(name).dumps(Money(1, "EUR")))
    serializers.unregister_type("money")
    try:
        with pytest.raises(DecodeError, match="'money'"):
            serializers.get(name).loads(data)
    finally:
        serializers.register_type(Money, lambda m: [m.cents, m.currency], lambda v: Money(*v), name="money")


def test_codec_registration_rules():
    serializers.register_type(Fraction, lambda f: [f.numerator, f.denominator], lambda v: Fraction(*v))
    try:
        with pytest.raises(ValueError, match="already has a codec"):
            serializers.register_type(Fraction, str, Fraction)
        serializers.register_type(Fraction, lambda f: str(f), Fraction, replace=True)
        s = serializers.get("msgpack")
        assert s.loads(s.dumps(Fraction(1, 3))) == Fraction(1, 3)
    finally:
        serializers.unregister_type(Fraction)
    with pytest.raises(KeyError):
        serializers.unregister_type(Fraction)
    with pytest.raises(TypeError):
        serializers.register_type("not a class", str, str)  # type: ignore[arg-type]
