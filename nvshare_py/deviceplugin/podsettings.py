"""Pod annotations as scheduler settings: the sans-I/O half of the pod watcher (podwatch.py).

A pod on this node that carries

    nvshare.com/weight: "4"            -> set-weight   {"pod_uid": ..., "weight": 4}
    nvshare.com/priority: "2"          -> set-priority {"pod_uid": ..., "priority": 2}
    nvshare.com/memory-limit: "8Gi"    -> set-limit    {"pod_uid": ..., "bytes": 8589934592}

gets those settings for every client the scheduler finds in it (by the pod UID of the
client's cgroup). `PodSettings` holds what the pods ask for and what the scheduler has been
told, and says which requests bring the scheduler up to date: a new or changed annotation sets
its value, a removed annotation, a bad value or a pod that is gone or has finished removes it
(value null). Nothing here reads a socket or a clock; the shell feeds pods in and sends the
requests out.

The DRA driver (nvshare_py/dra) keeps its pods' settings here too: the same three settings,
named by the annotations that carry them for the device plugin, where a memory limit may be
for one device (`set-limit`'s `device`) rather than for all of them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from nvshare_py.sizes import parse_size

WEIGHT = "nvshare.com/weight"
PRIORITY = "nvshare.com/priority"
MEMORY_LIMIT = "nvshare.com/memory-limit"
WEIGHT_RANGE = (1, 1000)
PRIORITY_RANGE = (0, 7)
# A static pod's mirror in the API server has a UID of its own; its containers run under the
# UID the kubelet gave the static pod, which the mirror carries in this annotation.
MIRROR_ANNOTATION = "kubernetes.io/config.mirror"
FINISHED_PHASES = frozenset({"Succeeded", "Failed"})  # no container of the pod runs any more


def _integer_in(low: int, high: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        stripped = text.strip()
        if not re.fullmatch(r"[0-9]{1,9}", stripped) or not low <= int(stripped) <= high:
            raise ValueError(f"not an integer from {low} to {high}")
        return int(stripped)
    return parse


def _size(text: str) -> int:
    # Kubernetes writes binary quantities as 8Gi; nvshare's grammar spells them 8G or 8GiB.
    # (Its 8G is binary too: the same size as NVSHARE_MEMORY_LIMIT=8G.)
    stripped = text.strip()
    if stripped[-1:] in ("i", "I"):
        stripped += "B"
    try:
        return parse_size(stripped)
    except ValueError:
        raise ValueError("not a size such as 8Gi, 512Mi, 8G or 1073741824") from None


@dataclass(frozen=True)
class Annotation:
    """One annotation the plugin reads: the control op it becomes and that op's value key."""

    name: str
    op: str
    key: str
    parse: Callable[[str], int]


ANNOTATIONS = {
    annotation.name: annotation for annotation in (
        Annotation(WEIGHT, "set-weight", "weight", _integer_in(*WEIGHT_RANGE)),
        Annotation(PRIORITY, "set-priority", "priority", _integer_in(*PRIORITY_RANGE)),
        Annotation(MEMORY_LIMIT, "set-limit", "bytes", _size),
    )
}


@dataclass(frozen=True)
class Problem:
    """An annotation value the plugin refuses (it is not applied)."""

    pod: str  # namespace/name
    annotation: str
    value: str
    reason: str
    pod_uid: str = ""  # as the API server knows the pod (for an Event about it)

    def __str__(self) -> str:
        return f"pod {self.pod}: {self.annotation}={self.value!r} ignored: {self.reason}"


@dataclass(frozen=True)
class Pod:
    """What a pod asks of the scheduler: valid annotation values by annotation name (for every
    device), and values for one device by (annotation name, device id)."""

    uid: str
    name: str  # namespace/name, for log lines
    values: dict[str, int] = field(default_factory=dict)
    problems: tuple[Problem, ...] = ()
    device_values: dict[tuple[str, str], int] = field(default_factory=dict)


def read_pod(document: dict) -> Pod | None:
    """A Pod object of the Kubernetes API as settings; None without a UID."""
    metadata = document.get("metadata") or {}
    annotations = metadata.get("annotations") or {}
    api_uid = metadata.get("uid")
    uid = annotations.get(MIRROR_ANNOTATION) or api_uid
    if not isinstance(uid, str) or not uid:
        return None
    name = f"{metadata.get('namespace', '')}/{metadata.get('name', '')}"
    if (document.get("status") or {}).get("phase") in FINISHED_PHASES:
        return Pod(uid, name)
    values: dict[str, int] = {}
    problems = []
    for annotation in ANNOTATIONS.values():
        text = annotations.get(annotation.name)
        if text is None:
            continue
        try:
            values[annotation.name] = annotation.parse(str(text))
        except ValueError as error:
            problems.append(Problem(name, annotation.name, str(text), str(error), str(api_uid or "")))
    return Pod(uid, name, values, tuple(problems))


@dataclass(frozen=True)
class Request:
    """One control request: set (value) or remove (None) the setting `annotation` of a pod, on
    `device` only or (None) on every device."""

    pod_uid: str
    pod: str
    annotation: str
    value: int | None
    device: str | None = None

    @property
    def op(self) -> str:
        return ANNOTATIONS[self.annotation].op

    @property
    def fields(self) -> dict:
        fields = {"pod_uid": self.pod_uid, ANNOTATIONS[self.annotation].key: self.value}
        if self.device is not None:
            fields["device"] = self.device
        return fields

    @property
    def subject(self) -> str:
        """Whom the request is for, in log lines."""
        return f"pod {self.pod} ({self.pod_uid})"

    def __str__(self) -> str:
        where = f" on {self.device}" if self.device is not None else ""
        return f"{self.annotation}={self.value}{where}" if self.value is not None else f"no {self.annotation}{where}"


Key = tuple[str, str, str | None]  # (pod UID, annotation name, device id or None: every device)


class PodSettings:
    """Desired settings (from the pods) against those the scheduler has been told."""

    def __init__(self) -> None:
        self._pods: dict[str, Pod] = {}
        self._told: dict[Key, int] = {}
        self._names: dict[str, str] = {}  # pod UID -> namespace/name, also of pods gone
        self._reported: set[Problem] = set()

    def replace_all(self, pods: list[Pod]) -> list[Problem]:
        """A fresh list of the node's pods (start, or a watch that had to start over): pods
        not in it are gone. Returns the problems not reported before."""
        self._pods = {}
        problems = [problem for pod in pods for problem in self._store(pod)]
        self._tidy()
        return problems

    def update(self, pod: Pod) -> list[Problem]:
        """A pod was added or changed. Returns the problems not reported before."""
        problems = self._store(pod)
        self._tidy()
        return problems

    def remove(self, uid: str) -> None:
        """A pod was deleted."""
        self._pods.pop(uid, None)
        self._tidy()

    def scheduler_restarted(self) -> None:
        """A new scheduler knows none of the settings: every one is sent again."""
        self._told.clear()

    def pending(self, scheduler: Mapping[str, Any] | None = None) -> list[Request]:
        """The requests that bring the scheduler to the pods' settings, removals first.
        (`scheduler`, the scheduler's part of its status, is for the link's other sources,
        whose requests depend on the scheduler's defaults: a pod's settings do not.)"""
        wanted: dict[Key, int] = {}
        for uid, pod in self._pods.items():
            wanted.update({(uid, name, None): value for name, value in pod.values.items()})
            wanted.update({(uid, name, device): value for (name, device), value in pod.device_values.items()})
        requests = [Request(uid, self._names[uid], name, None, device) for (uid, name, device) in self._told
                    if (uid, name, device) not in wanted]
        requests += [Request(uid, self._names[uid], name, value, device)
                     for (uid, name, device), value in wanted.items() if self._told.get((uid, name, device)) != value]
        return requests

    def told(self, request: Request) -> None:
        """The scheduler answered `request` (accepted or refused: sending it again would not
        change the answer until the value or the scheduler changes)."""
        key = (request.pod_uid, request.annotation, request.device)
        if request.value is None:
            self._told.pop(key, None)
        else:
            self._told[key] = request.value
        self._tidy()

    def _store(self, pod: Pod) -> list[Problem]:
        self._pods[pod.uid] = pod
        self._names[pod.uid] = pod.name
        fresh = [problem for problem in pod.problems if problem not in self._reported]
        self._reported.update(fresh)
        return fresh

    def _tidy(self) -> None:
        """Forgets the names of pods that are gone and told nothing, and the reports of bad
        values no pod has any more (a bad value is reported once while it stays, and again if
        it comes back later)."""
        needed = set(self._pods) | {uid for uid, _, _ in self._told}
        self._names = {uid: name for uid, name in self._names.items() if uid in needed}
        self._reported &= {problem for pod in self._pods.values() for problem in pod.problems}
