"""What a call does: resolve its settings, encode, move, decode.

The top floor of the library. :mod:`.communicator` is the object API, on :mod:`.resolving` (a call's settings
and memos) and :mod:`.operations` (what each operation does); :mod:`.call` resolves one call (serializer, wire)
and encodes and decodes it, moving it through the transport, whose routes :mod:`objcomm._transport.routes`
picks; :mod:`.functions` and :mod:`.p2p_functions` are the module-level API that ``objcomm/__init__.py``
re-exports; :mod:`.requests` the
non-blocking calls (their handles: :mod:`.handles`; messages to oneself: :mod:`.own_box`); :mod:`.compat_calls`
and :mod:`.compat_patch` what ``objcomm.compat`` runs; :mod:`.reduce` and :mod:`.collect` are built on the
collectives; :mod:`.express` is the short path for small objects. Imports every floor below.
"""
