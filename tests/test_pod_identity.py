"""The scheduler's pod identity of a client: the pod UID in its process's cgroup, in every
layout the kubelet writes (cgroup v1 and v2, systemd and cgroupfs drivers), never a name the
client gives itself."""

from __future__ import annotations

import pytest

from nvshare_py.scheduler.podcgroup import pod_uid_from_cgroup, pod_uid_of_process

UID = "8e0c2f5a-1b3d-4c6e-9f70-2a4b6c8d0e1f"
SYSTEMD_UID = UID.replace("-", "_")
CONTAINER = "3f6d0e1b9a2c4d5e6f708192a3b4c5d6e7f8091a2b3c4d5e6f708192a3b4c5d"


@pytest.mark.parametrize("text", [
    # cgroup v2, systemd driver, containerd (Burstable pod)
    f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{SYSTEMD_UID}.slice/"
    f"cri-containerd-{CONTAINER}.scope\n",
    # cgroup v2, systemd driver, Guaranteed pod (no QoS level), CRI-O
    f"0::/kubepods.slice/kubepods-pod{SYSTEMD_UID}.slice/crio-{CONTAINER}.scope\n",
    # cgroup v2 seen from inside another cgroup namespace (the scheduler's own pod)
    f"0::/../../kubepods-besteffort-pod{SYSTEMD_UID}.slice/cri-containerd-{CONTAINER}.scope\n",
    # kind: the kubelet's cgroups below kubelet.slice, systemd driver
    f"0::/kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-besteffort.slice/"
    f"kubelet-kubepods-besteffort-pod{SYSTEMD_UID}.slice/cri-containerd-{CONTAINER}.scope\n",
    # cgroup v2, cgroupfs driver
    f"0::/kubepods/burstable/pod{UID}/{CONTAINER}\n",
    # cgroup v1, cgroupfs driver, Docker shim era, one line per hierarchy
    f"12:pids:/kubepods/besteffort/pod{UID}/{CONTAINER}\n"
    f"11:memory:/kubepods/besteffort/pod{UID}/{CONTAINER}\n"
    f"4:cpu,cpuacct:/kubepods/besteffort/pod{UID}/{CONTAINER}\n"
    f"1:name=systemd:/kubepods/besteffort/pod{UID}/{CONTAINER}\n",
    # cgroup v1, Guaranteed pod, on a node that is itself a Docker container
    f"5:memory:/docker/{CONTAINER}/kubepods/pod{UID}/{CONTAINER}\n",
    # cgroup v1 systemd driver, with the unified line of a hybrid set-up first
    f"0::/\n"
    f"9:memory:/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{SYSTEMD_UID}.slice/"
    f"docker-{CONTAINER}.scope\n",
], ids=["v2-systemd-containerd", "v2-systemd-guaranteed-crio", "v2-cgroupns-relative", "kind",
        "v2-cgroupfs", "v1-cgroupfs", "v1-docker-in-docker", "hybrid-systemd"])
def test_the_pod_uid_is_found_in_every_kubelet_layout(text):
    assert pod_uid_from_cgroup(text) == UID


def test_a_static_pods_hash_uid_is_found():
    static = "2b3c4d5e6f708192a3b4c5d6e7f80912"
    text = f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{static}.slice/crio-{CONTAINER}.scope\n"
    assert pod_uid_from_cgroup(text) == static


@pytest.mark.parametrize("text", [
    "0::/user.slice/user-1000.slice/user@1000.service/app.slice/jupyter.service\n",
    "0::/system.slice/docker-" + CONTAINER + ".scope\n",
    "0::/\n",
    "",
    # named pod<uid> but not under the kubelet's tree: someone's own cgroup
    f"0::/user.slice/pod{UID}/job\n",
    # a malformed UID
    "0::/kubepods.slice/kubepods-podnot_a_uid.slice/x.scope\n",
], ids=["desktop-session", "plain-docker", "root", "empty", "pod-name-outside-kubepods", "malformed"])
def test_outside_a_pod_there_is_no_pod_uid(text):
    assert pod_uid_from_cgroup(text) == ""


def test_the_daemon_reads_the_cgroup_of_the_process_it_is_given(tmp_path):
    (tmp_path / "4242").mkdir()
    (tmp_path / "4242" / "cgroup").write_text(f"0::/kubepods/burstable/pod{UID}/{CONTAINER}\n")
    assert pod_uid_of_process(4242, proc=tmp_path) == UID
    # Gone, or not visible in the daemon's pid namespace (host_pid 0): no pod.
    assert pod_uid_of_process(4343, proc=tmp_path) == ""
    assert pod_uid_of_process(0, proc=tmp_path) == ""
