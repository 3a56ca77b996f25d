"""The nvshare DRA driver end to end on a real Kubernetes (opt-in; k8s/dra/e2e.sh runs it).

A control plane (etcd, kube-apiserver, kube-controller-manager, kube-scheduler) and a node
(containerd, runc, kubelet) on this machine, from binaries built with the machine's Go
(k8s/dra/build.sh), loopback addresses only; the nvshare scheduler and the DRA driver on two
GPUs of the simulated NVML, with stand-in device nodes (character devices with /dev/null's
numbers). k8s/dra's RBAC, admission policy and DeviceClasses are applied as an operator would;
the driver runs on the node as a process (not as the DaemonSet, whose image this machine cannot
build) with a token of its service account bound to a pod on the node, which is what the
DaemonSet's pod would have. The pods are k8s/dra/examples' claims with a container of this
run's image: busybox, and simapp on the simulated CUDA driver (k8s/dra/gpu_image.py), so each
container is a real client of the nvshare scheduler through the injected libnvshare.so. All
pods use the host's network: the node has no pod network (no address but loopback).

    python k8s/dra/e2e.py [--no-consumable-capacity] RESULT.json    (as root; exit 0: all passed)
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))
from kube_cluster import WAIT_S, ControlPlane, Node, Process, find_binaries  # noqa: E402

IMAGE = "registry.example.com/nvshare-test/gpu:local"
DRIVER = "gpu.nvshare.com"
NODE = "nvshare-e2e"
GiB = 1 << 30


def uuid(index: int) -> str:
    return f"GPU-5151ad00-0000-4000-8000-{index:012x}"


class Run:
    def __init__(self, work: Path, consumable: bool):
        self.work = work
        self.consumable = consumable
        self.checks: list[dict] = []
        self.seen: dict[str, dict] = {}  # what each pod printed, for the record
        self.python = sys.executable
        bin_dir = find_binaries()
        if bin_dir is None or find_binaries(names=("containerd", "containerd-shim-runc-v2", "ctr", "loopback")) is None:
            raise SystemExit("e2e: binaries missing; run k8s/dra/build.sh")
        gates = {"DRAConsumableCapacity": consumable}
        self.cluster = ControlPlane(work, bin_dir, gates)
        self.node = Node(self.cluster, work / "node", NODE, sandbox_image=IMAGE, feature_gates=gates, verbosity=3)
        self.driver: Process | None = None
        self.sim = work / "sim"
        self.lib = work / "lib"
        self.dev = work / "dev"
        self.nvshare = work / "nvshare"

    # ---- checks -------------------------------------------------------------------------------

    def check(self, name: str, detail: str, predicate, timeout: float = WAIT_S) -> bool:
        """Passes when `predicate()` returns something true within `timeout`."""
        deadline = time.monotonic() + timeout
        last = None
        while True:
            try:
                last = predicate()
            except (RuntimeError, subprocess.SubprocessError, ValueError, KeyError, IndexError, OSError) as error:
                last = error
            if last and not isinstance(last, Exception):
                break
            if time.monotonic() > deadline:
                self.checks.append({"check": name, "passed": False, "detail": detail, "last_seen": repr(last)[:2000]})
                print(f"FAIL {name}: {detail} (last saw {repr(last)[:300]})", flush=True)
                return False
            time.sleep(0.5)
        self.checks.append({"check": name, "passed": True, "detail": detail})
        print(f"ok   {name}: {detail}", flush=True)
        return True

    # ---- the node's nvshare parts ------------------------------------------------------------

    def sim_env(self) -> dict[str, str]:
        return dict(os.environ, LD_LIBRARY_PATH=str(self.sim), SIMCUDA_DEVICES="2", SIMCUDA_MEMORY="16G",
                    PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")

    def build(self) -> None:
        for directory, target in ((self.sim, "tests/simcuda"), (self.lib, "interceptor")):
            subprocess.run(["make", "-s", "-C", str(REPO / target), f"BUILD={directory}"], check=True,
                           capture_output=True)
        self.dev.mkdir()
        for name in ("nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm"):
            os.mknod(self.dev / name, 0o666 | 0o020000, os.makedev(1, 3))
        subprocess.run([self.python, str(REPO / "k8s/dra/gpu_image.py"), shutil.which("busybox"), str(self.sim),
                        str(self.work / "image.tar"), IMAGE], check=True)

    def start_scheduler(self) -> None:
        self.cluster.spawn("nvshare-scheduler", [self.python, "-m", "nvshare_py.scheduler", "--socket-dir",
                                                 str(self.nvshare), "--log-level", "info"], env=self.sim_env())

    def nvsharectl(self, *args: str) -> dict:
        result = subprocess.run([self.python, "-m", "ctl", "--socket-dir", str(self.nvshare), *args, "-o", "json"],
                                capture_output=True, text=True, env=self.sim_env(), cwd=REPO, timeout=60)
        if result.returncode != 0:
            raise RuntimeError(f"nvsharectl {' '.join(args)}: {result.stderr.strip()}")
        return json.loads(result.stdout)

    def driver_credentials(self) -> Path:
        """A token of the driver's service account bound to a pod on the node, as its
        DaemonSet pod has (the token names the node: the admission policy checks it)."""
        cluster = self.cluster
        cluster.apply({"apiVersion": "v1", "kind": "Pod",
                       "metadata": {"name": "nvshare-dra-driver-identity", "namespace": "nvshare-system"},
                       "spec": {"nodeName": NODE, "hostNetwork": True, "serviceAccountName": "nvshare-dra-driver",
                                "automountServiceAccountToken": False,
                                "containers": [{"name": "idle", "image": IMAGE, "imagePullPolicy": "Never"}]}})
        pod = cluster.wait_for(lambda: (p := cluster.get("pod", "nvshare-dra-driver-identity", "-n", "nvshare-system"))
                               ["status"].get("phase") == "Running" and p, "the driver's identity pod")
        token = cluster.token("nvshare-system", "nvshare-dra-driver", "--bound-object-kind", "Pod",
                              "--bound-object-name", pod["metadata"]["name"], "--bound-object-uid", pod["metadata"]["uid"])
        directory = self.work / "dra-credentials"
        directory.mkdir(exist_ok=True)
        (directory / "token").write_text(token)
        shutil.copy(cluster.pki.ca_cert, directory / "ca.crt")
        return directory

    def start_driver(self, credentials: Path) -> None:
        node = self.node
        self.driver = self.cluster.spawn("nvshare-dra-driver", [
            self.python, "-m", "nvshare_py.dra", "serve", "--node-name", NODE, "--api-server", self.cluster.url,
            "--api-credentials", str(credentials), "--registry-dir", str(node.registry_dir),
            "--plugins-dir", str(node.plugins_dir), "--cdi-dir", str(node.cdi_dir), "--socket-dir", str(self.nvshare),
            "--library", str(self.lib / "libnvshare.so"), "--device-dir", str(self.dev), "--slice-interval", "5"],
            env=self.sim_env())

    def driver_log(self) -> str:
        return (self.cluster.logs / "nvshare-dra-driver.log").read_text()

    # ---- pods -------------------------------------------------------------------------------

    def pod_command(self, allocations: tuple[str, ...] = ()) -> list[str]:
        """What each container runs: it shows what it got, then runs simapp on its GPU, which
        registers with the nvshare scheduler, runs a kernel (under the scheduler's lock),
        tries `allocations` and stays."""
        steps = " ".join(["meminfo", "alloc:plain:1M", "fill:0:7", "check:0:7",
                          *(f"alloc:plain:{size}" for size in allocations), "sleep:3600000"])
        return ["/bin/sh", "-c",
                "echo '== env'; env; echo '== mounts'; grep nvshare /proc/mounts; echo '== dev'; ls -l /dev; "
                "echo '== client'; ls \"$NVSHARE_SOCKET_DIR/client\"; echo '== gpu'; "
                f"CUDA_VISIBLE_DEVICES=$NVIDIA_VISIBLE_DEVICES exec /usr/lib/sim/simapp {steps}"]

    def localise(self, document: dict, allocations: tuple[str, ...] = ()) -> dict:
        """An example's workload with this run's container: its image and command, the host's
        network, the simulated GPUs' environment and the downward API names nvshare shows."""
        document = copy.deepcopy(document)
        spec = document["spec"] if document["kind"] == "Pod" else document["spec"]["template"]["spec"]
        spec["hostNetwork"] = True
        spec["terminationGracePeriodSeconds"] = 2
        for container in spec["containers"]:
            container.update(image=IMAGE, imagePullPolicy="Never", command=self.pod_command(allocations))
            container.pop("ports", None)
            container.setdefault("resources", {}).pop("requests", None)
            container["resources"].pop("limits", None)
            container["env"] = [{"name": "SIMCUDA_DEVICES", "value": "2"}, {"name": "SIMCUDA_MEMORY", "value": "16G"},
                                {"name": "NVSHARE_POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                                {"name": "NVSHARE_POD_NAMESPACE",
                                 "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}}]
        return document

    def example(self, name: str) -> list[dict]:
        return [doc for doc in yaml.safe_load_all((REPO / "k8s/dra/examples" / name).read_text()) if doc]

    def deploy(self, name: str, selector: str, replicas: int, check: str, detail: str) -> list[dict]:
        """Example `name`: what its pods use, then a Deployment of `replicas` of them (localised),
        applied; check `check` waits until they all run. Its pods (none if they never ran)."""
        used, deployment = self.example(name)
        deployment["spec"]["replicas"] = replicas
        self.cluster.apply(used)
        self.cluster.apply(self.localise(deployment))

        def running() -> list[dict] | bool:
            return self.all_running("nvshare-examples", selector, replicas)
        self.check(check, detail, running)
        return running() or []

    def pod(self, namespace: str, name: str) -> dict:
        return self.cluster.get("pod", name, "-n", namespace)

    def pods(self, namespace: str, selector: str) -> list[dict]:
        return self.cluster.get("pods", "-n", namespace, "-l", selector)["items"]

    def pod_log(self, pod: dict) -> str:
        metadata = pod["metadata"]
        directory = self.node.pod_logs / f"{metadata['namespace']}_{metadata['name']}_{metadata['uid']}"
        return "".join(path.read_text() for path in sorted(directory.glob("*/*.log")))

    def saw(self, pod: dict) -> dict:
        """What the container printed: its variables, nvshare mounts, nvidia device nodes, the
        client socket directory and simapp's steps."""
        text = "\n".join(line.split(" ", 3)[-1] for line in self.pod_log(pod).splitlines())
        parts, current = {}, None
        for line in text.splitlines():
            if line.startswith("== "):
                current = line[3:]
                parts[current] = []
            elif current is not None:
                parts[current].append(line)
        env = dict(line.split("=", 1) for line in parts.get("env", []) if "=" in line)
        steps = [json.loads(line) for line in parts.get("gpu", []) if line.startswith("{")]
        return {"env": {key: value for key, value in env.items()
                        if key.startswith(("NVSHARE", "NVIDIA", "LD_PRELOAD", "CUDA"))},
                "mounts": parts.get("mounts", []), "dev": [line for line in parts.get("dev", []) if "nvidia" in line],
                "client": parts.get("client", []), "steps": steps}

    def running(self, pod: dict) -> dict | bool:
        """The pod again once it runs and simapp has run its kernel."""
        pod = self.pod(pod["metadata"]["namespace"], pod["metadata"]["name"])
        if pod["status"].get("phase") != "Running":
            return False
        seen = self.saw(pod)
        return any(step["step"] == "check:0:7" for step in seen["steps"]) and pod

    def all_running(self, namespace: str, selector: str, count: int) -> list[dict] | bool:
        """The `count` pods of `selector` once every one of them runs (`running`)."""
        found = [self.running(pod) for pod in self.pods(namespace, selector)]
        return len(found) == count and all(found) and found

    @staticmethod
    def step(seen: dict, name: str) -> dict:
        found = [step for step in seen["steps"] if step["step"] == name]
        if not found:
            raise ValueError(f"simapp did not run {name}: {seen['steps']}")
        return found[0]

    def clients_of(self, pod: dict) -> list[dict]:
        return [client for client in self.nvsharectl("status")["clients"] if client["pod_uid"] == pod["metadata"]["uid"]]

    def client_settings(self, pod: dict, weight: int, priority: int, gpu: str, limit: int | None) -> bool:
        """Whether the pod's clients have these settings on `gpu` (ValueError with what they have)."""
        clients = self.clients_of(pod)
        have = [(client["weight"], client["priority"], {device: entry.get("limit")
                                                          for device, entry in client["devices"].items()})
                for client in clients]
        if not clients or any(entry != (weight, priority, {gpu: limit}) for entry in have):
            raise ValueError(f"clients of pod {pod['metadata']['name']}: (weight, priority, limits) {have}")
        return True

    def claim_of(self, pod: dict) -> dict:
        (status,) = pod["status"]["resourceClaimStatuses"] if pod["status"].get("resourceClaimStatuses") else [
            {"resourceClaimName": entry["resourceClaimName"]} for entry in pod["spec"]["resourceClaims"]]
        return self.cluster.get("resourceclaim", status["resourceClaimName"], "-n", pod["metadata"]["namespace"])

    def gpu_of(self, claim: dict) -> str:
        (result,) = claim["status"]["allocation"]["devices"]["results"]
        device = result["device"]
        return uuid(int(device.split("-")[1]))

    def spec_file(self, claim: dict) -> Path:
        return self.node.cdi_dir / f"{DRIVER}-claim_{claim['metadata']['uid']}.json"

    # ---- the scenario ------------------------------------------------------------------------

    def scenario(self) -> None:
        cluster, node = self.cluster, self.node
        check = self.check
        self.build()
        cluster.start()
        node.start_containerd()
        node.import_image(self.work / "image.tar")
        node.start_kubelet()
        node.wait_ready()
        self.start_scheduler()
        for path in ("k8s/namespace.yaml", "k8s/dra/rbac.yaml", "k8s/dra/resourceslice-policy.yaml",
                     "k8s/dra/deviceclasses.yaml", "k8s/dra/examples/namespace.yaml"):
            cluster.kubectl("apply", "-f", str(REPO / path))
        self.start_driver(self.driver_credentials())

        # Registration and the ResourceSlice.
        check("driver-registered", "the kubelet registered the driver (it says so back)",
              lambda: f"registered {DRIVER} with the kubelet" in self.driver_log())
        check("kubelet-chose-v1", "the kubelet chose DRA v1 of the services the driver offers",
              lambda: any("Registered DRA plugin" in line and f'driverName="{DRIVER}"' in line
                          and 'chosenService="v1.DRAPlugin"' in line
                          for line in (cluster.logs / "kubelet.log").read_text().splitlines()))
        wanted = 2 if self.consumable else 22

        def published():
            items = cluster.get("resourceslices", "--field-selector", f"spec.nodeName={NODE}")["items"]
            return len(items) == 1 and len(items[0]["spec"]["devices"]) == wanted and items[0]
        check("resourceslice", f"one ResourceSlice of the node with {wanted} devices "
              f"({'consumable capacity' if self.consumable else 'whole and share devices'})", published)
        self.seen["resourceslice"] = published() or {}
        if not self.consumable:
            check("fallback-logged", "the driver says the cluster has no consumable capacity",
                  lambda: "DRAConsumableCapacity is not enabled in this cluster" in self.driver_log())

        # A whole GPU (GPU 1: the shares below all ask for GPU 0 or go where there is room).
        (template, whole) = self.example("whole-gpu.yaml")
        template["spec"]["spec"]["devices"]["requests"][0]["exactly"]["selectors"] = [
            {"cel": {"expression": 'device.attributes["gpu.nvshare.com"].index == 1'}}]
        cluster.apply(template)
        cluster.apply(self.localise(whole))
        whole = {"metadata": {"namespace": "nvshare-examples", "name": "whole-gpu"}}
        check("whole-running", "a pod with a whole-GPU claim runs", lambda: self.running(whole))
        whole = self.pod("nvshare-examples", "whole-gpu")
        saw = self.saw(whole)
        self.seen["whole-gpu"] = saw
        meminfo = self.step(saw, "meminfo")
        check("whole-env", "it has NVIDIA_VISIBLE_DEVICES of GPU 1, LD_PRELOAD and NVSHARE_SOCKET_DIR, no limit",
              lambda: saw["env"].get("NVIDIA_VISIBLE_DEVICES") == uuid(1)
              and saw["env"].get("LD_PRELOAD") == "/usr/lib/nvshare/libnvshare.so"
              and saw["env"].get("NVSHARE_SOCKET_DIR") == str(self.nvshare) and "NVSHARE_MEMORY_LIMIT" not in saw["env"])
        check("whole-mounts", "libnvshare.so and the client socket directory are mounted read-only; not the control one",
              lambda: any(" /usr/lib/nvshare/libnvshare.so " in line and " ro," in line for line in saw["mounts"])
              and any(f" {self.nvshare}/client " in line and " ro," in line for line in saw["mounts"])
              and not any("/control" in line for line in saw["mounts"]) and "scheduler.sock" in saw["client"])
        check("whole-device-nodes", "/dev/nvidia1, nvidiactl and nvidia-uvm are character devices; /dev/nvidia0 is not there",
              lambda: any(line.startswith("c") and line.endswith(" nvidia1") for line in saw["dev"])
              and any(line.endswith(" nvidiactl") for line in saw["dev"])
              and not any(line.endswith(" nvidia0") for line in saw["dev"]))
        check("whole-sees-the-card", "CUDA in it sees the whole 16 GiB card",
              lambda: meminfo["rc"] == 0 and meminfo["total"] == 16 * GiB)
        check("whole-client", "its process is a client of the scheduler on GPU 1, in its pod, without a limit",
              lambda: self.client_settings(whole, 1, 0, uuid(1), None))
        check("whole-cdi", "the driver wrote the claim's CDI spec",
              lambda: self.spec_file(self.claim_of(whole)).is_file())
        if self.consumable:
            # Its claim consumed GPU 1's memory: a share that can only go there stays pending.
            squeezed = copy.deepcopy(self.example("two-namespaces.yaml")[2])
            squeezed["metadata"].update(name="gpu1-share", namespace="nvshare-examples")
            squeezed["spec"]["spec"]["devices"]["requests"][0]["exactly"]["selectors"][0]["cel"]["expression"] = \
                'device.attributes["gpu.nvshare.com"].index == 1'
            cluster.apply(squeezed)
            pending = self.localise({"apiVersion": "v1", "kind": "Pod",
                                     "metadata": {"name": "squeezed", "namespace": "nvshare-examples"},
                                     "spec": {"resourceClaims": [{"name": "gpu", "resourceClaimTemplateName": "gpu1-share"}],
                                              "containers": [{"name": "c", "resources": {"claims": [{"name": "gpu"}]}}]}})
            cluster.apply(pending)
            check("whole-is-exclusive", "a share that can only go on the whole GPU's card is not scheduled",
                  lambda: any(condition.get("reason") == "Unschedulable"
                              for condition in self.pod("nvshare-examples", "squeezed")["status"].get("conditions", [])))
            cluster.kubectl("delete", "pod", "squeezed", "-n", "nvshare-examples", "--wait=false")

        # A notebook with a share: 8 GiB, weight 2, priority 4.
        template, notebook = self.example("notebook.yaml")
        cluster.apply(template)
        cluster.apply(self.localise(notebook, ("6G", "4G")))
        notebook = {"metadata": {"namespace": "nvshare-examples", "name": "notebook"}}
        check("share-running", "a notebook pod with an 8 GiB share runs", lambda: self.running(notebook))
        notebook = self.pod("nvshare-examples", "notebook")
        saw = self.saw(notebook)
        self.seen["notebook"] = saw
        check("share-limit-env", "NVSHARE_MEMORY_LIMIT gives its GPU 8 GiB",
              lambda: saw["env"].get("NVSHARE_MEMORY_LIMIT") == f"{saw['env']['NVIDIA_VISIBLE_DEVICES']}={8 * GiB}")
        check("share-sees-its-limit", "CUDA in it sees an 8 GiB GPU",
              lambda: self.step(saw, "meminfo")["total"] == 8 * GiB)
        check("share-limit-enforced", "6 GiB may be allocated, 4 GiB more is out of memory",
              lambda: self.step(saw, "alloc:plain:6G")["rc"] == 0 and self.step(saw, "alloc:plain:4G")["rc"] == 2
              and self.step(saw, "alloc:plain:4G")["error"] == "CUDA_ERROR_OUT_OF_MEMORY")
        gpu = saw["env"]["NVIDIA_VISIBLE_DEVICES"]
        if self.consumable:
            check("share-on-gpu0", "it went on GPU 0 (GPU 1 is the whole claim's)", lambda: gpu == uuid(0))
        else:
            check("share-device", "it went on a share device", lambda: "-share-" in self.claim_of(notebook)
                  ["status"]["allocation"]["devices"]["results"][0]["device"])
        check("share-scheduler", "the scheduler gives its client weight 2, priority 4 and an 8 GiB limit on its GPU",
              lambda: self.client_settings(notebook, 2, 4, gpu, 8 * GiB))
        # Its claim is unprepared when it goes (and its 8 GiB are free for the pods below).
        notebook_claim = self.claim_of(notebook)
        cluster.kubectl("delete", "pod", "notebook", "-n", "nvshare-examples", "--wait=false")
        check("share-deleted", "deleting the pod unprepares its claim and removes its CDI spec and settings",
              lambda: f"unprepared claim nvshare-examples/{notebook_claim['metadata']['name']} " in self.driver_log()
              and not self.spec_file(notebook_claim).exists() and not self.clients_of(notebook)
              and notebook["metadata"]["uid"] not in json.dumps(self.nvsharectl("status").get("settings")))

        # One claim, two pods.
        pair = self.deploy("shared-claim.yaml", "app=shared-gpu-workers", 2, "shared-running",
                           "two pods of one ResourceClaim run")
        shared = cluster.get("resourceclaim", "shared-gpu", "-n", "nvshare-examples")
        check("shared-reserved", "the claim is reserved for both pods",
              lambda: {entry["uid"] for entry in cluster.get("resourceclaim", "shared-gpu", "-n", "nvshare-examples")
                       ["status"]["reservedFor"]} == {pod["metadata"]["uid"] for pod in pair})
        check("shared-prepared-once", "the driver prepared it once (the kubelet may ask for both pods at once)",
              lambda: self.driver_log().count("prepared claim nvshare-examples/shared-gpu ") == 1)
        for index, pod in enumerate(pair):
            saw = self.saw(pod)
            self.seen[f"shared-{index}"] = saw
            check(f"shared-{index}-settings", f"pod {index} has the claim's GPU, its 4 GiB limit and weight 3",
                  lambda pod=pod, saw=saw: saw["env"]["NVIDIA_VISIBLE_DEVICES"] == self.gpu_of(shared)
                  and self.client_settings(pod, 3, 0, self.gpu_of(shared), 4 * GiB))

        # Two namespaces, one GPU, different limits and weights.
        documents = self.example("two-namespaces.yaml")
        for document in documents[:4]:
            cluster.apply(document)
        trainer, evaluator = (self.localise(document) for document in documents[4:])
        for pod in (trainer, evaluator):
            pod["spec"].pop("restartPolicy", None)
            cluster.apply(pod)
        check("namespaces-running", "a pod in team-a and one in team-b run",
              lambda: self.running(trainer) and self.running(evaluator))
        trainer, evaluator = self.pod("team-a", "trainer"), self.pod("team-b", "evaluator")
        self.seen["team-a"], self.seen["team-b"] = self.saw(trainer), self.saw(evaluator)
        check("namespaces-one-gpu", "both on GPU 0", lambda: {self.gpu_of(self.claim_of(pod)) for pod in
                                                              (trainer, evaluator)} == {uuid(0)})
        check("namespaces-settings", "team-a's client has weight 4 and 6 GiB, team-b's weight 1 and 2 GiB",
              lambda: self.client_settings(trainer, 4, 0, uuid(0), 6 * GiB)
              and self.client_settings(evaluator, 1, 0, uuid(0), 2 * GiB))
        check("namespaces-see-limits", "CUDA in them sees 6 GiB and 2 GiB",
              lambda: self.step(self.saw(trainer), "meminfo")["total"] == 6 * GiB
              and self.step(self.saw(evaluator), "meminfo")["total"] == 2 * GiB)
        self.seen["nvsharectl-status"] = self.nvsharectl("status")

        # The driver restarts (its checkpoint), and so does the kubelet.
        assert self.driver is not None
        cluster.stop_process(self.driver)
        self.start_driver(self.work / "dra-credentials")
        check("driver-restarted", "a restarted driver registers again and keeps what it prepared",
              lambda: self.driver_log().count(f"registered {DRIVER} with the kubelet") >= 2)
        node.stop_kubelet()
        node.start_kubelet()
        check("kubelet-restarted", "after a kubelet restart the node is Ready and the pods run on",
              lambda: node.wait_ready() and all(self.running(pod) for pod in (whole, trainer, evaluator, *pair)))

        # Deleting: the claims are unprepared, their specs and settings go.
        claims = [self.claim_of(pod) for pod in (whole, trainer, evaluator)] + [shared]
        cluster.kubectl("delete", "deployment", "shared-gpu-workers", "-n", "nvshare-examples")
        for namespace, name in (("nvshare-examples", "whole-gpu"), ("team-a", "trainer"), ("team-b", "evaluator")):
            cluster.kubectl("delete", "pod", name, "-n", namespace, "--wait=false")
        cluster.kubectl("delete", "resourceclaim", "shared-gpu", "-n", "nvshare-examples", "--wait=false")
        check("unprepared", "the driver unprepared every claim (after its restart, from the checkpoint)",
              lambda: all(f"unprepared claim {claim['metadata']['namespace']}/{claim['metadata']['name']} "
                          in self.driver_log() for claim in claims), timeout=2 * WAIT_S)
        check("cdi-specs-gone", "their CDI specs are gone",
              lambda: not any(self.node.cdi_dir.glob(f"{DRIVER}-claim_*.json")))
        check("checkpoint-empty", "the checkpoint holds no claim",
              lambda: json.loads((node.plugins_dir / DRIVER / "checkpoint.json").read_text())["claims"] == [])
        check("scheduler-clean", "the scheduler has no client and no per-pod setting left",
              lambda: not (status := self.nvsharectl("status"))["clients"] and not any(
                  value.get("pods") for value in (status.get("settings") or {}).values() if isinstance(value, dict)))
        check("claims-deleted", "the generated claims are deleted with their pods",
              lambda: not [c for c in cluster.get("resourceclaims", "-A")["items"]
                           if c["metadata"]["namespace"] in ("nvshare-examples", "team-a", "team-b")])
        check("slice-stays", "the node's ResourceSlice stays while the driver runs", published)

        # A claim's mode: inference workers that run side by side on GPU 1 (mode auto) while
        # their claims are prepared, and GPU 1 back in the scheduler's default after the last.
        def mode_of(gpu: str) -> str | None:
            return next((device["mode"] for device in self.nvsharectl("status")["devices"]
                         if device["device"] == gpu), None)
        default_mode = mode_of(uuid(0))
        servers = self.deploy("side-by-side.yaml", "app=side-by-side-inference", 2, "mode-running",
                              "two pods whose claims ask for mode auto run on GPU 1")
        check("mode-set", "while their claims are prepared, GPU 1 is in mode auto and GPU 0 keeps the default",
              lambda: mode_of(uuid(1)) == "auto" and mode_of(uuid(0)) == default_mode)
        check("mode-limits", "each of their clients has the claim's 3 GiB limit on GPU 1",
              lambda: all(self.client_settings(pod, 1, 0, uuid(1), 3 * GiB) for pod in servers))
        mode_claims = [self.claim_of(pod) for pod in servers]
        cluster.kubectl("delete", "deployment", "side-by-side-inference", "-n", "nvshare-examples")
        check("mode-restored", "after the last of them is unprepared, GPU 1 is back in the scheduler's default",
              lambda: all(f"unprepared claim nvshare-examples/{claim['metadata']['name']} " in self.driver_log()
                          for claim in mode_claims) and mode_of(uuid(1)) == default_mode, timeout=2 * WAIT_S)

    def cleanup(self) -> None:
        self.node.cleanup()
        self.cluster.stop()
        self.node.kill_shims()
        for line in reversed(Path("/proc/mounts").read_text().splitlines()):
            mount = line.split()[1]
            if mount.startswith(str(self.work)):
                subprocess.run(["umount", "-l", mount], check=False, capture_output=True)


def versions(cluster_bin: Path) -> dict:
    def out(*command: str) -> str:
        try:
            return subprocess.run(command, capture_output=True, text=True, timeout=30).stdout.strip().splitlines()[0]
        except (OSError, IndexError, subprocess.TimeoutExpired):
            return "unknown"
    return {"kubernetes": out(str(cluster_bin / "kubelet"), "--version"),
            "kube-apiserver": out(str(cluster_bin / "kube-apiserver"), "--version"),
            "etcd": out(str(cluster_bin / "etcd"), "--version"),
            "containerd": out(str(cluster_bin / "containerd"), "--version"),
            "runc": out("runc", "--version"), "go": out("go", "version") if shutil.which("go") else
            out("/usr/local/go/bin/go", "version"), "kernel": platform.release(), "python": platform.python_version()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("result", type=Path)
    parser.add_argument("--no-consumable-capacity", action="store_true",
                        help="a cluster without DRAConsumableCapacity: the driver publishes share devices")
    parser.add_argument("--work", type=Path, default=Path(os.environ.get("NVDRA_E2E_WORK", "/var/tmp/nvdra/e2e")))
    options = parser.parse_args()
    if os.geteuid() != 0:
        print("e2e: run as root (containerd and the kubelet need it)", file=sys.stderr)
        return 2
    shutil.rmtree(options.work, ignore_errors=True)
    options.work.mkdir(parents=True)
    run = Run(options.work, not options.no_consumable_capacity)
    started = time.monotonic()
    error = None
    try:
        run.scenario()
    except Exception as failure:  # recorded: the result says how far it got
        error = f"{type(failure).__name__}: {failure}"
        print(f"e2e: stopped: {error}", file=sys.stderr)
    finally:
        run.cleanup()
    passed = sum(check["passed"] for check in run.checks)
    failed = len(run.checks) - passed
    result = {"test": "dra-e2e", "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
              "consumable_capacity": run.consumable, "versions": versions(run.cluster.bin),
              "seconds": round(time.monotonic() - started), "passed": passed, "failed": failed, "error": error,
              "checks": run.checks, "seen": run.seen}
    options.result.parent.mkdir(parents=True, exist_ok=True)
    options.result.write_text(json.dumps(result, indent=1) + "\n")
    print(f"e2e: {passed} passed, {failed} failed{', stopped: ' + error if error else ''}; {options.result}")
    return 0 if failed == 0 and error is None else 1


if __name__ == "__main__":
    sys.exit(main())
