"""Which Kubernetes pod a process runs in, from its cgroup (`/proc/<pid>/cgroup`), and when the
process started (`/proc/<pid>/stat`): what the daemon learns of a client from the kernel.

The kubelet puts every container of a pod under one cgroup named after the pod's UID:
- systemd cgroup driver: `.../kubepods-burstable-pod<uid>.slice/cri-containerd-<id>.scope`
  (also `kubepods-pod<uid>.slice` for Guaranteed pods, `kubepods-besteffort-pod...`, and a
  `kubelet-` prefix on some set-ups, kind's among them); systemd does not allow '-' inside a
  unit name's parts, so the UID's dashes are written as '_';
- cgroupfs driver: `/kubepods/<qos>/pod<uid>/<container id>` (`/kubepods/pod<uid>/...` for
  Guaranteed pods).
The path may carry a prefix (a node that is itself a container: `/docker/<id>/kubepods/...`) or
be relative to the reader's cgroup namespace (`/../../kubepods-...`): the pod's part is found
wherever it is. A process cannot move itself into another pod's cgroup, which is why the
scheduler trusts this and not what a client says about itself.
"""

from __future__ import annotations

import re
from pathlib import Path

# A pod UID as the API server makes it (a dashed UUID), or as the kubelet makes it for a
# static pod (32 hex digits of a hash).
_UID = r"[0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12}|[0-9a-f]{32}"
_SYSTEMD_POD = re.compile(rf"(?:[a-z]+-)*kubepods(?:-[a-z]+)*-pod({_UID})\.slice")
_CGROUPFS_POD = re.compile(rf"pod({_UID})")


def pod_uid_from_cgroup(text: str) -> str:
    """The pod UID in the contents of a /proc/<pid>/cgroup file (v1: one line per hierarchy;
    v2: the single `0::` line), with dashes as the API server writes it; "" outside a pod."""
    if "kubepods" not in text:
        return ""  # both drivers' names have it: outside Kubernetes, skip the patterns (one a connection)
    for line in text.splitlines():
        _, _, path = line.partition(":")
        _, _, path = path.partition(":")
        parts = path.split("/")
        for index, part in enumerate(parts):
            systemd = _SYSTEMD_POD.fullmatch(part)
            if systemd is not None:
                return systemd.group(1).replace("_", "-")
            cgroupfs = _CGROUPFS_POD.fullmatch(part)
            # `pod<uid>` only counts below a `kubepods` level, so that an unrelated cgroup
            # that happens to be named pod<hex> is not taken for a pod.
            if cgroupfs is not None and "kubepods" in parts[:index]:
                return cgroupfs.group(1).replace("_", "-")
    return ""


def pod_uid_of_process(pid: int, proc: Path = Path("/proc")) -> str:
    """The pod UID of process `pid` (a pid the kernel vouched for), "" outside a pod or when
    its cgroup cannot be read (the process is gone, or /proc is not the host's)."""
    if pid <= 0:
        return ""
    try:
        text = (proc / str(pid) / "cgroup").read_text()
    except OSError:
        return ""
    return pod_uid_from_cgroup(text)


def process_start_time(pid: int, proc: Path = Path("/proc")) -> int:
    """When process `pid` started (field 22 of /proc/<pid>/stat, clock ticks since boot), 0 when
    it cannot be read. With the pid it names one process for its whole life: a pid reused by a
    later process comes with another start time."""
    if pid <= 0:
        return 0
    try:
        text = (proc / str(pid) / "stat").read_text()
    except OSError:
        return 0
    # The command name (field 2) is in parentheses and may hold spaces or ')': skip past the last.
    fields = text[text.rfind(")") + 2:].split()
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return 0
