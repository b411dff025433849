"""Lab 4.7: the ring-attention check (the reference passes it; a wrong softmax rescaling, a
missing causal mask or a block from the future fails it); the zig-zag layout's ring
attention equal to full causal attention and its work per rank counted by FlopCounterMode
against the contiguous layout's; and context_parallel.py under torchrun: ring attention
over processes (both layouts) equal to full attention, sequence parallelism's collectives
and bytes against tensor parallelism.
"""

import inspect

import pytest
import torch
from conftest import REPO, launch_quick, script_help, script_stop
from torch.nn import functional as F
from torch.utils.flop_counter import FlopCounterMode

import lab4_checks as checks
import lab4_solutions as reference
from lab_utils import planner
from lab_utils import ring_attention as ring
from lab_utils.checks import CheckFailed

SCRIPT = REPO / "labs" / "lab4_model_parallel" / "scripts" / "context_parallel.py"
TINY = ["--d-model", "32", "--seq-len", "32", "--seq-lens", "32", "64", "--repeats", "1"]


def mutant(old: str, new: str):
    """The reference ring attention with one line changed."""
    src = inspect.getsource(reference.ring_attention)
    assert old in src
    scope = dict(vars(inspect.getmodule(reference.ring_attention)))
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


def test_ring_attention_check_names_a_masked_diagonal():
    """Masking the diagonal too (triu(0)) leaves the first query row with no score: NaN,
    and the hint says so, not the rescaling."""
    wrong = mutant(
        "dtype=torch.bool, device=q.device).triu(1)", "dtype=torch.bool, device=q.device).triu(0)"
    )
    with pytest.raises(CheckFailed, match="keep the diagonal"):
        checks.check_ring_attention(wrong)


# ------------------------------------------------------------------ the zig-zag layout
def _simulated(attend, cut, n: int, seed: int = 0):
    """Every rank of a simulated ring of n on a causal attention of 8·n positions: each
    rank's output, its forward FLOPs (FlopCounterMode), and the inputs and full attention."""
    g = torch.Generator().manual_seed(seed + n)
    q, k, v = (
        torch.randn(2, 3, 8 * n, 16, generator=g, dtype=torch.float64).requires_grad_()
        for _ in range(3)
    )
    qs, ks, vs = ([cut(t, r, n) for r in range(n)] for t in (q, k, v))
    outs, flops = [], []
    for r in range(n):
        with FlopCounterMode(display=False) as counter:
            outs.append(attend(qs[r], ks[r], vs[r], r, n, ring.simulated_ring(ks, vs, r)))
        flops.append(counter.get_total_flops())
    return outs, flops, (q, k, v)


def test_zigzag_layout_round_trips():
    t = torch.arange(2 * 3 * 24 * 4).view(2, 3, 24, 4)
    for n in (1, 2, 3, 4):
        shares = [ring.zigzag_chunk(t, r, n) for r in range(n)]
        assert torch.equal(ring.zigzag_unchunk(shares), t)
        first = shares[0][0, 0, :, 0] // 4  # positions held by rank 0: chunk 0 and 2n−1
        assert first.tolist() == [*range(24 // (2 * n)), *range(24 - 24 // (2 * n), 24)]


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_zigzag_ring_attention_equals_full_causal_attention(n):
    outs, _, (q, k, v) = _simulated(ring.zigzag_ring_attention, ring.zigzag_chunk, n)
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    out = ring.zigzag_unchunk(outs)
    torch.testing.assert_close(out, full, rtol=1e-12, atol=1e-12)
    weight = torch.randn(
        full.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(n)
    )
    got = torch.autograd.grad((out * weight).sum(), (q, k, v))
    want = torch.autograd.grad((full * weight).sum(), (q, k, v))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_work_per_rank_counted_by_flops(n):
    """Forward FLOPs per rank (torch's FlopCounterMode), in (T/2n)² blocks of scores:
    contiguous rank r computes 4·(r+1), so the busiest holds 2n/(n+1) of the mean rank's
    work and rank 0 1/n of the busiest's; zig-zag every rank 2n + 1."""
    block = 4 * 2 * 3 * 16 * 4**2  # QKᵀ and PV of one (T/2n)² = 4² block, b=2, h=3, d=16
    _, contiguous, _ = _simulated(reference.ring_attention, ring.chunk, n)
    _, zigzag, _ = _simulated(ring.zigzag_ring_attention, ring.zigzag_chunk, n)
    assert contiguous == [block * ring.score_blocks(r, n, "contiguous") for r in range(n)]
    assert zigzag == [block * ring.score_blocks(r, n, "zigzag") for r in range(n)]
    assert max(contiguous) / (sum(contiguous) / n) == pytest.approx(2 * n / (n + 1))
    assert contiguous[0] / contiguous[-1] == pytest.approx(1 / n)
    assert max(zigzag) == min(zigzag) < max(contiguous)


def zigzag_mutant(old: str, new: str):
    """The zig-zag ring attention with one line changed."""
    src = inspect.getsource(ring.zigzag_ring_attention)
    assert old in src
    scope = dict(vars(ring))
    exec(src.replace(old, new), scope)
    return scope["zigzag_ring_attention"]


@pytest.mark.parametrize(
    "old, new",
    [
        ("late.add(k1, v1, diagonal=True)", "late.add(k1, v1, diagonal=False)"),
        ("late.add(k0, v0, diagonal=False)\n            late.add(k1", "late.add(k1"),
        ("elif src < rank:", "elif src > rank:"),
    ],
    ids=["late diagonal unmasked", "late × early block missed", "earlier and later swapped"],
)
def test_a_wrong_zigzag_fails_the_comparison(old, new):
    wrong = zigzag_mutant(old, new)
    outs, _, (q, k, v) = _simulated(wrong, ring.zigzag_chunk, 3)
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert not torch.allclose(ring.zigzag_unchunk(outs), full, rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def two_ranks():
    return launch_quick(SCRIPT, TINY, nprocs=2).check()


@pytest.mark.launcher
def test_ring_attention_over_processes_equals_full_attention(two_ranks):
    equal = two_ranks.events("ring_equal")
    assert {m["layout"] for m in equal} == {"contiguous", "zigzag"}
    for eq in equal:
        for name in ("out", "dq", "dk", "dv"):
            checks.check_equal(eq[name], what=f"{eq['layout']} ring on 2 processes: {name}")
    for row in two_ranks.events("ring_memory"):
        assert max(row["per_rank"]) < row["one_process"]
        assert row["per_rank"][0] < row["per_rank"][1]  # the causal imbalance
        for layout, flops in row["flops"].items():  # counted by FlopCounterMode on each rank
            assert flops == [row["block_flops"] * ring.score_blocks(r, 2, layout) for r in (0, 1)]
    cp = two_ranks.event("torch_context_parallel")
    assert cp["ran"] or cp["error"]


@pytest.mark.launcher
def test_sequence_parallel_trades_all_reduces_for_the_same_bytes(two_ranks):
    tp, sp = (two_ranks.event("sequence_parallel", sequence_parallel=s) for s in (False, True))
    assert tp["counts"] == {"all_reduce": 4, "all_gather": 0, "reduce_scatter": 0}
    assert sp["counts"] == {"all_reduce": 0, "all_gather": 4, "reduce_scatter": 4}
    assert sp["wire_bytes"] == tp["wire_bytes"] > 0
    assert max(sp["activation_bytes"]) < min(tp["activation_bytes"])
    # each rank's saved bytes (the block's forward; the loss's weight is not counted) are
    # the planner's, with torch's form of sequence parallelism (the gathered inputs whole)
    cfg = planner.Config(vocab=96, d_model=32, n_layers=1, n_heads=4, seq_len=32)
    for r, form in ((tp, "none"), (sp, "torch")):
        lay = planner.Layout(tp=2, sequence_parallel=form)
        assert r["activation_bytes"] == [4 * planner.block_activation_values(cfg, lay, 2)] * 2
    for r in (tp, sp):
        checks.check_equal(r["out_rel_err"], what="block output")
        checks.check_equal(r["grad_rel_err"], what="input gradient")


def test_help_shows_the_profiles_defaults(monkeypatch):
    out = script_help(monkeypatch, SCRIPT)
    assert "'quick' profile" in out and "--seq-lens" in out


def test_one_process_is_a_clean_error(monkeypatch, capsys):
    assert script_stop(monkeypatch, SCRIPT, TINY) == 2
    assert "at least 2 processes" in capsys.readouterr().err
