"""Lab 4.7: the ring-attention check (the reference passes it; a wrong softmax rescaling, a
missing causal mask or a block from the future fails it), and context_parallel.py under
torchrun: ring attention over processes equal to full attention, sequence parallelism's
collectives and bytes against tensor parallelism.
"""

import inspect
import io
import os
import subprocess
import sys
from contextlib import redirect_stdout

import pytest
from conftest import REPO

from lab_utils import launch
from lab_utils.checks import CheckFailed
from lab_utils.checks import lab4 as checks
from lab_utils.solutions import lab4 as reference
from lab_utils.source import load_script

SCRIPT = REPO / "labs" / "lab4_model_parallel" / "scripts" / "context_parallel.py"
TINY = ["--d-model", "32", "--seq-len", "32", "--seq-lens", "32", "64", "--repeats", "1"]


def mutant(old: str, new: str):
    """The reference ring attention with one line changed."""
    src = inspect.getsource(reference.ring_attention)
    assert old in src
    scope = dict(vars(reference))
    exec(src.replace(old, new), scope)
    return scope["ring_attention"]


def test_reference_ring_attention_passes():
    assert checks.check_ring_attention(reference.ring_attention) < 1e-5


@pytest.mark.parametrize(
    "old, new",
    [
        ("denom = denom * rescale + weights.sum(-1)", "denom = denom + weights.sum(-1)"),
        ("acc = acc * rescale.unsqueeze(-1) + weights @ v", "acc = acc + weights @ v"),
        ('scores = scores.masked_fill(future, float("-inf"))', "scores = scores"),
        ("if src <= rank:", "if True:"),
    ],
    ids=["denominator not rescaled", "sum not rescaled", "no causal mask", "future blocks used"],
)
def test_ring_attention_check_fails_a_wrong_answer(old, new):
    with pytest.raises(CheckFailed):
        checks.check_ring_attention(mutant(old, new))


@pytest.fixture(scope="module")
def two_ranks():
    result = launch.run(
        SCRIPT, TINY, nprocs=2, timeout=240, echo=False, env={"LABS_PROFILE": "quick"}
    ).check()
    return result.metrics


@pytest.mark.launcher
def test_ring_attention_over_processes_equals_full_attention(two_ranks):
    eq = next(m for m in two_ranks if m["event"] == "ring_equal")
    for name in ("out", "dq", "dk", "dv"):
        checks.check_equal(eq[name], what=f"ring attention on 2 processes: {name}")
    for row in (m for m in two_ranks if m["event"] == "ring_memory"):
        assert max(row["per_rank"]) < row["one_process"]
        assert row["per_rank"][0] < row["per_rank"][1]  # the causal imbalance
    cp = next(m for m in two_ranks if m["event"] == "torch_context_parallel")
    assert cp["ran"] or cp["error"]


@pytest.mark.launcher
def test_sequence_parallel_trades_all_reduces_for_the_same_bytes(two_ranks):
    tp, sp = (next(m for m in two_ranks if m.get("sequence_parallel") is s) for s in (False, True))
    assert tp["counts"] == {"all_reduce": 4, "all_gather": 0, "reduce_scatter": 0}
    assert sp["counts"] == {"all_reduce": 0, "all_gather": 4, "reduce_scatter": 4}
    assert sp["wire_bytes"] == tp["wire_bytes"] > 0
    assert max(sp["activation_bytes"]) < min(tp["activation_bytes"])
    for r in (tp, sp):
        checks.check_equal(r["out_rel_err"], what="block output")
        checks.check_equal(r["grad_rel_err"], what="input gradient")


def test_help_shows_the_profiles_defaults(monkeypatch):
    monkeypatch.setenv("LABS_PROFILE", "quick")
    out = io.StringIO()
    with redirect_stdout(out), pytest.raises(SystemExit):
        load_script(SCRIPT).parse_args(["--help"])
    assert "'quick' profile" in out.getvalue() and "--seq-lens" in out.getvalue()


def test_one_process_is_a_clean_error():
    result = subprocess.run(
        [sys.executable, str(SCRIPT), *TINY],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "LABS_PROFILE": "quick"},
    )
    assert result.returncode == 2 and "at least 2 processes" in result.stderr
