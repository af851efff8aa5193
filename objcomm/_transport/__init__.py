"""Moving messages over a torch process group.

:mod:`.base` holds what every medium shares (the :class:`~.base.Wire` a call moves over, the medium
protocols ``SlotMedium`` / ``RestMedia`` / ``Route``, and the backend as either); :mod:`.rounds` runs each
operation's two rounds over the backend (broadcast's: :mod:`.broadcast`; scatter's and all_to_all's:
:mod:`.parts`); :mod:`.patterns` who sends what to whom in each collective, and :mod:`.rests` each collective's
rest written once over a medium's one primitive; :mod:`.routes` every cut-off that picks a route; :mod:`.bytes` the
byte primitives (variable-length tensors over all_gather, broadcast,
send/recv); :mod:`.pending` the non-blocking sends in flight; :mod:`.groups` the sibling groups objcomm makes
beside a user's group. Knows nothing of the same-host media above it.
"""
