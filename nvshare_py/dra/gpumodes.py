"""The scheduling modes that prepared claims ask for, as control requests: the sans-I/O half,
sent by the scheduler link (nvshare_py/deviceplugin/schedulerlink.py) beside the pods' settings.

The scheduler keeps a GPU's own mode (`set-mode {"device", "mode"}`) also while no client uses
the GPU, until the GPU is set to the default mode, which makes it forget the GPU's own setting.
So a GPU that prepared claims ask a mode for gets that mode; once none of them asks for one
there, it is set to the scheduler's default mode (its status's `scheduler.defaults.mode`, read
when the request is made). Only GPUs whose mode the driver set are given back (`owned`, which
the checkpoint keeps, so that a restarted driver gives back what its predecessor set). A
restarted scheduler has forgotten every mode: the modes asked for are sent again, and a give-
back not answered yet is sent too (the default changes nothing there).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

SET_MODE = "set-mode"


@dataclass(frozen=True)
class ModeRequest:
    """Set `device` to `mode`; `give_back`: the scheduler's default, as no prepared claim asks
    for a mode there any more."""

    device: str
    mode: str
    give_back: bool = False

    @property
    def op(self) -> str:
        return SET_MODE

    @property
    def fields(self) -> dict:
        return {"device": self.device, "mode": self.mode}

    @property
    def subject(self) -> str:
        return f"GPU {self.device}"

    def __str__(self) -> str:
        return f"mode {self.mode}" + (" (the scheduler's default: no prepared claim asks for a mode)"
                                      if self.give_back else "")


class GpuModes:
    """The modes the prepared claims ask for, by GPU UUID, against what the scheduler has been
    told. `given_back` is called when `owned` shrinks (the shell records it)."""

    def __init__(self, owned: Iterable[str] = (), given_back: Callable[[], None] = lambda: None) -> None:
        self._wanted: dict[str, str] = {}
        self._owned = set(owned)
        self._told: dict[str, str] = {}
        self._given_back = given_back

    @property
    def owned(self) -> frozenset[str]:
        """The GPUs whose mode the driver set, or is setting, and has not given back."""
        return frozenset(self._owned)

    def want(self, modes: Mapping[str, str]) -> None:
        """The modes the prepared claims ask for now."""
        self._wanted = dict(modes)
        self._owned |= set(modes)

    def scheduler_restarted(self) -> None:
        self._told.clear()

    def pending(self, scheduler: Mapping[str, Any]) -> list[ModeRequest]:
        """The requests that bring the scheduler to the modes asked for, give-backs first.
        `scheduler`: the scheduler's part of its status (its default mode; without one, as from
        a scheduler that does not say it, nothing is given back)."""
        default = (scheduler.get("defaults") or {}).get("mode")
        requests = []
        if isinstance(default, str):
            requests += [ModeRequest(uuid, default, give_back=True)
                         for uuid in sorted(self._owned - self._wanted.keys())]
        requests += [ModeRequest(uuid, mode) for uuid, mode in sorted(self._wanted.items())
                     if self._told.get(uuid) != mode]
        return requests

    def told(self, request: ModeRequest) -> None:
        """The scheduler answered `request` (accepted or refused: sent again it would get the
        same answer until the modes asked for or the scheduler change)."""
        if not request.give_back:
            self._told[request.device] = request.mode
            return
        self._told.pop(request.device, None)  # a claim prepared meanwhile gets its mode sent again
        if request.device not in self._wanted:
            self._owned.discard(request.device)
            self._given_back()
