"""Gang discovery (interceptor/gang.c, docs/interceptor.md "Gangs"): which multi-GPU job a
process belongs to, from the variables launchers set, or NVSHARE_GANG. The name must be the
same in every rank of a job and differ between jobs; the size counts the ranks on this node."""

from __future__ import annotations

import ctypes

import pytest

from fixtures.client_core import build_client_core


class _Gang(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char * 128), ("size", ctypes.c_uint64), ("source", ctypes.c_char * 200),
                ("malformed", ctypes.c_int)]


@pytest.fixture(scope="module")
def discover(tmp_path_factory):
    lib = ctypes.CDLL(str(build_client_core(tmp_path_factory.mktemp("gang"))))
    lib.nvs_gang_discover.argtypes = [ctypes.POINTER(ctypes.c_char_p), ctypes.POINTER(_Gang)]
    lib.nvs_gang_discover.restype = None

    def run(**env: str) -> tuple[str, int, str, bool]:
        entries = [f"{key}={value}".encode() for key, value in {"PATH": "/usr/bin", **env}.items()]
        array = (ctypes.c_char_p * (len(entries) + 1))(*entries, None)
        gang = _Gang()
        lib.nvs_gang_discover(array, ctypes.byref(gang))
        return gang.name.decode(), gang.size, gang.source.decode(), bool(gang.malformed)

    return run


TORCHRUN = {"MASTER_ADDR": "node7", "MASTER_PORT": "29500", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
            "TORCHELASTIC_RUN_ID": "a81f", "GROUP_RANK": "0"}


def test_torchrun_ranks_of_one_job_share_a_name_and_count_the_local_ranks(discover):
    names = {discover(**TORCHRUN, RANK=str(rank), LOCAL_RANK=str(rank))[:2] for rank in range(2)}
    assert names == {("torch:node7:29500:a81f", 2)}


def test_two_jobs_at_once_have_different_names(discover):
    first = discover(**TORCHRUN)[0]
    second = discover(**{**TORCHRUN, "MASTER_PORT": "29501", "TORCHELASTIC_RUN_ID": "none"})[0]
    assert first != second and second == "torch:node7:29501"


def test_a_job_over_two_nodes_is_a_gang_of_its_ranks_on_this_node(discover):
    assert discover(**{**TORCHRUN, "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"})[1] == 4


def test_deepspeed_and_hand_set_variables(discover):
    deepspeed = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500", "WORLD_SIZE": "4", "LOCAL_SIZE": "2",
                 "RANK": "1", "LOCAL_RANK": "1"}
    assert discover(**deepspeed)[:2] == ("torch:127.0.0.1:29500", 2)
    # torch.multiprocessing.spawn with the variables set by hand: nothing says how many are local
    name, size, source, _ = discover(MASTER_ADDR="localhost", MASTER_PORT="12355", WORLD_SIZE="2", RANK="0")
    assert (name, size) == ("torch:localhost:12355", 2) and "one node" in source


def test_torch_under_slurm_counts_this_nodes_tasks(discover):
    env = {"MASTER_ADDR": "n1", "MASTER_PORT": "6000", "WORLD_SIZE": "5", "SLURM_JOB_ID": "77",
           "SLURM_STEP_ID": "0", "SLURM_LOCALID": "0", "SLURM_STEP_TASKS_PER_NODE": "2(x2),1"}
    assert discover(**env, SLURM_NODEID="1")[:2] == ("torch:n1:6000", 2)
    assert discover(**env, SLURM_NODEID="2")[0] == ""  # one task on the last node: no gang


def test_open_mpi(discover):
    env = {"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_SIZE": "4", "OMPI_COMM_WORLD_RANK": "3",
           "PMIX_NAMESPACE": "prterun-host-4242@1"}
    assert discover(**env)[:2] == ("ompi:prterun-host-4242@1", 4)
    assert discover(**{k: v for k, v in env.items() if k != "PMIX_NAMESPACE"}, OMPI_MCA_ess_base_jobid="9")[0] == "ompi:9"
    name, _, source, _ = discover(**{k: v for k, v in env.items() if k != "PMIX_NAMESPACE"})
    assert name == "" and "NVSHARE_GANG" in source  # no job id: says how to name it


def test_slurm_tasks_of_one_step(discover):
    env = {"SLURM_JOB_ID": "1234", "SLURM_STEP_ID": "3", "SLURM_LOCALID": "1", "SLURM_NODEID": "0",
           "SLURM_STEP_TASKS_PER_NODE": "4(x2)"}
    assert discover(**env)[:2] == ("slurm:1234.3", 4)
    assert discover(**{**env, "SLURM_STEP_ID": "4"})[0] == "slurm:1234.4"
    # a batch script (no srun task) is not a gang
    assert discover(SLURM_JOB_ID="1234", SLURM_NTASKS_PER_NODE="4")[0] == ""


def test_one_rank_is_no_gang(discover):
    assert discover(**{**TORCHRUN, "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"})[:2] == ("", 0)
    assert discover()[:2] == ("", 0)


def test_nvshare_gang_overrides_and_none_opts_out(discover):
    assert discover(**TORCHRUN, NVSHARE_GANG="train-a:3")[:2] == ("train-a", 3)
    assert discover(**TORCHRUN, NVSHARE_GANG="host:9000:2")[:2] == ("host:9000", 2)
    assert discover(**TORCHRUN, NVSHARE_GANG="none")[:2] == ("", 0)


@pytest.mark.parametrize("value", ["train", "train:", ":2", "train:two", "train:0"])
def test_a_malformed_nvshare_gang_is_reported_and_the_launchers_variables_decide(discover, value):
    name, size, _, malformed = discover(**TORCHRUN, NVSHARE_GANG=value)
    assert malformed and (name, size) == ("torch:node7:29500:a81f", 2)
