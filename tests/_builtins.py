"""The built-in serializers, in one list for every test that runs them all (tests/serializing/test_registry.py
checks that it is what the registry holds at start)."""

BUILTINS = ["pickle", "cloudpickle", "restricted-pickle", "msgpack", "json", "msgspec"]
# The collectives' tests on live ranks run these; msgspec has its own on ranks (tests/serializing/test_msgspec.py)
ON_RANKS = [name for name in BUILTINS if name != "msgspec"]
