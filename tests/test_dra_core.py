"""The DRA driver's pure parts: quantities, the published devices, a claim's allocation read as
what to prepare, the GPUs' modes the claims ask for, its CDI spec, the ResourceSlice plan, the
pods' settings from their claims and the checkpoint. The driver as a process:
tests/test_dra_driver.py."""

from __future__ import annotations

import json
import re

import pytest

from nvshare_py.deviceplugin.config import CdiNames
from nvshare_py.deviceplugin.injection import Injection, MissingHostFile, Preload
from nvshare_py.deviceplugin.inventory import PhysicalGpu
from nvshare_py.deviceplugin.podsettings import MEMORY_LIMIT, PRIORITY, WEIGHT, PodSettings, Request
from nvshare_py.dra import cdi, checkpoint, podclaims, slices
from nvshare_py.dra.claims import ClaimError, PreparedClaim, check_modes, read_claim, wanted_modes
from nvshare_py.dra.devices import MEMORY_STEP, DeviceSet, Sharing, UnknownDevice
from nvshare_py.dra.gpumodes import GpuModes, ModeRequest
from nvshare_py.dra.quantity import parse_quantity
from nvshare_py.paths import SocketPaths

DRIVER = "gpu.nvshare.com"
NODE = "node-a"
GiB = 1 << 30
GPUS = [PhysicalGpu(f"GPU-5151ad00-0000-4000-8000-{index:012x}", index, "nvshare simulated GPU", 16 * GiB + 12345,
                    minor=index) for index in range(2)]


def devices(sharing: Sharing = Sharing.CAPACITY, shares: int = 4, oversubscription: float = 1.0) -> DeviceSet:
    return DeviceSet(GPUS, sharing, shares, oversubscription)


# ---- quantities ---------------------------------------------------------------------------------


@pytest.mark.parametrize("text, value", [
    ("4Gi", 4 * GiB), ("16G", 16 * 10**9), ("1.5Gi", 3 * GiB // 2), ("512Mi", 512 << 20), ("1e9", 10**9),
    ("4294967296", 1 << 32), ("1k", 1000), ("1Ki", 1024), ("0.5", 1), ("100m", 1), ("1500m", 2), (7, 7),
])
def test_kubernetes_quantities_are_read_as_the_api_server_reads_them(text, value):
    assert parse_quantity(text) == value


@pytest.mark.parametrize("text", ["", "Gi", "4 Gi", "4GB", "4gi", "1.2.3", "--1", True, None, 1.5, "4iB"])
def test_what_is_not_a_quantity_is_refused(text):
    with pytest.raises(ValueError):
        parse_quantity(text)


# ---- devices ---------------------------------------------------------------------------------------


def test_capacity_sharing_publishes_one_device_per_gpu_that_many_claims_consume():
    published = devices(Sharing.CAPACITY, shares=4, oversubscription=1.5).documents()
    assert [device["name"] for device in published] == ["gpu-0", "gpu-1"]
    gpu0 = published[0]
    assert gpu0["allowMultipleAllocations"] is True
    attributes = {name: next(iter(value.values())) for name, value in gpu0["attributes"].items()}
    assert attributes == {"type": "gpu", "uuid": GPUS[0].uuid, "index": 0, "minor": 0,
                          "productName": "nvshare simulated GPU", "sharing": "capacity", "shareable": True}
    card = 16 * GiB  # the card's memory in whole MiB
    memory = gpu0["capacity"]["memory"]
    assert int(memory["value"]) == card * 3 // 2  # the oversubscription factor
    # A claim that asks for no memory takes a whole card's worth; a request rounds up to MiB.
    assert memory["requestPolicy"] == {"default": str(card), "validRange": {"min": str(MEMORY_STEP),
                                                                          "step": str(MEMORY_STEP)}}
    assert gpu0["capacity"]["shares"] == {"value": "4", "requestPolicy": {"default": "1", "validValues": ["1"]}}


def test_replicas_sharing_publishes_the_gpu_and_its_share_devices():
    published = {device["name"]: device for device in devices(Sharing.REPLICAS, shares=3).documents()}
    assert sorted(published) == ["gpu-0", "gpu-0-share-0", "gpu-0-share-1", "gpu-0-share-2",
                                 "gpu-1", "gpu-1-share-0", "gpu-1-share-1", "gpu-1-share-2"]
    whole, share = published["gpu-1"], published["gpu-1-share-2"]
    for device in (whole, share):
        assert "allowMultipleAllocations" not in device
        assert device["capacity"] == {"memory": {"value": str(16 * GiB)}}
        assert device["attributes"]["uuid"] == {"string": GPUS[1].uuid}
    assert whole["attributes"]["type"] == {"string": "gpu"} and whole["attributes"]["shareable"] == {"bool": False}
    assert share["attributes"]["type"] == {"string": "share"} and share["attributes"]["share"] == {"int": 2}
    assert share["attributes"]["shareable"] == {"bool": True}


def test_a_device_of_either_way_of_sharing_is_known_and_others_are_not():
    capacity = devices(Sharing.CAPACITY, shares=2)
    assert capacity.device("gpu-1-share-1").gpu == GPUS[1]  # allocated before a switch of --sharing
    assert devices(Sharing.REPLICAS).device("gpu-0").gpu == GPUS[0]
    for name in ("gpu-2", "gpu-0-share-2", "GPU-0"):
        with pytest.raises(UnknownDevice, match="gpu-0, gpu-1"):
            capacity.device(name)


@pytest.mark.parametrize("shares, factor", [(0, 1.0), (65, 1.0), (4, 0.5)])
def test_settings_a_device_set_cannot_have(shares, factor):
    with pytest.raises(ValueError):
        DeviceSet(GPUS, Sharing.CAPACITY, shares, factor)


# ---- claims ---------------------------------------------------------------------------------------


def claim(results: list[dict], config: list[dict] = (), uid: str = "c1a1m") -> dict:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": "nb", "namespace": "team-a", "uid": uid},
            "status": {"allocation": {"devices": {"results": results, "config": list(config)}}}}


def result(device: str = "gpu-0", request: str = "gpu", driver: str = DRIVER, pool: str = NODE, **extra) -> dict:
    return dict({"request": request, "driver": driver, "pool": pool, "device": device}, **extra)


def opaque(source: str = "FromClaim", requests: list[str] = (), **parameters) -> dict:
    return {"source": source, "requests": list(requests),
            "opaque": {"driver": DRIVER, "parameters": dict({"apiVersion": "gpu.nvshare.com/v1alpha1",
                                                             "kind": "GpuConfig"}, **parameters)}}


def test_a_share_is_limited_to_the_memory_it_consumed():
    prepared = read_claim(claim([result(consumedCapacity={"memory": "4Gi", "shares": "1"}, shareID="s-1")]),
                          DRIVER, NODE, devices())
    (device,) = prepared.devices
    assert (device.device, device.gpu_uuid, device.memory_limit, device.share_id) == ("gpu-0", GPUS[0].uuid, 4 * GiB, "s-1")
    assert (prepared.uid, prepared.namespace, prepared.name) == ("c1a1m", "team-a", "nb")


def test_a_claim_that_consumed_a_whole_card_has_no_limit_and_one_past_the_card_has_that_limit():
    whole = read_claim(claim([result(consumedCapacity={"memory": str(16 * GiB)})]), DRIVER, NODE, devices())
    assert whole.devices[0].memory_limit is None
    past = read_claim(claim([result(consumedCapacity={"memory": "24Gi"})]), DRIVER, NODE, devices(oversubscription=2))
    assert past.devices[0].memory_limit == 24 * GiB


def test_class_then_claim_configuration_with_the_smaller_memory_limit():
    prepared = read_claim(claim([result(consumedCapacity={"memory": "8Gi"})],
                                [opaque("FromClaim", weight=3, memoryLimit="6Gi"),
                                 opaque("FromClass", weight=1, priority=2, memoryLimit="2Gi", futureField="ignored")]),
                          DRIVER, NODE, devices())
    # The claim's entry overrides the class's (whatever their order), and the smaller of the
    # limit and the consumed memory applies.
    assert (prepared.weight, prepared.priority, prepared.devices[0].memory_limit) == (3, 2, 6 * GiB)


def test_configuration_applies_to_the_requests_it_names_and_subrequests_by_their_main_request():
    prepared = read_claim(claim([result("gpu-0", "train/big"), result("gpu-1", "eval")],
                                [opaque(requests=["train"], memoryLimit="3Gi"), opaque(requests=["eval/x"], weight=9)]),
                          DRIVER, NODE, devices())
    train, evaluate = prepared.devices
    assert (train.requests, train.memory_limit) == (("train",), 3 * GiB)
    assert (evaluate.requests, evaluate.memory_limit, prepared.weight) == (("eval",), None, None)
    assert prepared.gpu_limits == {GPUS[0].uuid: 3 * GiB, GPUS[1].uuid: None}


def test_results_and_configuration_of_other_drivers_are_not_ours():
    others = claim([result("gpu-0"), result("eth-0", driver="net.example.com", pool="elsewhere")],
                   [{"source": "FromClaim", "opaque": {"driver": "net.example.com", "parameters": {"weight": "x"}}}])
    prepared = read_claim(others, DRIVER, NODE, devices())
    assert [device.device for device in prepared.devices] == ["gpu-0"]


@pytest.mark.parametrize("document, reason", [
    (claim([result(pool="node-b")]), "from pool 'node-b', not this node's"),
    (claim([result("gpu-7")]), "'gpu-7' is not one this driver publishes"),
    (claim([result()], [opaque(weight=0)]), "weight must be an integer from 1 to 1000"),
    (claim([result()], [opaque(weight=True)]), "weight must be an integer"),
    (claim([result()], [opaque(priority=8)]), "priority must be an integer from 0 to 7"),
    (claim([result()], [opaque(memoryLimit="lots")]), "memoryLimit: 'lots' is not a quantity"),
    (claim([result()], [opaque(memoryLimit="0")]), "memoryLimit must be more than 0"),
    (claim([result()], [opaque(mode="sometimes")]), "mode must be on, off or auto, not 'sometimes'"),
    (claim([result()], [opaque(mode=["on"])]), "mode must be on, off or auto, not ['on']"),
    (claim([result("gpu-0", "a"), result("gpu-0", "b")], [opaque(requests=["a"], mode="on"),
                                                          opaque(requests=["b"], mode="off")]),
     f"team-a/nb asks for modes on and off on GPU {GPUS[0].uuid}"),
    (claim([result()], [opaque(apiVersion="other.example.com/v1")]), "apiVersion 'other.example.com/v1'"),
    (claim([result()], [{"source": "FromClaim", "opaque": {"driver": DRIVER, "parameters": [1]}}]), "not an object"),
    ({"metadata": {"name": "nb", "namespace": "team-a", "uid": "u"}, "status": {}}, "is not allocated"),
])
def test_a_claim_that_cannot_be_prepared_says_why(document, reason):
    with pytest.raises(ClaimError, match=re.escape(reason)):
        read_claim(document, DRIVER, NODE, devices())


def test_a_prepared_claim_survives_json():
    prepared = read_claim(claim([result(consumedCapacity={"memory": "4Gi"}, shareID="s")], [opaque(weight=2)]),
                          DRIVER, NODE, devices())
    prepared = PreparedClaim(prepared.uid, prepared.namespace, prepared.name, prepared.devices, prepared.weight,
                             prepared.priority, {"gpu-0": ("a=b",)})
    assert PreparedClaim.from_json(json.loads(json.dumps(prepared.to_json()))) == prepared


# ---- GPU modes -------------------------------------------------------------------------------------


def moded(name: str, uid: str, modes: dict[int, str | None]) -> PreparedClaim:
    """A prepared claim with one request per GPU index, each asking for its mode (None: none)."""
    document = claim([result(f"gpu-{index}", f"r{index}") for index in modes],
                     [opaque(requests=[f"r{index}"], mode=mode) for index, mode in modes.items() if mode], uid)
    document["metadata"]["name"] = name
    return read_claim(document, DRIVER, NODE, devices())


def test_a_claim_asks_its_gpus_for_the_mode_of_its_configuration():
    prepared = read_claim(claim([result("gpu-0", "train"), result("gpu-1", "eval")],
                                [opaque("FromClass", mode="auto"), opaque("FromClaim", requests=["eval"], mode="off")]),
                          DRIVER, NODE, devices())
    # The class's mode for every request, the claim's where it names one.
    assert prepared.gpu_modes == {GPUS[0].uuid: "auto", GPUS[1].uuid: "off"}
    assert PreparedClaim.from_json(json.loads(json.dumps(prepared.to_json()))) == prepared
    assert read_claim(claim([result("gpu-1")]), DRIVER, NODE, devices()).gpu_modes == {}  # none: any mode


def test_a_claim_that_asks_a_gpu_for_another_mode_than_prepared_claims_is_refused_naming_them():
    first = moded("first", "u1", {0: "auto", 1: None})
    prepared = [first, moded("plain", "u2", {0: None})]
    with pytest.raises(ClaimError) as refused:
        check_modes(moded("late", "u3", {0: "off"}), prepared)
    assert str(refused.value).startswith(f"GPU {GPUS[0].uuid} is in mode auto, set by ResourceClaim team-a/first; "
                                         "ResourceClaim team-a/late asks for mode off there")
    # The same mode, no mode, or a mode on a GPU where no claim asks for one: prepared.
    for fine in (moded("same", "u4", {0: "auto"}), moded("any", "u5", {0: None}), moded("other", "u6", {1: "off"})):
        check_modes(fine, prepared)
    check_modes(first, prepared)  # the claim itself, prepared again
    assert wanted_modes([*prepared, moded("other", "u6", {1: "off"})]) == {GPUS[0].uuid: "auto", GPUS[1].uuid: "off"}


SCHEDULER = {"pid": 1, "started": 1.0, "defaults": {"mode": "on", "tq": 30.0}}


def told_all(modes: GpuModes, scheduler: dict = SCHEDULER) -> list[ModeRequest]:
    sent = modes.pending(scheduler)
    for request in sent:
        modes.told(request)
    return sent


def test_gpu_modes_are_set_once_and_given_back_to_the_schedulers_default_when_no_claim_asks():
    given_back = []
    modes = GpuModes(given_back=lambda: given_back.append(set(modes.owned)))
    modes.want({GPUS[0].uuid: "auto"})
    (request,) = told_all(modes)
    assert (request.op, request.fields) == ("set-mode", {"device": GPUS[0].uuid, "mode": "auto"})
    assert (request.subject, str(request)) == (f"GPU {GPUS[0].uuid}", "mode auto")
    assert modes.pending(SCHEDULER) == [] and modes.owned == {GPUS[0].uuid}
    # A restarted scheduler gets the mode again.
    modes.scheduler_restarted()
    assert told_all(modes) == [request]
    # No claim asks any more: the default of the scheduler as it says it now.
    modes.want({})
    (back,) = told_all(modes, dict(SCHEDULER, defaults={"mode": "off"}))
    assert back.fields == {"device": GPUS[0].uuid, "mode": "off"} and back.give_back
    assert given_back == [set()] and modes.owned == set() and modes.pending(SCHEDULER) == []


def test_only_gpus_the_driver_set_are_given_back_and_a_give_back_survives_a_scheduler_restart():
    # GPU 1 was set by the driver before it restarted (the checkpoint says so); GPU 0 never was.
    modes = GpuModes(owned=[GPUS[1].uuid])
    modes.scheduler_restarted()
    assert modes.pending(SCHEDULER) == [ModeRequest(GPUS[1].uuid, "on", give_back=True)]
    assert modes.pending({"pid": 1, "started": 1.0}) == []  # a scheduler that says no default: nothing to give back
    told_all(modes)
    assert modes.owned == set() and modes.pending(SCHEDULER) == []


def test_a_claim_prepared_while_its_gpu_is_given_back_gets_its_mode_again():
    modes = GpuModes()
    modes.want({GPUS[0].uuid: "off"})
    told_all(modes)
    modes.want({})
    (back,) = modes.pending(SCHEDULER)
    modes.want({GPUS[0].uuid: "auto"})  # while the give-back is on its way
    modes.told(back)
    assert modes.owned == {GPUS[0].uuid}
    assert modes.pending(SCHEDULER) == [ModeRequest(GPUS[0].uuid, "auto")]


# ---- CDI --------------------------------------------------------------------------------------------


@pytest.fixture
def node(tmp_path):
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libnvshare.so").write_bytes(b"\x7fELF")
    (tmp_path / "run" / "client").mkdir(parents=True)
    (tmp_path / "dev").mkdir()
    for name in ("nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm"):
        (tmp_path / "dev" / name).write_text("")
    return Injection(socket_paths=SocketPaths.resolve(tmp_path / "run"), library=tmp_path / "lib" / "libnvshare.so",
                     container_env={"NVSHARE_FAIL_MODE": "open"}, device_dir=tmp_path / "dev")


def test_the_cdi_spec_puts_a_container_under_nvshare_on_the_claims_gpus(node, tmp_path):
    prepared = read_claim(claim([result("gpu-1", consumedCapacity={"memory": "4Gi"})]), DRIVER, NODE, devices())
    spec = cdi.spec(prepared, DRIVER, node, {gpu.uuid: gpu for gpu in GPUS})
    assert (spec["cdiVersion"], spec["kind"]) == ("0.6.0", "gpu.nvshare.com/claim")
    (device,) = spec["devices"]
    assert device["name"] == f"c1a1m-{GPUS[1].uuid}"
    edits = device["containerEdits"]
    env = dict(item.split("=", 1) for item in edits["env"])
    assert env == {"NVSHARE_FAIL_MODE": "open", "NVIDIA_VISIBLE_DEVICES": GPUS[1].uuid,
                   "NVSHARE_SOCKET_DIR": str(tmp_path / "run"), "LD_PRELOAD": "/usr/lib/nvshare/libnvshare.so",
                   "NVSHARE_MEMORY_LIMIT": f"{GPUS[1].uuid}={4 * GiB}"}
    mounts = {mount["containerPath"]: mount for mount in edits["mounts"]}
    assert set(mounts) == {str(tmp_path / "run" / "client"), "/usr/lib/nvshare/libnvshare.so"}  # never control/
    assert all("ro" in mount["options"] for mount in mounts.values())
    assert [node_["path"] for node_ in edits["deviceNodes"]] == ["/dev/nvidia1", "/dev/nvidiactl", "/dev/nvidia-uvm"]
    # The kubelet hands the runtime these names; the node's NVIDIA CDI spec's too when asked.
    gpus = {gpu.uuid: gpu for gpu in GPUS}
    assert cdi.cdi_ids(prepared, DRIVER, gpus, CdiNames.OFF, "nvidia.com/gpu") == {
        "gpu-1": (f"gpu.nvshare.com/claim=c1a1m-{GPUS[1].uuid}",)}
    assert cdi.cdi_ids(prepared, DRIVER, gpus, CdiNames.INDEX, "nvidia.com/gpu")["gpu-1"][1] == "nvidia.com/gpu=1"


def test_a_claim_of_two_gpus_without_a_limit_and_with_a_preload_file(node, tmp_path):
    preload = tmp_path / "lib" / "ld.so.preload"
    preload.write_text("/usr/lib/nvshare/libnvshare.so\n")
    injection = Injection(socket_paths=node.socket_paths, library=node.library, preload=Preload.FILE,
                          preload_file=preload, device_specs=False, device_dir=node.device_dir)
    prepared = read_claim(claim([result("gpu-0-share-1"), result("gpu-1")]), DRIVER, NODE, devices(Sharing.REPLICAS))
    spec = cdi.spec(prepared, DRIVER, injection, {gpu.uuid: gpu for gpu in GPUS})
    for device in spec["devices"]:
        env = dict(item.split("=", 1) for item in device["containerEdits"]["env"])
        assert env["NVIDIA_VISIBLE_DEVICES"] == f"{GPUS[0].uuid},{GPUS[1].uuid}"
        assert "NVSHARE_MEMORY_LIMIT" not in env and "LD_PRELOAD" not in env and "deviceNodes" not in device["containerEdits"]
        assert {"hostPath": str(preload), "containerPath": "/etc/ld.so.preload"}.items() <= \
            device["containerEdits"]["mounts"][-1].items()


def test_no_spec_without_the_library_on_the_node(node, tmp_path):
    node.library.unlink()
    prepared = read_claim(claim([result()]), DRIVER, NODE, devices())
    with pytest.raises(MissingHostFile, match="nvshare-dra-driver install-library"):
        cdi.spec(prepared, DRIVER, node, {gpu.uuid: gpu for gpu in GPUS})


def test_spec_files_are_told_apart_by_driver_and_claim(tmp_path):
    path = cdi.spec_path(tmp_path, DRIVER, "0b6e-11")
    assert cdi.claim_of_spec(path, DRIVER) == "0b6e-11"
    assert cdi.claim_of_spec(path, "other.example.com") is None
    assert cdi.claim_of_spec(tmp_path / "nvidia.yaml", DRIVER) is None


# ---- ResourceSlices --------------------------------------------------------------------------------


def stored(specs: list[dict], generation: int = 1) -> list[dict]:
    """The slices as the API server gives them back: named, versioned, quantities canonical."""
    def canonical(item):
        if isinstance(item, dict):
            return {key: canonical(value) for key, value in item.items()}
        if isinstance(item, list):
            return [canonical(value) for value in item]
        if isinstance(item, str) and item.isdigit() and int(item) % GiB == 0 and int(item) >= GiB:
            return f"{int(item) // GiB}Gi"
        return item
    return [{"metadata": {"name": f"{NODE}-{DRIVER}-{index}", "resourceVersion": "7"},
             "spec": canonical(dict(spec, pool=dict(spec["pool"], generation=generation)))}
            for index, spec in enumerate(specs)]


def test_slices_are_created_once_and_left_alone_while_they_say_the_same():
    desired = slices.desired_specs(devices(), DRIVER, NODE)
    first = slices.plan([], desired, NODE, "node-uid")
    (created,) = first.create
    assert created["metadata"]["generateName"] == f"{NODE}-{DRIVER}-"
    assert created["metadata"]["ownerReferences"] == [{"apiVersion": "v1", "kind": "Node", "name": NODE,
                                                       "uid": "node-uid", "controller": True}]
    assert created["spec"]["pool"] == {"name": NODE, "resourceSliceCount": 1, "generation": 1}
    assert (created["spec"]["driver"], created["spec"]["nodeName"]) == (DRIVER, NODE)
    # The API server writes 16Gi for 17179869184: the same slice, nothing to do.
    assert slices.plan(stored(desired), desired, NODE, "node-uid").empty


def test_changed_devices_are_a_new_generation_and_surplus_slices_go():
    before = stored(slices.desired_specs(devices(), DRIVER, NODE) * 2, generation=4)
    after = slices.desired_specs(devices(Sharing.REPLICAS, shares=2), DRIVER, NODE)
    plan = slices.plan(before, after, NODE, None)
    (replaced,) = plan.replace
    assert replaced["metadata"]["resourceVersion"] == "7" and replaced["spec"]["pool"]["generation"] == 5
    assert plan.delete == [f"{NODE}-{DRIVER}-1"] and not plan.create
    assert "ownerReferences" not in replaced["metadata"]


def test_more_devices_than_a_slice_holds_make_a_pool_of_several_slices():
    many = DeviceSet([PhysicalGpu(f"GPU-{index}", index, "g", 8 * GiB) for index in range(3)], Sharing.REPLICAS, 64, 1)
    specs = slices.desired_specs(many, DRIVER, NODE)
    assert [len(spec["devices"]) for spec in specs] == [128, 67]
    assert all(spec["pool"]["resourceSliceCount"] == 2 for spec in specs)


def test_fields_the_api_server_dropped_are_found():
    sent = {"spec": {"devices": devices().documents()}}
    kept = json.loads(json.dumps(sent))
    assert slices.dropped_fields(sent, kept) == []
    for device in kept["spec"]["devices"]:
        del device["allowMultipleAllocations"]
        for capacity in device["capacity"].values():
            del capacity["requestPolicy"]
    assert slices.dropped_fields(sent, kept) == ["allowMultipleAllocations", "capacity.memory.requestPolicy",
                                                 "capacity.shares.requestPolicy"]


# ---- the pods' settings -----------------------------------------------------------------------------


def prepared_claim(name: str, uid: str, limits: dict[str, int | None], weight=None, priority=None) -> PreparedClaim:
    results = [result(f"gpu-{GPUS.index(next(g for g in GPUS if g.uuid == uuid))}", f"r{i}",
                      **({"consumedCapacity": {"memory": str(limit)}} if limit else {}))
               for i, (uuid, limit) in enumerate(limits.items())]
    document = claim(results, [opaque(**{k: v for k, v in (("weight", weight), ("priority", priority)) if v})], uid)
    document["metadata"]["name"] = name
    return read_claim(document, DRIVER, NODE, devices())


def pod(name: str, uid: str, claims: list[str] = (), templated: list[str] = (), phase: str = "Running") -> dict:
    return {"metadata": {"name": name, "namespace": "team-a", "uid": uid},
            "spec": {"resourceClaims": [{"name": f"c{i}", "resourceClaimName": c} for i, c in enumerate(claims)]
                     + [{"name": f"t{i}", "resourceClaimTemplateName": "tmpl"} for i, _ in enumerate(templated)]},
            "status": {"phase": phase,
                       "resourceClaimStatuses": [{"name": f"t{i}", "resourceClaimName": c} for i, c in enumerate(templated)]}}


def test_pods_get_the_settings_of_the_prepared_claims_they_use():
    shared = prepared_claim("shared", "u1", {GPUS[0].uuid: 4 * GiB}, weight=3)
    generated = prepared_claim("nb-gpu-x7", "u2", {GPUS[0].uuid: 8 * GiB, GPUS[1].uuid: None}, weight=5, priority=1)
    read = podclaims.reader(lambda: {("team-a", "shared"): shared, ("team-a", "nb-gpu-x7"): generated})
    one = read(pod("one", "p1", claims=["shared"]))
    assert (one.uid, one.name, one.values) == ("p1", "team-a/one", {WEIGHT: 3})
    assert one.device_values == {(MEMORY_LIMIT, GPUS[0].uuid): 4 * GiB}
    both = read(pod("two", "p2", claims=["shared", "unprepared"], templated=["nb-gpu-x7"]))
    # The highest weight and priority; on GPU 0 the larger limit; GPU 1 has none.
    assert both.values == {WEIGHT: 5, PRIORITY: 1}
    assert both.device_values == {(MEMORY_LIMIT, GPUS[0].uuid): 8 * GiB}
    assert read(pod("done", "p3", claims=["shared"], phase="Succeeded")).values == {}
    assert read(pod("other", "p4", claims=["unprepared"])).values == {}
    assert read({"metadata": {"name": "no-uid"}}) is None


def test_a_limit_for_one_device_is_sent_and_removed_with_that_device():
    settings = PodSettings()
    read = podclaims.reader(lambda: {("team-a", "shared"): prepared_claim("shared", "u1", {GPUS[1].uuid: 2 * GiB})})
    settings.replace_all([read(pod("one", "p1", claims=["shared"]))])
    (request,) = settings.pending()
    assert request == Request("p1", "team-a/one", MEMORY_LIMIT, 2 * GiB, GPUS[1].uuid)
    assert (request.op, request.fields) == ("set-limit", {"pod_uid": "p1", "bytes": 2 * GiB, "device": GPUS[1].uuid})
    assert str(request) == f"{MEMORY_LIMIT}={2 * GiB} on {GPUS[1].uuid}"
    settings.told(request)
    assert settings.pending() == []
    settings.remove("p1")
    assert settings.pending() == [Request("p1", "team-a/one", MEMORY_LIMIT, None, GPUS[1].uuid)]


# ---- the checkpoint ---------------------------------------------------------------------------------


def test_the_checkpoint_keeps_prepared_claims_and_refuses_a_damaged_file(tmp_path):
    path = tmp_path / "checkpoint.json"
    assert checkpoint.load(path) == checkpoint.Checkpoint({}, frozenset())
    kept = checkpoint.Checkpoint({"u1": prepared_claim("shared", "u1", {GPUS[0].uuid: 4 * GiB}, weight=3),
                                  "u2": moded("moded", "u2", {1: "auto"})}, frozenset({GPUS[1].uuid, "GPU-given-back-later"}))
    checkpoint.save(path, kept)
    assert checkpoint.load(path) == kept
    assert checkpoint.load(path).claims["u2"].gpu_modes == {GPUS[1].uuid: "auto"}
    assert path.stat().st_mode & 0o777 == 0o600
    # A checkpoint of a driver from before modes: its claims, and no GPU to give back.
    (before_modes,) = [claim for claim in json.loads(path.read_text())["claims"] if claim["uid"] == "u1"]
    for device in before_modes["devices"]:
        del device["mode"]
    path.write_text(json.dumps({"kind": checkpoint.KIND, "version": 1, "claims": [before_modes]}))
    assert checkpoint.load(path) == checkpoint.Checkpoint({"u1": kept.claims["u1"]}, frozenset())
    for damage in ("{", json.dumps({"kind": "something else", "version": 1, "claims": []}),
                   json.dumps({"kind": checkpoint.KIND, "version": 1, "claims": [{"uid": "x"}]}),
                   json.dumps({"kind": checkpoint.KIND, "version": 1, "claims": [], "modesSet": "GPU-0"})):
        path.write_text(damage)
        with pytest.raises(checkpoint.CheckpointError):
            checkpoint.load(path)
