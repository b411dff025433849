"""Lab 4.9: scripts/reshard_checkpoint.py saves a sharded FSDP2 model and optimizer from 4
processes and loads them into 2 and into one plain model, equal to the saving run's memory
(a wrong reference fails the check); the pieces each loading rank reads (the exercise)
equal what DCP reads, on uneven cuts and in the real run; a save killed before .metadata
is detected; the whole model is rebuilt by lab_utils.models.load; a process count that does
not fit stops cleanly."""

import copy
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import REPO, launch_quick, script_help, script_stop, tiny_transformer
from torch.distributed.checkpoint.api import CheckpointException

import lab4_checks as checks
import lab4_solutions as reference
from lab_utils import models
from lab_utils.checks import CheckFailed

SCRIPT = REPO / "labs" / "lab4_model_parallel" / "scripts" / "reshard_checkpoint.py"
TINY = tiny_transformer()


def run(args, nprocs):
    return launch_quick(SCRIPT, [*TINY, *args], nprocs=nprocs)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    d = tmp_path_factory.mktemp("dcp")
    result = run(
        ["--save", d / "ckpt", "--reference", d / "ref.pt", "--checkpoint", d / "plain.pt"], 4
    )
    assert result.ok, result.output
    return d, result.event("saved")


@pytest.fixture(scope="module")
def loaded(saved):
    d, _ = saved
    result = run(["--load", d / "ckpt", "--reference", d / "ref.pt"], 2)
    assert result.ok, result.output
    return result.event("loaded")


def test_four_ranks_saved_two_ranks_loaded_equal(saved, loaded):
    checks.check_resharded(loaded, saved[1])
    assert loaded["procs"] == 2 and saved[1]["procs"] == 4


def assert_sharded_not_gathered(state_dict: dict, ranks: int) -> None:
    """Every value of FSDP2's own ``state_dict()`` a DTensor, and each rank holding only
    its shard (rows cut over the ranks) of every tensor with ≥ ranks rows."""
    assert state_dict and all(t == "DTensor" for t, _, _ in state_dict.values())
    cut = [(g, mine) for _, g, mine in state_dict.values() if g[0] >= ranks]
    assert cut and all(mine[0] == -(-g[0] // ranks) < g[0] for g, mine in cut)


def test_fsdp2_state_dict_holds_each_ranks_shard(loaded):
    """4.9's claim about PyTorch, checked on the 2-rank run: FSDP2's state_dict() gathers
    nothing (torch/distributed/fsdp/_fully_shard/_fsdp_param.py registers each parameter
    as a sharded DTensor); a torch.save of it writes this rank's shard. And get_state_dict
    gives the optimizer's moments as DTensors but its step as a plain Tensor."""
    assert_sharded_not_gathered(loaded["state_dict"], loaded["procs"])
    assert "step:Tensor" in loaded["optim_types"]
    assert {"exp_avg:DTensor", "exp_avg_sq:DTensor"} <= set(loaded["optim_types"])
    gathered = {k: ["Tensor", g, g] for k, (_, g, _) in loaded["state_dict"].items()}
    with pytest.raises(AssertionError):  # what FSDP1's FULL_STATE_DICT would hand over
        assert_sharded_not_gathered(gathered, loaded["procs"])


@pytest.mark.parametrize(
    "wrong",
    [
        lambda s, ld: (dict(s, files={"__0_0.distcp": 1}), ld),
        lambda s, ld: (s, dict(ld, errors={"model": 1e-7, "optim": 0.0})),
    ],
)
def test_a_wrong_result_fails_the_check(saved, loaded, wrong):
    s, ld = wrong(copy.deepcopy(saved[1]), copy.deepcopy(loaded))
    with pytest.raises(CheckFailed):
        checks.check_resharded(ld, s)


# ------------------------------------------------------------------ the exercise
def test_pieces_reference_equals_what_dcp_reads(loaded):
    """The reference against DCP's own resharding function on every cut of 1–40 rows that
    torch.chunk splits into as many pieces as ranks (4, 3, 2 savers; 1–4 loaders), and
    against what the 2 loading ranks of the real run read from the 4 files."""
    cases = 0
    for rows in range(1, 41):
        for saved_ranks in (2, 3, 4):
            for ranks in (1, 2, 3, 4):
                if any(len(torch.arange(rows).chunk(n)) != n for n in (saved_ranks, ranks)):
                    continue
                for rank in range(ranks):
                    assert reference.pieces_to_read(rows, saved_ranks, rank, ranks) == (
                        checks.dcp_reads(rows, saved_ranks, rank, ranks)
                    )
                    cases += 1
    assert cases > 300
    assert loaded["saved_procs"] == 4 and set(loaded["reads"]) == {"0", "1"}
    checks.check_pieces_to_read(reference.pieces_to_read, loaded)


def _floor_cut(rows, saved_ranks, rank, ranks):  # rows // n per rank, the rest on the last
    def cut(n):
        size = rows // n
        return [(i * size, rows if i == n - 1 else (i + 1) * size) for i in range(n)]

    lo, hi = cut(ranks)[rank]
    return [
        (s, max(a, lo) - a, max(a, lo) - lo, min(b, hi) - max(a, lo))
        for s, (a, b) in enumerate(cut(saved_ranks))
        if max(a, lo) < min(b, hi)
    ]


def _global_rows(rows, saved_ranks, rank, ranks):  # rows of the whole tensor, not the shards
    size, mine = -(-rows // saved_ranks), -(-rows // ranks) * rank
    return [
        (s, s * size + a, mine + d, n)
        for s, a, d, n in reference.pieces_to_read(rows, saved_ranks, rank, ranks)
    ]


def _every_file(rows, saved_ranks, rank, ranks):  # the overlaps, plus every other file
    got = reference.pieces_to_read(rows, saved_ranks, rank, ranks)
    return got + [(s, 0, 0, 0) for s in range(saved_ranks) if s not in {g[0] for g in got}]


@pytest.mark.parametrize(
    "wrong, hint",
    [
        (_floor_cut, "torch.chunk"),
        (_global_rows, "relative to each shard"),
        (_every_file, "not every file"),
    ],
    ids=["rows // n cut", "rows of the whole tensor", "every file read"],
)
def test_pieces_check_names_the_mistake(wrong, hint):
    with pytest.raises(CheckFailed, match=hint):
        checks.check_pieces_to_read(wrong)


def test_pieces_check_fails_an_answer_the_run_contradicts(loaded):
    """An answer right on the uneven cases but wrong for the real run's tensors fails on
    the run's own reads."""

    def only_uneven(rows, saved_ranks, rank, ranks):
        got = reference.pieces_to_read(rows, saved_ranks, rank, ranks)
        return got if (rows, saved_ranks, ranks) in {c for c in checks.PIECE_CASES} else got[:1]

    with pytest.raises(CheckFailed, match="the run read"):
        checks.check_pieces_to_read(only_uneven, loaded)


def test_one_plain_model_reads_the_sharded_checkpoint(saved):
    d, _ = saved
    plain = models.load(d / "plain.pt")
    state = {"model": {k: torch.zeros_like(v) for k, v in plain.state_dict().items()}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group": one process reads everything
        dcp.load(state, checkpoint_id=d / "ckpt")
    ref = torch.load(d / "ref.pt", weights_only=True)["model"]
    assert all(torch.equal(state["model"][k], ref[k]) for k in ref)
    assert all(torch.equal(plain.state_dict()[k], ref[k]) for k in ref)


def test_a_save_killed_before_metadata_is_detected(tmp_path):
    result = run(
        ["--save", tmp_path / "ckpt", "--reference", tmp_path / "ref.pt", "--die-before-metadata"],
        2,
    )
    assert not result.ok
    files = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    error = None
    try:
        dcp.load({"model": {}}, checkpoint_id=tmp_path / "ckpt")
    except (CheckpointException, OSError) as e:  # a BaseException, not an Exception
        error = e
    checks.check_incomplete(files, error)
    with pytest.raises(CheckFailed):  # the same check on a complete save fails
        checks.check_incomplete([*files, ".metadata"], None)


def test_process_count_that_does_not_fit_stops_cleanly(tmp_path, monkeypatch, capsys):
    """As rank 0 of 3 (torchrun's environment): the script stops with status 2 before
    it joins any process group."""
    argv = [*TINY, "--save", tmp_path / "c", "--reference", tmp_path / "r.pt"]
    assert script_stop(monkeypatch, SCRIPT, argv, world_size=3) == 2
    assert "error: the global batch 8 cannot be split over 3" in capsys.readouterr().err
    assert not (tmp_path / "c").exists()


def test_help_names_both_modes(monkeypatch):
    out = script_help(monkeypatch, SCRIPT)
    assert "--save DIR" in out and "--load DIR" in out and "'quick' profile" in out
