import socket

import pytest
import torch

from lab_utils import dist


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, ("single", 0, 1, 0)),
        (
            {
                "RANK": "1",
                "WORLD_SIZE": "2",
                "LOCAL_RANK": "1",
                "LOCAL_WORLD_SIZE": "2",
                "MASTER_ADDR": "10.0.0.1",
                "MASTER_PORT": "29500",
            },
            ("torchrun", 1, 2, 1),
        ),
        (
            {
                "OMPI_COMM_WORLD_RANK": "3",
                "OMPI_COMM_WORLD_SIZE": "4",
                "OMPI_COMM_WORLD_LOCAL_RANK": "1",
                "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
                "OMPI_MCA_ess_base_jobid": "123",
            },
            ("mpirun", 3, 4, 1),
        ),
        (
            {"PMI_RANK": "2", "PMI_SIZE": "3", "MPI_LOCALRANKID": "2", "MPI_LOCALNRANKS": "3"},
            ("mpirun", 2, 3, 2),
        ),
        (
            {
                "HOROVOD_RANK": "1",
                "HOROVOD_SIZE": "2",
                "HOROVOD_LOCAL_RANK": "1",
                "HOROVOD_LOCAL_SIZE": "2",
                "HOROVOD_GLOO_RENDEZVOUS_ADDR": "127.0.0.1",
                "HOROVOD_GLOO_RENDEZVOUS_PORT": "4567",
            },
            ("horovodrun", 1, 2, 1),
        ),
        (
            {
                "SLURM_PROCID": "5",
                "SLURM_NTASKS": "8",
                "SLURM_LOCALID": "1",
                "SLURM_NTASKS_PER_NODE": "8",
            },
            ("slurm", 5, 8, 1),
        ),
    ],
)
def test_detect_each_launcher(env, expected):
    le = dist.detect(env)
    assert (le.launcher, le.rank, le.world_size, le.local_rank) == expected
    if le.world_size > 1:
        assert le.master_addr
        # A port given is kept; one machine without one agrees on a free port (with_port).
        assert le.master_port == (int(env["MASTER_PORT"]) if "MASTER_PORT" in env else None)


def test_a_job_across_machines_derives_the_same_port_on_every_rank_below_the_ephemeral_ones():
    base = {
        "OMPI_COMM_WORLD_SIZE": "4",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
        "OMPI_MCA_ess_base_jobid": "987",
        "MASTER_ADDR": "10.0.0.1",
    }
    ports = {dist.detect({**base, "OMPI_COMM_WORLD_RANK": str(r)}).master_port for r in range(4)}
    assert len(ports) == 1
    port = ports.pop()
    assert port is not None and 20000 <= port < 32768
    other = dist.detect({**base, "OMPI_COMM_WORLD_RANK": "0", "OMPI_MCA_ess_base_jobid": "988"})
    assert other.master_port != port  # two jobs side by side do not collide


def _one_machine(rank: int, jobid: str = "987", uri: str = "987.0;tcp://127.0.0.1:5000"):
    return dist.detect(
        {
            "OMPI_COMM_WORLD_RANK": str(rank),
            "OMPI_COMM_WORLD_SIZE": "2",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
            "OMPI_MCA_ess_base_jobid": jobid,
            "OMPI_MCA_orte_hnp_uri": uri,
        }
    )


@pytest.fixture
def port_folder(tmp_path, monkeypatch):
    """The ports of these tests' made-up jobs in a folder of their own."""
    monkeypatch.setattr(dist.port_agreement, "folder", lambda: tmp_path / "ports")
    return tmp_path / "ports"


def test_the_ranks_of_one_machine_agree_on_the_free_port_rank_0_picked(port_folder):
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(dist.with_port, _one_machine(1), 30)  # rank 1 may start first
        zero = dist.with_port(_one_machine(0))
        one = waiting.result()
    assert zero.master_port == one.master_port and zero.master_port is not None
    with socket.socket() as s:  # free: rank 0's store can listen on it
        s.bind(("127.0.0.1", zero.master_port))
    # Another mpirun on the machine whose 16-bit job family is the same: its own file.
    twin = _one_machine(0, uri="987.0;tcp://127.0.0.1:6000")
    assert dist.port_agreement.port_file(twin.job_id) != dist.port_agreement.port_file(zero.job_id)


def test_a_rank_whose_rank_0_never_publishes_says_so(port_folder):
    with pytest.raises(
        RuntimeError, match="rank 1 waited 0.3 s for rank 0 to publish.*MASTER_PORT"
    ):
        dist.with_port(_one_machine(1), 0.3)


def test_a_port_left_by_a_finished_job_with_the_same_id_is_not_taken(port_folder):
    import subprocess
    import sys

    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    le = _one_machine(1)
    stale = dist.port_agreement.port_file(le.job_id)
    stale.parent.mkdir()
    stale.write_text(f"1234 {gone.stdout.strip()}\n")
    with pytest.raises(RuntimeError, match="waited"):
        dist.with_port(le, 0.3)
    zero = dist.with_port(_one_machine(0))  # rank 0 replaces it
    assert dist.with_port(le, 5).master_port == zero.master_port != 1234


def test_multi_node_without_master_addr_is_a_clear_error():
    env = {
        "OMPI_COMM_WORLD_RANK": "0",
        "OMPI_COMM_WORLD_SIZE": "4",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
    }
    with pytest.raises(RuntimeError, match="MASTER_ADDR"):
        dist.detect(env)


def test_single_process_needs_no_process_group(monkeypatch):
    for var in (
        "RANK",
        "WORLD_SIZE",
        "OMPI_COMM_WORLD_RANK",
        "PMI_RANK",
        "HOROVOD_RANK",
        "SLURM_PROCID",
    ):
        monkeypatch.delenv(var, raising=False)
    info = dist.init()
    try:
        assert (info.rank, info.world_size, info.backend, info.launcher) == (0, 1, None, "single")
        assert dist.is_main() and dist.world_size() == 1
        t = torch.tensor([1.0, 2.0])
        assert torch.equal(dist.all_reduce_sum(t), t)
        assert dist.average(3.0) == 3.0
        assert dist.average_metrics({"a": 1.0, "b": 2.0}) == {"a": 1.0, "b": 2.0}
        dist.barrier()
    finally:
        dist.shutdown()


def test_launcher_environments_become_the_variables_init_process_group_reads(port_folder):
    env = {
        "OMPI_COMM_WORLD_RANK": "3",
        "OMPI_COMM_WORLD_SIZE": "4",
        "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
        "OMPI_MCA_ess_base_jobid": "123",
    }
    rank_0 = {**env, "OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_LOCAL_RANK": "0"}
    dist.set_torch_env_from_launcher(rank_0)  # publishes the port rank 3 reads
    le = dist.set_torch_env_from_launcher(env)
    assert le.launcher == "mpirun" and env["MASTER_PORT"] == rank_0["MASTER_PORT"]
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == (
        "3",
        "4",
        "1",
        "4",
    )
    assert env["MASTER_ADDR"] == "127.0.0.1" and env["MASTER_PORT"] == str(le.master_port)
    assert env["GLOO_SOCKET_IFNAME"] == "lo"  # one machine: loopback


def test_torchrun_variables_are_left_alone_and_one_process_gets_a_free_port():
    env = {
        "RANK": "1",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29500",
        "GLOO_SOCKET_IFNAME": "eth0",
    }
    before = dict(env)
    dist.set_torch_env_from_launcher(env)
    assert env == before
    alone: dict[str, str] = {}
    dist.set_torch_env_from_launcher(alone)
    assert (alone["RANK"], alone["WORLD_SIZE"], alone["LOCAL_RANK"]) == ("0", "1", "0")
    assert alone["MASTER_ADDR"] == "127.0.0.1" and 0 < int(alone["MASTER_PORT"]) < 65536


ALONE = """
import sys
import torch.distributed as td
from lab_utils import dist
info = dist.init(group_if_alone=sys.argv[1] == "1")
print(td.is_initialized(), info.world_size, info.backend)
dist.shutdown()
"""


@pytest.mark.parametrize(("flag", "expected"), [("1", "True 1 gloo"), ("0", "False 1 None")])
def test_a_single_process_gets_a_group_only_when_asked(flag, expected):
    """FSDP, DTensor and ZeRO need a group even alone; other scripts run without one."""
    import os
    import subprocess
    import sys

    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "CUDA_VISIBLE_DEVICES")
    }
    env["CUDA_VISIBLE_DEVICES"] = ""
    done = subprocess.run(
        [sys.executable, "-c", ALONE, flag], capture_output=True, text=True, timeout=120, env=env
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == expected


def test_gloo_uses_loopback_on_one_machine_only():
    one = dist.LaunchEnv("torchrun", 1, 2, 1, 2, "127.0.0.1", 29500, "")
    two = dist.LaunchEnv("torchrun", 3, 4, 1, 2, "10.0.0.1", 29500, "")  # 2 ranks per machine
    env: dict[str, str] = {}
    dist.gloo_on_loopback(one, env)
    assert env == {"GLOO_SOCKET_IFNAME": "lo"}
    env = {}
    dist.gloo_on_loopback(two, env)
    assert env == {}  # a job across machines names its interface itself
    env = {"GLOO_SOCKET_IFNAME": "eth0"}
    dist.gloo_on_loopback(one, env)
    assert env == {"GLOO_SOCKET_IFNAME": "eth0"}


def test_a_ports_folder_others_can_write_is_refused(port_folder):
    port_folder.mkdir(mode=0o777)
    port_folder.chmod(0o777)  # as if another user had made it first, open to all
    with pytest.raises(RuntimeError, match="not a folder of this user's alone"):
        dist.with_port(_one_machine(0))
    with pytest.raises(RuntimeError, match="not a folder of this user's alone"):
        dist.with_port(_one_machine(1), 5)
