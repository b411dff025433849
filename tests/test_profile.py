import pytest
import torch

from lab_utils import profile


def test_profile_from_environment(monkeypatch):
    monkeypatch.setenv("LABS_PROFILE", "quick")
    p = profile.current()
    assert p.name == "quick"
    assert p.pick(quick=1, cpu=2, gpu=3) == 1
    assert profile.current("gpu").pick(quick=1, cpu=2, gpu=3) == 3


def test_default_profile_follows_hardware(monkeypatch):
    monkeypatch.delenv("LABS_PROFILE", raising=False)
    expected = "gpu" if torch.cuda.is_available() else "cpu"
    assert profile.current().name == expected


def test_unknown_profile_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("LABS_PROFILE", "huge")
    with pytest.raises(ValueError, match="quick, cpu, gpu"):
        profile.current()


def test_device_and_threads(monkeypatch):
    dev = profile.device()
    assert dev.type == ("cuda" if torch.cuda.is_available() else "cpu")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert profile.configure_threads() == 1
    assert torch.get_num_threads() == 1
    assert profile.configure_threads(2) == 2
    assert torch.get_num_threads() == 2


def test_local_rank_from_each_launcher(monkeypatch):
    for var in ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "HOROVOD_LOCAL_RANK"):
        for other in (
            "LOCAL_RANK",
            "OMPI_COMM_WORLD_LOCAL_RANK",
            "MPI_LOCALRANKID",
            "HOROVOD_LOCAL_RANK",
            "SLURM_LOCALID",
        ):
            monkeypatch.delenv(other, raising=False)
        monkeypatch.setenv(var, "3")
        assert profile.local_rank() == 3
