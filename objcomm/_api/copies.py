"""What a :class:`~objcomm.Communicator` is as a handle: a copy, shallow or deep, shares its group and settings and
not what its calls worked out (the next call works it out again); a pickle carries the settings alone."""

from __future__ import annotations

from typing import Any, Dict

from objcomm._api.resolving import Hooks


class Copies:
    """``copy.copy``, ``copy.deepcopy`` and pickling of a communicator (see :class:`~objcomm.Communicator`)."""

    group: Any
    _hooks: Hooks

    def __copy__(self) -> Any:
        twin = object.__new__(type(self))
        twin.__dict__.update(self.__dict__, _calls={}, _held=None)
        return twin

    def __deepcopy__(self, memo: Dict[int, Any]) -> Any:
        twin = memo[id(self)] = self.__copy__()  # the settings are checked values, shared as the group is
        return twin

    def __getstate__(self) -> Dict[str, Any]:
        if self.group is not None:
            raise TypeError(
                "a Communicator on an explicit group cannot be pickled: a process group belongs to its process. "
                "Make the Communicator in the receiving process (its settings can travel: serializer=, max_bytes=, ...)"
            )
        # the hooks' host override travels; the segment book is the receiver's own
        return {**self.__dict__, "_calls": {}, "_held": None, "_hooks": self._hooks.separate_hosts}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state, _hooks=Hooks(separate_hosts=state["_hooks"]))

    def _on(self, group: Any) -> Any:
        """This communicator on ``group`` (a collective's shadow, :mod:`objcomm._api.requests`): nothing worked out."""
        other = self.__copy__()
        other.group = group
        return other
