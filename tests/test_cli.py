"""The command-line trainer, in one process and under a launcher.

Under torchrun here, through ``launch.run``: the final record, rank 0 alone reporting, and
a checkpoint of the unwrapped model. README.md's commands start it under torchrun, mpirun
and horovodrun as written, and tests/test_readme_commands.py checks in each run's output
that rank 0 alone reported and saw a world of 2 (``check_cli_output``): launching the
three again here proved nothing more (``launch.run``'s own wiring under each launcher is
tests/test_launch.py's).
"""

import sysconfig
from pathlib import Path

import pytest

from lab_utils import cli, gloo_exit, launch, models

TINY = [
    "--dataset",
    "fashion-mnist",
    "--n-train",
    "512",
    "--n-test",
    "300",
    "--epochs",
    "1",
    "--batch-size",
    "32",
    "--profile",
    "quick",
]


def test_single_process_trains_and_saves_a_rebuildable_checkpoint(tmp_path, capsys):
    ck = tmp_path / "model.pt"
    assert cli.main([*TINY, "--checkpoint", str(ck), "--metrics", str(tmp_path / "m.jsonl")]) == 0
    out = capsys.readouterr().out
    assert "test accuracy" in out and "300 images" in out
    model = models.load(ck)
    assert model.arch_spec["arch"] == "fmnist_cnn"
    ckpt = models.read_checkpoint(ck)
    assert 0.3 < ckpt["test_acc"] <= 1.0  # well above chance (0.1) after one short epoch


# pip's console script (pyproject.toml's [project.scripts]): `sys.exit(main())` as its last line.
LAB_TRAIN = Path(sysconfig.get_path("scripts")) / "lab-train"


@pytest.mark.launcher
def test_under_torchrun(tmp_path):
    """Through ``lab-train``, pip's wrapper: README's commands start ``-m lab_utils.cli``."""
    assert LAB_TRAIN.is_file(), f"{LAB_TRAIN} is missing: install the course (make setup)"
    ck = tmp_path / "model.pt"
    result = launch.run(
        LAB_TRAIN,
        [*TINY, "--checkpoint", str(ck)],
        nprocs=2,
        launcher="torchrun",
        timeout=180,
        echo=False,
    ).check()
    assert result.event("final")["world_size"] == 2
    assert "world_size=2" in result.rank_output(0)
    assert "test accuracy" not in result.rank_output(1)  # only rank 0 reports
    assert models.load(ck).arch_spec["arch"] == "fmnist_cnn"
    # each rank ended through the armed sys.exit, so the hook knew its status
    assert gloo_exit.UNKNOWN_STATUS not in result.output


def test_bad_dataset_is_rejected():
    with pytest.raises(SystemExit):
        cli.parse_args(["--dataset", "imagenet"])
