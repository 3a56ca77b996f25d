"""The device plugin's pure core: virtual devices, health and the choice of devices."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nvshare_py.deviceplugin.config import AllocationPolicy
from nvshare_py.deviceplugin.inventory import PhysicalGpu, GpuUnavailable, InvalidRequest, Inventory
from nvshare_py.deviceplugin.v1beta1 import HEALTHY, UNHEALTHY

REPLICAS = 4


def make_inventory(gpus: int) -> Inventory:
    return Inventory([PhysicalGpu(f"GPU-{index:04d}", index, "test GPU", 1 << 30) for index in range(gpus)], REPLICAS)


@st.composite
def scenarios(draw):
    """An inventory with some GPUs unhealthy, and a GetPreferredAllocation request on it."""
    inventory = make_inventory(draw(st.integers(1, 5)))
    for gpu in inventory.gpus:
        if draw(st.booleans()) and draw(st.booleans()):
            inventory.set_presence(gpu.uuid, "gone")
    ids = [device_id for device_id, _ in inventory.devices()]
    available = draw(st.lists(st.sampled_from(ids), unique=True))
    must_include = draw(st.lists(st.sampled_from(available), unique=True, max_size=2)) if available else []
    size = draw(st.integers(len(must_include), len(must_include) + 4))
    policy = draw(st.sampled_from(list(AllocationPolicy)))
    return inventory, available, must_include, size, policy


@given(scenarios())
def test_preferred_allocation_keeps_must_include_and_adds_distinct_healthy_gpus(scenario):
    inventory, available, must_include, size, policy = scenario
    chosen = inventory.preferred(available, must_include, size, policy)
    assert chosen[:len(must_include)] == must_include
    assert len(set(chosen)) == len(chosen) <= size
    assert set(chosen) <= set(available)
    added = chosen[len(must_include):]
    gpus_of_added = [inventory.gpu_of(device_id).uuid for device_id in added]
    taken = {inventory.gpu_of(device_id).uuid for device_id in must_include}
    assert len(set(gpus_of_added)) == len(added) and not taken & set(gpus_of_added)
    assert all(inventory.unhealthy_reason(uuid) is None for uuid in gpus_of_added)
    # As many as there are usable GPUs left: nothing suggestible was held back.
    usable = {inventory.gpu_of(device_id).uuid for device_id in available
              if device_id not in must_include and inventory.unhealthy_reason(inventory.gpu_of(device_id).uuid) is None}
    assert len(added) == min(size - len(must_include), len(usable - taken))


@given(scenarios())
def test_the_policy_decides_which_gpu_comes_first(scenario):
    inventory, available, _, size, policy = scenario
    chosen = inventory.preferred(available, [], max(size, 1), policy)
    if not chosen:
        return
    free: dict[str, int] = {}
    for device_id in available:
        uuid = inventory.gpu_of(device_id).uuid
        if inventory.unhealthy_reason(uuid) is None:
            free[uuid] = free.get(uuid, 0) + 1
    first = free[inventory.gpu_of(chosen[0]).uuid]
    assert first == (max(free.values()) if policy is AllocationPolicy.SPREAD else min(free.values()))


def test_preferred_allocation_takes_the_lowest_free_replica():
    inventory = make_inventory(1)
    assert inventory.preferred(["GPU-0000::3", "GPU-0000::1", "GPU-0000::2"], [], 1,
                               AllocationPolicy.SPREAD) == ["GPU-0000::1"]


def test_preferred_allocation_refuses_a_size_below_must_include():
    with pytest.raises(InvalidRequest, match="smaller than"):
        make_inventory(2).preferred(["GPU-0000::0", "GPU-0001::0"], ["GPU-0000::0", "GPU-0001::0"], 1,
                                    AllocationPolicy.SPREAD)


def test_resolve_maps_devices_to_their_gpus_in_index_order():
    inventory = make_inventory(3)
    assert [gpu.index for gpu in inventory.resolve(["GPU-0002::1", "GPU-0000::3"])] == [0, 2]
    with pytest.raises(InvalidRequest, match="distinct GPUs"):
        inventory.resolve(["GPU-0001::0", "GPU-0001::2"])
    with pytest.raises(InvalidRequest, match="GPU-0001::4"):
        inventory.resolve(["GPU-0001::4"])
    inventory.set_presence("GPU-0002", "NVML: GPU is lost")
    with pytest.raises(GpuUnavailable, match="GPU is lost"):
        inventory.resolve(["GPU-0002::0"])


def test_all_devices_of_a_gpu_share_its_health_and_a_fatal_xid_is_sticky():
    inventory = make_inventory(2)
    health = lambda: {device_id.split("::")[0]: h for device_id, h in inventory.devices()}  # noqa: E731
    assert len(inventory.devices()) == 2 * REPLICAS
    assert inventory.set_presence("GPU-0001", "gone") is True
    assert inventory.set_presence("GPU-0001", "gone") is False  # no flip, no new list
    assert [h for d, h in inventory.devices() if d.startswith("GPU-0001")] == [UNHEALTHY] * REPLICAS
    assert health()["GPU-0000"] == HEALTHY
    assert inventory.set_presence("GPU-0001", None) is True
    assert inventory.record_fatal_xid("GPU-0000", 79) is True
    assert inventory.set_presence("GPU-0000", None) is False
    assert health() == {"GPU-0000": UNHEALTHY, "GPU-0001": HEALTHY}
    assert inventory.unhealthy_reason("GPU-0000") == "critical Xid 79"


def test_device_ids_longer_than_the_kubelet_allows_are_refused():
    with pytest.raises(ValueError, match="longer than 63"):
        Inventory([PhysicalGpu("MIG-" + "f" * 60, 0, "x", 1)], 10)
