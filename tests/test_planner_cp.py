"""lab_utils.planner's context-parallel terms against the course's ring attention.

Lab 4.7's ring (lab_utils.ring_attention: ``Ring``, ``ring_pass``, the contiguous
``ring_attention`` of the exercise's reference and ``zigzag_ring_attention``) runs as the
attention core of a ``models.Block`` on every rank of a fake process group of 2 and 4
ranks (the real autograd graph and the real messages; the fake group moves no values).
On each rank the saved-bytes meter (lab_utils.saved_bytes.SavedBytes) counts what the
block keeps for backward, and the sizes of the tensors ``batch_isend_irecv`` sends are
added up. The planner counts the busiest rank (the last) exactly, in fp32 and bf16, with
and without full recomputation, and the messages of every rank exactly.

The old planner counted a flash-style ring (its own chunk's tensors only, K and V passed
again in backward, the gradients in fp32): for the block below at 2 ranks it planned
62,208 saved bytes where the course's ring saves 100,672 on its last rank, and 30,720
bytes sent per rank where the ring sends 15,360; every test here fails on it."""

import json
import subprocess
import sys
import textwrap

import pytest
from conftest import REPO

from lab_utils import planner, text

RUN = textwrap.dedent("""
    import json, sys, warnings
    warnings.simplefilter("ignore")
    import torch, torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torch.utils.checkpoint import checkpoint
    from lab_utils import models, ring_attention as ring, saved_bytes
    b, s, d, heads, *ranks = (int(a) for a in sys.argv[1:])
    sent = []
    send_recv = dist.batch_isend_irecv
    def counted(ops):  # ring_pass's one message: the size of what this rank sends
        sent.extend(op.tensor.numel() * op.tensor.element_size() for op in ops if op.op is dist.isend)
        return send_recv(ops)
    dist.batch_isend_irecv = counted
    attends = {"contiguous": ring.ring_attention, "zigzag": ring.zigzag_ring_attention}
    runs = [(dtype, recompute) for dtype in ("fp32", "bf16") for recompute in ("none", "full")]
    every = {}
    for n in ranks:  # both groups in one process: one start of torch
        every[n] = out = {}
        for rank in range(n):
            dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=n)
            for layout, attend in attends.items():
                for dtype, recompute in runs:
                    torch.manual_seed(0)
                    dt = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
                    block = models.Block(d, heads).to(dt)
                    passes = ring.Ring()
                    def core(q, k, v, is_causal):  # the block's attention: the course's ring
                        assert is_causal
                        return passes.tie(attend(q, k, v, rank, n, passes))
                    torch.nn.functional.scaled_dot_product_attention = core
                    x = torch.randn(b, s // n, d, dtype=dt, requires_grad=True)  # this rank's chunk
                    sent.clear()
                    with saved_bytes.SavedBytes(block.parameters()) as meter:
                        y = checkpoint(block, x, use_reentrant=True) if recompute == "full" else block(x)
                        kept = meter.live
                        y.float().sum().backward()
                    out[f"{layout} {dtype} {recompute} {rank}"] = {
                        "saved": meter.bytes, "kept": kept, "peak": meter.peak, "sent": list(sent)
                    }
            dist.destroy_process_group()
    print(json.dumps(every))
""")

B, SEQ, D, HEADS = 3, 16, 40, 4  # head width 10, chunk 8 (2 ranks) or 4 (4 ranks)


@pytest.fixture(scope="module")
def ring_runs():
    """The fake groups of 2 and of 4 ranks, run one after the other in one process."""
    done = subprocess.run(
        [sys.executable, "-c", RUN, *map(str, (B, SEQ, D, HEADS, 2, 4))],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module", params=[2, 4])
def ring_measured(request, ring_runs):
    return request.param, ring_runs[str(request.param)]


CFG = planner.Config(vocab=text.VOCAB, d_model=D, n_layers=1, n_heads=HEADS, seq_len=SEQ)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_ring_block_activations_are_exact_on_the_busiest_rank(ring_measured, layout, precision):
    """The planner's block under context parallelism is the last rank's, exactly; every
    other rank saves less (contiguous: it attends to fewer blocks; zig-zag: a later
    rank's message saves less than an earlier one's)."""
    n, measured = ring_measured
    saved = [measured[f"{layout} {precision} none {r}"]["saved"] for r in range(n)]
    lay = planner.Layout(cp=n, cp_layout=layout, precision=precision)
    assert saved[-1] == planner.block_activation_bytes(CFG, lay, B)
    assert max(saved[:-1]) < saved[-1]


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_full_recomputation_keeps_the_chunk_and_peaks_at_one_block(ring_measured, layout):
    """checkpoint(use_reentrant=True) around the block: the forward keeps this rank's
    chunk of the input; the backward's peak is what the block saves."""
    n, measured = ring_measured
    lay = planner.Layout(cp=n, cp_layout=layout, recompute="full")
    last = measured[f"{layout} fp32 full {n - 1}"]
    assert last["kept"] == planner.block_input_bytes(CFG, lay, B)
    assert last["peak"] == planner.block_activation_bytes(CFG, lay, B)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("recompute", ["none", "full"])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_ring_messages_are_counted(ring_measured, layout, recompute, precision):
    """Every rank sends cp − 1 (K, V) messages forward and cp − 1 gradients of the same
    size back (Ring.tie makes every rank run every pass's backward), and with full
    recomputation the forward's again: the planner's send_recv_cp, on every rank."""
    n, measured = ring_measured
    lay = planner.Layout(cp=n, cp_layout=layout, recompute=recompute, precision=precision)
    kv = 2 * B * (SEQ // n) * D * planner.PRECISIONS[precision][0]
    want = planner.wire_bytes(CFG, lay, B)["send_recv_cp"]
    for r in range(n):
        sent = measured[f"{layout} {precision} {recompute} {r}"]["sent"]
        assert sent == [kv] * ((n - 1) * (3 if recompute == "full" else 2))
        assert sum(sent) == want


def test_zigzag_needs_two_pieces_per_rank():
    with pytest.raises(ValueError, match="zig-zag"):
        planner.plan(
            planner.Config(vocab=96, d_model=32, n_layers=1, n_heads=4, seq_len=12),
            planner.Layout(cp=4, cp_layout="zigzag"),
            batch=2,
        )
