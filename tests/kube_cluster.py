"""A real Kubernetes control plane (etcd, kube-apiserver, and optionally kube-controller-manager
and kube-scheduler) and a real node (containerd, runc, kubelet) on this machine, on loopback
addresses only, from binaries built with k8s/dra/build.sh (its header says how: the published Go
modules, the machine's Go). For the tests that need a real API server (tests/test_dra_apiserver.py)
and for the DRA end-to-end run (k8s/dra/e2e.py).

Every process is a child of this one, writes its log into the work directory, and is stopped
by `stop()`; certificates are made with openssl for this run only (a CA, the servers'
certificates, an admin, the controllers, the node). Ports are free ones found at start.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

WAIT_S = 120.0  # a generous bound: the API server's first start on a busy 2-core machine takes ~20 s
BINARIES = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubelet", "kubectl")
NODE_BINARIES = ("containerd", "containerd-shim-runc-v2", "ctr", "loopback")
DEFAULT_BIN = Path(os.environ.get("NVSHARE_KUBE_BIN", "/var/tmp/nvdra/bin"))
SERVICE_IP_RANGE = "10.96.0.0/24"
DEVICE_PLUGINS = Path("/var/lib/kubelet/device-plugins")  # virtual: the kubernetes Service's address; nothing listens there


def find_binaries(directory: Path = DEFAULT_BIN, names: tuple[str, ...] = BINARIES) -> Path | None:
    """The directory holding the binaries, or None where they are not built."""
    return directory if all((directory / name).is_file() for name in names) else None


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _run(command: list[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(command, check=True, capture_output=True, text=True, **kwargs)


class Pki:
    """A CA of this run and the certificates signed by it."""

    def __init__(self, directory: Path):
        self.dir = directory
        directory.mkdir(parents=True, exist_ok=True)
        self.ca_cert, self.ca_key = directory / "ca.crt", directory / "ca.key"
        _run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=nvshare-test-ca",
              "-keyout", str(self.ca_key), "-out", str(self.ca_cert)])
        # The service account token signing key pair.
        self.sa_key, self.sa_pub = directory / "sa.key", directory / "sa.pub"
        _run(["openssl", "genrsa", "-out", str(self.sa_key), "2048"])
        _run(["openssl", "rsa", "-in", str(self.sa_key), "-pubout", "-out", str(self.sa_pub)])

    def certificate(self, name: str, subject: str, *, server_names: tuple[str, ...] = (),
                    client: bool = True) -> tuple[Path, Path]:
        """(certificate, key) for `subject` ("/CN=.../O=..."); server_names make it a serving one."""
        cert, key, request = self.dir / f"{name}.crt", self.dir / f"{name}.key", self.dir / f"{name}.csr"
        _run(["openssl", "req", "-newkey", "rsa:2048", "-nodes", "-subj", subject, "-keyout", str(key), "-out", str(request)])
        usages = ["clientAuth"] if client else []
        extensions = ["basicConstraints=CA:FALSE", "keyUsage=critical,digitalSignature,keyEncipherment"]
        if server_names:
            usages.append("serverAuth")
            extensions.append("subjectAltName=" + ",".join(
                f"IP:{entry}" if entry[0].isdigit() else f"DNS:{entry}" for entry in server_names))
        extensions.append("extendedKeyUsage=" + ",".join(usages))
        extfile = self.dir / f"{name}.ext"
        extfile.write_text("\n".join(extensions) + "\n")
        _run(["openssl", "x509", "-req", "-in", str(request), "-CA", str(self.ca_cert), "-CAkey", str(self.ca_key),
              "-CAcreateserial", "-days", "2", "-extfile", str(extfile), "-out", str(cert)])
        return cert, key


def write_kubeconfig(path: Path, server: str, ca: Path, cert: Path, key: Path) -> Path:
    """A kubeconfig (JSON is YAML) for one client certificate."""
    path.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "test",
        "clusters": [{"name": "test", "cluster": {"server": server, "certificate-authority": str(ca)}}],
        "users": [{"name": "test", "user": {"client-certificate": str(cert), "client-key": str(key)}}],
        "contexts": [{"name": "test", "context": {"cluster": "test", "user": "test"}}],
    }, indent=1))
    return path


def _feature_gates(gates: dict[str, bool]) -> list[str]:
    return [f"--feature-gates={','.join(f'{name}={str(on).lower()}' for name, on in sorted(gates.items()))}"] if gates else []


@dataclass
class Process:
    name: str
    popen: subprocess.Popen
    log: Path


@dataclass
class ControlPlane:
    work: Path
    bin: Path
    feature_gates: dict[str, bool] = field(default_factory=dict)
    controllers: bool = True  # kube-controller-manager and kube-scheduler as well

    def __post_init__(self) -> None:
        self.work.mkdir(parents=True, exist_ok=True)
        self.logs = self.work / "logs"
        self.logs.mkdir(exist_ok=True)
        self.processes: list[Process] = []
        self.pki = Pki(self.work / "pki")
        self.port = free_port()
        self.url = f"https://127.0.0.1:{self.port}"
        self.serving = self.pki.certificate("apiserver", "/CN=kube-apiserver", client=False, server_names=(
            "127.0.0.1", "10.96.0.1", "localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc"))
        self.kubelet_client = self.pki.certificate("apiserver-kubelet-client", "/CN=kube-apiserver-kubelet-client/O=kubeadm:cluster-admins")
        self.admin = write_kubeconfig(self.work / "admin.kubeconfig", self.url, self.pki.ca_cert,
                                      *self.pki.certificate("admin", "/CN=nvshare-test-admin/O=system:masters"))

    # ---- processes ----------------------------------------------------------------------

    def spawn(self, name: str, command: list[str], env: dict[str, str] | None = None) -> Process:
        log = self.logs / f"{name}.log"
        with open(log, "ab") as out:
            popen = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        process = Process(name, popen, log)
        self.processes.append(process)
        return process

    def stop_process(self, process: Process, timeout: float = 30.0) -> None:
        if process.popen.poll() is None:
            process.popen.send_signal(signal.SIGTERM)
            try:
                process.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                process.popen.kill()
                process.popen.wait()
        if process in self.processes:
            self.processes.remove(process)

    def stop(self) -> None:
        for process in reversed(list(self.processes)):
            self.stop_process(process)

    def check_running(self) -> None:
        for process in self.processes:
            if process.popen.poll() is not None:
                tail = process.log.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{process.name} exited with status {process.popen.returncode}:\n{tail}")

    # ---- the control plane ----------------------------------------------------------------

    def start(self) -> "ControlPlane":
        client, peer = free_port(), free_port()
        self.etcd_url = f"http://127.0.0.1:{client}"
        self.spawn("etcd", [str(self.bin / "etcd"), "--name", "test", "--data-dir", str(self.work / "etcd"),
                            "--listen-client-urls", self.etcd_url, "--advertise-client-urls", self.etcd_url,
                            "--listen-peer-urls", f"http://127.0.0.1:{peer}",
                            "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
                            "--initial-cluster", f"test=http://127.0.0.1:{peer}", "--log-level", "warn"])
        pki = self.pki
        self.spawn("kube-apiserver", [
            str(self.bin / "kube-apiserver"), "--etcd-servers", self.etcd_url,
            "--bind-address", "127.0.0.1", "--advertise-address", "127.0.0.1", "--secure-port", str(self.port),
            "--endpoint-reconciler-type", "none", "--service-cluster-ip-range", SERVICE_IP_RANGE,
            "--client-ca-file", str(pki.ca_cert), "--tls-cert-file", str(self.serving[0]),
            "--tls-private-key-file", str(self.serving[1]),
            "--service-account-issuer", "https://kubernetes.default.svc.cluster.local",
            "--service-account-key-file", str(pki.sa_pub), "--service-account-signing-key-file", str(pki.sa_key),
            "--authorization-mode", "Node,RBAC", "--enable-admission-plugins", "NodeRestriction",
            "--kubelet-client-certificate", str(self.kubelet_client[0]),
            "--kubelet-client-key", str(self.kubelet_client[1]),
            "--kubelet-certificate-authority", str(pki.ca_cert),
            "--allow-privileged=true", "--profiling=false", *_feature_gates(self.feature_gates)])
        self.wait_for(lambda: self.kubectl("get", "--raw", "/readyz", check=False).returncode == 0,
                      "the API server to be ready")
        if self.controllers:
            self._start_controllers()
            # Pods can be created once the service account controller made the namespace's.
            self.wait_for(lambda: self.kubectl("get", "serviceaccount", "default", check=False).returncode == 0,
                          "the default service account")
        return self

    def _start_controllers(self) -> None:
        pki = self.pki
        manager = write_kubeconfig(self.work / "controller-manager.kubeconfig", self.url, pki.ca_cert,
                                   *pki.certificate("controller-manager", "/CN=system:kube-controller-manager"))
        self.spawn("kube-controller-manager", [
            str(self.bin / "kube-controller-manager"), "--kubeconfig", str(manager),
            "--authentication-kubeconfig", str(manager), "--authorization-kubeconfig", str(manager),
            "--bind-address", "127.0.0.1", "--secure-port", str(free_port()), "--leader-elect=false",
            "--use-service-account-credentials=true", "--service-account-private-key-file", str(pki.sa_key),
            "--root-ca-file", str(pki.ca_cert), "--cluster-signing-cert-file", str(pki.ca_cert),
            "--cluster-signing-key-file", str(pki.ca_key), "--controllers", "*", "--profiling=false",
            *_feature_gates(self.feature_gates)])
        scheduler = write_kubeconfig(self.work / "scheduler.kubeconfig", self.url, pki.ca_cert,
                                     *pki.certificate("scheduler", "/CN=system:kube-scheduler"))
        self.spawn("kube-scheduler", [
            str(self.bin / "kube-scheduler"), "--kubeconfig", str(scheduler),
            "--authentication-kubeconfig", str(scheduler), "--authorization-kubeconfig", str(scheduler),
            "--bind-address", "127.0.0.1", "--secure-port", str(free_port()), "--leader-elect=false",
            "--profiling=false", *_feature_gates(self.feature_gates)])

    def kubectl(self, *args: str, input: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
        result = subprocess.run([str(self.bin / "kubectl"), "--kubeconfig", str(self.admin), *args], input=input,
                                capture_output=True, text=True, timeout=WAIT_S)
        if check and result.returncode != 0:
            raise RuntimeError(f"kubectl {' '.join(args)} failed: {result.stderr.strip()}")
        return result

    def get(self, *args: str) -> dict:
        """`kubectl get ... -o json` as a document."""
        return json.loads(self.kubectl("get", *args, "-o", "json").stdout)

    def apply(self, document: dict | str) -> None:
        self.kubectl("apply", "-f", "-", input=document if isinstance(document, str) else json.dumps(document))

    def token(self, namespace: str, account: str, *bound: str) -> str:
        """A token of the service account (TokenRequest), bound to an object if given
        (`--bound-object-kind Pod --bound-object-name X --bound-object-uid U`)."""
        return self.kubectl("create", "token", account, "-n", namespace, "--duration", "2h", *bound).stdout.strip()

    def wait_for(self, predicate, what: str, timeout: float = WAIT_S):
        """Waits for `predicate()` to return something true; says what it saw when it expires."""
        deadline = time.monotonic() + timeout
        last = None
        while True:
            self.check_running()
            try:
                last = predicate()
            except (RuntimeError, subprocess.SubprocessError, ValueError, KeyError, OSError) as error:
                last = error
            if last and not isinstance(last, Exception):
                return last
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {what} within {timeout} s; last saw {last!r}")
            time.sleep(0.5)


@dataclass
class Node:
    """containerd + runc + a kubelet registered as `name`, for pods with hostNetwork (the CNI
    configuration holds only the loopback plugin: no pod network, so no other address)."""

    cluster: ControlPlane
    work: Path
    name: str = "nvshare-e2e"
    runc: str = "runc"
    sandbox_image: str = "registry.example.com/nvshare-test/busybox:local"
    feature_gates: dict[str, bool] = field(default_factory=dict)
    verbosity: int = 2  # the kubelet's --v (3 logs which DRA service it chose)

    def __post_init__(self) -> None:
        self.work.mkdir(parents=True, exist_ok=True)
        self.containerd_socket = self.work / "containerd" / "containerd.sock"
        self.root_dir = self.work / "kubelet"
        self.cdi_dir = self.work / "cdi"
        self.pod_logs = self.work / "pod-logs"
        self.kubelet_process: Process | None = None
        # The kubelet serves device plugins in /var/lib/kubelet/device-plugins whatever its
        # --root-dir: what it makes there is removed by cleanup() unless it was there before.
        self.made_var_lib_kubelet = not DEVICE_PLUGINS.parent.exists()

    @property
    def registry_dir(self) -> Path:
        return self.root_dir / "plugins_registry"

    @property
    def plugins_dir(self) -> Path:
        return self.root_dir / "plugins"

    def ctr(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run([str(self.cluster.bin / "ctr"), "--address", str(self.containerd_socket), "-n", "k8s.io",
                               *args], capture_output=True, text=True, check=check, timeout=WAIT_S)

    def start_containerd(self) -> None:
        work, bin_dir = self.work, self.cluster.bin
        cni_bin, cni_conf = work / "cni" / "bin", work / "cni" / "conf"
        for directory in (cni_bin, cni_conf, self.cdi_dir, work / "containerd"):
            directory.mkdir(parents=True, exist_ok=True)
        shutil.copy(bin_dir / "loopback", cni_bin / "loopback")
        (cni_conf / "10-loopback.conflist").write_text(json.dumps(
            {"cniVersion": "1.0.0", "name": "nvshare-test-lo", "plugins": [{"type": "loopback"}]}))
        # Without CAP_SYS_RESOURCE (a VM that withholds it) lowering oom_score_adj fails, and the
        # kubelet asks -998 for every pod sandbox: keep scores at containerd's or above then.
        try:
            Path("/proc/self/oom_score_adj").write_text("-1")
            restrict = "false"
        except OSError:
            restrict = "true"
        (work / "containerd" / "config.toml").write_text(f"""version = 3
root = '{work}/containerd/root'
state = '{work}/containerd/state'
[grpc]
  address = '{self.containerd_socket}'
[plugins]
  [plugins.'io.containerd.cri.v1.images']
    snapshotter = 'native'
    [plugins.'io.containerd.cri.v1.images'.pinned_images]
      sandbox = '{self.sandbox_image}'
  [plugins.'io.containerd.cri.v1.runtime']
    enable_cdi = true
    cdi_spec_dirs = ['{self.cdi_dir}']
    restrict_oom_score_adj = {restrict}
    [plugins.'io.containerd.cri.v1.runtime'.containerd]
      default_runtime_name = 'runc'
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
        runtime_type = 'io.containerd.runc.v2'
        [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
          BinaryName = '{self.runc}'
    [plugins.'io.containerd.cri.v1.runtime'.cni]
      bin_dirs = ['{cni_bin}']
      conf_dir = '{cni_conf}'
""")
        env = dict(os.environ, PATH=f"{bin_dir}:{os.environ.get('PATH', '/usr/bin:/bin')}")
        self.cluster.spawn("containerd", [str(bin_dir / "containerd"), "--config", str(work / "containerd" / "config.toml")],
                           env=env)
        self.cluster.wait_for(lambda: self.ctr("version", check=False).returncode == 0, "containerd to answer")

    def import_image(self, archive: Path) -> None:
        self.ctr("images", "import", str(archive))

    def start_kubelet(self) -> None:
        cluster, pki = self.cluster, self.cluster.pki
        if not hasattr(self, "kubelet_kubeconfig"):
            self.kubelet_kubeconfig = write_kubeconfig(
                self.work / "kubelet.kubeconfig", cluster.url, pki.ca_cert,
                *pki.certificate("kubelet-client", f"/CN=system:node:{self.name}/O=system:nodes"))
            self.serving = pki.certificate("kubelet-serving", f"/CN={self.name}", client=False,
                                           server_names=("127.0.0.1", self.name))
            self.kubelet_port, self.healthz_port = free_port(), free_port()
        config = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
            "address": "127.0.0.1", "port": self.kubelet_port, "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1", "healthzPort": self.healthz_port,
            "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": False},
                               "x509": {"clientCAFile": str(pki.ca_cert)}},
            "authorization": {"mode": "AlwaysAllow"},
            "tlsCertFile": str(self.serving[0]), "tlsPrivateKeyFile": str(self.serving[1]),
            "cgroupDriver": "cgroupfs", "failSwapOn": False, "failCgroupV1": False,
            "containerRuntimeEndpoint": f"unix://{self.containerd_socket}",
            "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
            "evictionHard": {"memory.available": "1Mi", "nodefs.available": "1%", "imagefs.available": "1%"},
            "podLogsDir": str(self.pod_logs), "fileCheckFrequency": "1s", "syncFrequency": "5s",
            "featureGates": self.feature_gates, "serializeImagePulls": False,
            "protectKernelDefaults": False, "localStorageCapacityIsolation": False,
        }
        self.pod_logs.mkdir(parents=True, exist_ok=True)
        (self.work / "kubelet-config.json").write_text(json.dumps(config, indent=1))
        self.kubelet_process = cluster.spawn("kubelet", [
            str(cluster.bin / "kubelet"), "--config", str(self.work / "kubelet-config.json"),
            "--kubeconfig", str(self.kubelet_kubeconfig), "--root-dir", str(self.root_dir),
            "--hostname-override", self.name, "--node-ip", "127.0.0.1", "--v", str(self.verbosity)])

    def stop_kubelet(self) -> None:
        if self.kubelet_process is not None:
            self.cluster.stop_process(self.kubelet_process)
            self.kubelet_process = None

    def wait_ready(self) -> dict:
        def ready():
            node = self.cluster.get("node", self.name)
            conditions = {c["type"]: c["status"] for c in node["status"].get("conditions", [])}
            return node if conditions.get("Ready") == "True" else False
        return self.cluster.wait_for(ready, f"node {self.name} to be Ready")

    def cleanup(self) -> None:
        """Stops the kubelet, ends the containers, and removes what the kubelet made outside the
        work directory: /var/lib/kubelet (if it made it) and the pods' cgroups."""
        self.stop_kubelet()
        self.remove_containers()
        if self.made_var_lib_kubelet:
            shutil.rmtree(DEVICE_PLUGINS.parent, ignore_errors=True)
        else:
            (DEVICE_PLUGINS / "kubelet.sock").unlink(missing_ok=True)
        for hierarchy in Path("/sys/fs/cgroup").iterdir():
            root = hierarchy / "kubepods"
            if root.is_dir():
                for directory in sorted((d for d in root.rglob("*") if d.is_dir()), key=lambda d: -len(d.parts)) + [root]:
                    try:
                        directory.rmdir()
                    except OSError:
                        pass  # still used, or not removable in this hierarchy

    def kill_shims(self) -> None:
        """containerd's runc shims of this node that outlived containerd (those of sandboxes
        it had no time to delete): each is found by the socket of this node's containerd on its
        command line, so no other containerd's shim is touched."""
        marker = str(self.containerd_socket).encode()
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue  # gone
            if argv and argv[0].endswith(b"containerd-shim-runc-v2") and marker in argv:
                try:
                    os.kill(int(entry.name), signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def remove_containers(self) -> None:
        """Containers outlive the kubelet and containerd (their shims keep them): end them."""
        if self.ctr("version", check=False).returncode != 0:
            return
        for task in self.ctr("tasks", "ls", "-q", check=False).stdout.split():
            self.ctr("tasks", "kill", "-s", "SIGKILL", task, check=False)
        time.sleep(1)
        for task in self.ctr("tasks", "ls", "-q", check=False).stdout.split():
            self.ctr("tasks", "delete", "-f", task, check=False)
