"""lab_utils.planner against measurement: parameter counts, one process's state and saved
activations (exact), FSDP2's padded shards on 4 ranks and a (2 × 2) FSDP × tensor-parallel
mesh measured from the real wrappers on a fake process group (exact; the unpadded ZeRO
formula fails the same check), the embedding and head split by vocabulary (torch's
Rowwise/ColwiseParallel), the expert-parallel state, the widget headless, GPT-3.

Activations, each against the one meter (lab_utils.saved_bytes.SavedBytes): a pipeline
stage with several micro-batches in flight, with and without torch.utils.checkpoint on
every block (the peak during the backward: one block recomputed at a time); tensor
parallelism alone and with torch's SequenceParallel at 2 and 4 ranks, through the plan
that Lab 4.7's script runs (Megatron's form is shown not to be what torch does)."""

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import REPO
from torch.utils.checkpoint import checkpoint

import lab4_checks as checks
import lab4_solutions as reference
from lab_utils import memory, models, moe, parallel, planner, saved_bytes, text, timeline
from lab_utils.checks import CheckFailed


def config(d=36, layers=2, seq=20, **kw):
    return planner.Config(
        vocab=text.VOCAB, d_model=d, n_layers=layers, n_heads=4, seq_len=seq, **kw
    )


def char_model(cfg):
    torch.manual_seed(0)
    return models.build(
        "char_transformer",
        vocab=cfg.vocab,
        d_model=cfg.d_model,
        n_heads=cfg.n_heads,
        n_layers=cfg.n_layers,
        max_len=cfg.seq_len,
    )


@pytest.mark.parametrize("d, layers", [(32, 1), (36, 2), (64, 3)])
def test_parameter_count_and_one_process_state_are_exact(d, layers):
    cfg = config(d, layers)
    model = char_model(cfg)
    assert planner.count_params(cfg) == sum(p.numel() for p in model.parameters())
    opt = torch.optim.Adam(model.parameters())
    x = torch.randint(0, cfg.vocab, (2, cfg.seq_len))
    parallel.lm_loss(model(x), x).backward()
    opt.step()
    p = planner.plan(cfg, planner.Layout(), batch=2)
    assert memory.state_bytes(model, opt) == {
        "params": p.params,
        "grads": p.grads,
        "optimizer": p.optimizer,
    }


@pytest.mark.parametrize("b, seq, d, layers", [(2, 16, 32, 1), (3, 20, 36, 2), (4, 32, 64, 2)])
def test_activation_bytes_are_exact(b, seq, d, layers):
    cfg = config(d, layers, seq)
    model = char_model(cfg)
    x = torch.randint(0, cfg.vocab, (b, seq))
    y = torch.randint(0, cfg.vocab, (b, seq))  # targets of their own, as in training
    saved = memory.activation_bytes(lambda: parallel.lm_loss(model(x), y), model.parameters())
    assert planner.plan(cfg, planner.Layout(), batch=b).activations == saved


@pytest.mark.parametrize("b, seq, d, layers", [(2, 16, 32, 1), (3, 20, 36, 2)])
def test_bf16_activations_are_exact(b, seq, d, layers):
    """The planner's bf16 is a bf16 model (its optimizer's fp32 master weights aside): every saved
    tensor bf16 except the fused attention's log-sum-exp, which stays fp32; the loss on
    logits cast to fp32. The old count (every value at 2 bytes) fails."""
    cfg = config(d, layers, seq)
    model = char_model(cfg).to(torch.bfloat16)
    x = torch.randint(0, cfg.vocab, (b, seq))
    y = torch.randint(0, cfg.vocab, (b, seq))
    meter = saved_bytes.SavedBytes(exclude=model.parameters())
    with meter:
        parallel.lm_loss(model(x).float(), y)
    lay = planner.Layout(precision="bf16")
    assert planner.plan(cfg, lay, batch=b).activations == meter.bytes
    lse = 4 * b * seq * 4  # 4 heads' log-sum-exp per block, fp32
    assert layers * lse == sum(
        v.nbytes
        for v in meter.storages.values()
        if v.dtype == torch.float32 and v.shape == (b, 4, seq)
    )


def test_autocast_saves_more_than_the_bf16_plan():
    """Autocast (the course's mixed precision) is not the planner's "bf16": it keeps fp32
    LayerNorm inputs and saves the bf16 copies of the weights it casts (on CPU, this
    PyTorch), about twice the bf16 plan for this block."""
    cfg = config(64, 1, 32)
    block = models.Block(64, 4)
    h = torch.randn(2, 32, 64, requires_grad=True)
    meter = saved_bytes.SavedBytes(exclude=block.parameters())
    with meter, torch.autocast("cpu", dtype=torch.bfloat16):
        block(h)
    plan16 = planner.block_activation_bytes(cfg, planner.Layout(precision="bf16"), 2)
    casts = [v for v in meter.storages.values() if v.shape in ((64, 64), (256, 64), (64, 256))]
    assert meter.bytes > plan16 and casts and all(v.dtype == torch.bfloat16 for v in casts)
    fp32_inputs = [v for v in meter.storages.values() if v.shape == (2, 32, 64)]
    assert fp32_inputs and all(v.dtype == torch.float32 for v in fp32_inputs)  # the norms


def test_moe_parameter_count_is_exact():
    cfg = config(32, 2, 16, n_experts=4, top_k=2)
    model = models.build(
        "moe_char_transformer",
        vocab=cfg.vocab,
        d_model=32,
        n_heads=4,
        n_layers=2,
        max_len=16,
        n_experts=4,
    )
    assert planner.count_params(cfg) == sum(p.numel() for p in model.parameters())
    assert (
        planner.expert_values(cfg, planner.Layout(dp=2, ep=2), 0)
        == sum(p.numel() for n, p in model.named_parameters() if moe.is_expert_param(n)) // 2
    )


FAKE = textwrap.dedent("""
    import json, sys, warnings
    warnings.simplefilter("ignore")
    import torch, torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module
    sys.path.insert(0, "labs/lab4_model_parallel/scripts")
    from tensor_parallel import tp_plan
    from lab_utils import models, memory, text
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    def measured(model, mesh):
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.Adam(model.parameters())
        model(torch.randint(0, text.VOCAB, (2, 18))).sum().backward()
        opt.step()
        return memory.state_bytes(model, opt)
    def build(d):
        return models.build("char_transformer", vocab=text.VOCAB, d_model=d, n_heads=4, n_layers=2, max_len=18)
    out = {"fsdp4": measured(build(20), init_device_mesh("cpu", (4,)))}
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    out["dp2tp2"] = measured(parallelize_module(build(36), mesh["tp"], tp_plan(2)), mesh["dp"])
    # Megatron-LM's vocabulary split, as torch expresses it: the token embedding by rows
    # (RowwiseParallel on an nn.Embedding shards its weight Shard(0)), the head by columns
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    vocab_plan = {
        **tp_plan(2),
        "layers.0.tok": RowwiseParallel(input_layouts=Replicate()),
        "layers.3.out": ColwiseParallel(output_layouts=Replicate()),
    }
    model = parallelize_module(build(36), init_device_mesh("cpu", (4,)), vocab_plan)
    opt = torch.optim.Adam(model.parameters(), foreach=False)
    model(torch.randint(0, text.VOCAB, (2, 18))).sum().backward()
    opt.step()
    out["tp4vocab"] = memory.state_bytes(model, opt)
    print(json.dumps(out))
""")


IN_ONE_PROCESS = textwrap.dedent("""
    import contextlib, io, json, sys
    import torch.distributed as dist
    every = []
    for source, argv in json.loads(sys.argv[1]):  # each on a fresh fake group of its own
        sys.argv = ["-c", *argv]
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            exec(source, {"__name__": "__main__"})
        dist.destroy_process_group()
        every.append(json.loads(printed.getvalue().strip().splitlines()[-1]))
    print(json.dumps(every))
""")
SP_SIZES = {n: (n, 2, 16, 32, 4) for n in (2, 4)}  # n, b, s, d, heads


@pytest.fixture(scope="module")
def fake_runs() -> list[dict]:
    """FAKE, then FAKE_SP at 2 and at 4 ranks, in one process: one start of torch."""
    jobs = [(FAKE, []), *((FAKE_SP, list(map(str, SP_SIZES[n]))) for n in (2, 4))]
    done = subprocess.run(
        [sys.executable, "-c", IN_ONE_PROCESS, json.dumps(jobs)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def fake_measured(fake_runs):
    """FSDP2 and DTensor on rank 0 of a fake 4-rank group: the real wrappers allocate the
    real shards; the collectives move nothing (only the bytes held are used here)."""
    return fake_runs[0]


def rows(plan, measured):
    return [
        {"what": k, "predicted": getattr(plan, k), "measured": measured[k], "margin": 0.0}
        for k in ("params", "grads", "optimizer")
    ]


def test_fsdp_padded_shards_and_2d_mesh_are_exact(fake_measured):
    fsdp = planner.plan(config(20, 2, 18), planner.Layout(dp=4, zero=3), batch=4)
    hybrid = planner.plan(config(36, 2, 18), planner.Layout(dp=2, tp=2, zero=3), batch=4)
    assert (
        checks.check_predictions(
            rows(fsdp, fake_measured["fsdp4"]) + rows(hybrid, fake_measured["dp2tp2"])
        )
        == 0.0
    )


def test_the_unpadded_formula_fails_the_same_check(fake_measured):
    """18 positions on 4 ranks: FSDP2 pads to 20; Ψ/4 is short of what rank 0 holds."""
    cfg = config(20, 2, 18)
    unpadded = memory.zero_bytes_per_rank(planner.count_params(cfg), 4, 3)
    with pytest.raises(CheckFailed):
        checks.check_predictions(
            [
                {
                    "what": k,
                    "predicted": unpadded[k],
                    "measured": fake_measured["fsdp4"][k],
                    "margin": 0.0,
                }
                for k in unpadded
            ]
        )


def test_vocabulary_split_embedding_and_head_are_exact(fake_measured):
    """4 tensor ranks with the embedding and head split by vocabulary: the parameters and
    Adam's state exact with ``vocab_parallel=True``; the default (both whole on every
    rank) fails the same check. The planner splits the gradients as Megatron-LM does;
    torch's DTensor (this version) hands the split token embedding a whole, Replicate()
    gradient, which the measurement shows: the one difference."""
    cfg = config(36, 2, 18)
    measured = fake_measured["tp4vocab"]
    split = planner.plan(cfg, planner.Layout(tp=4, vocab_parallel=True), batch=4)
    state = [r for r in rows(split, measured) if r["what"] != "grads"]
    assert checks.check_predictions(state) == 0.0
    whole_token_grad = 4 * (cfg.vocab - cfg.vocab // 4) * cfg.d_model  # fp32, 3/4 more
    assert measured["grads"] == split.grads + whole_token_grad
    whole = planner.plan(cfg, planner.Layout(tp=4), batch=4)
    with pytest.raises(CheckFailed):
        checks.check_predictions([r for r in rows(whole, measured) if r["what"] != "grads"])


def test_megatron_vocabulary_padding():
    """Megatron-LM pads the vocabulary to a multiple of make-vocab-size-divisible-by (128)
    × tp before splitting it (``vocab_size_with_padding``, cited in planner.padded_vocab):
    GPT-3's 50,257 at tp 8 becomes 51,200, 6,400 rows per rank, where torch's Shard(0) of
    the unpadded vocabulary gives rank 0 ceil(50,257 / 8) = 6,283. (Padding to 128 alone,
    forgetting tp, gives 50,304 and 6,288 rows.)"""
    assert planner.padded_vocab(50257, 8, 128) == 51200
    assert planner.padded_vocab(50257, 8, 0) == 50257  # no padding: the course's default
    d = planner.GPT3.d_model
    padded = planner.tensors(planner.GPT3, tp=8, vocab_parallel=True, pad_vocab=128)
    assert padded["embed"][0] == (6400, d) and padded["head"][-2:] == [(6400, d), (6400,)]
    unpadded = planner.tensors(planner.GPT3, tp=8, vocab_parallel=True)
    assert unpadded["embed"][0] == (6283, d)
    base = dict(tp=8, pp=16, zero=1, dp=8, precision="bf16", vocab_parallel=True)
    first = {
        pad: planner.state_bytes(planner.GPT3, planner.Layout(**base, pad_vocab=pad), 0)
        for pad in (0, 128)
    }
    assert first[128]["params"] - first[0]["params"] == 2 * (6400 - 6283) * d  # bf16 rows


# ------------------------------------------------------------------ activations in flight
def stage_peak(cfg, lay, stage, b, recompute, dtype=torch.float32):
    """The most bytes one pipeline stage holds for backward, its blocks run in 1F1B's
    order (forwards and backwards of every micro-batch, the graphs alive in between).
    ``checkpoint(use_reentrant=True)`` recomputes through the meter's hooks."""
    model = char_model(cfg).to(dtype)
    blocks = [model.layers[i] for i in model.stage_layers(stage, lay.pp)]
    assert all(isinstance(blk, models.Block) for blk in blocks)  # a middle stage
    params = [q for blk in blocks for q in blk.parameters()]
    # the order torch's Schedule1F1B runs this stage's blocks in (timeline.schedule_order)
    order = timeline.schedule_order("1f1b", lay.pp, lay.microbatches, stage)
    with saved_bytes.SavedBytes(exclude=params) as meter:
        outs, before_backward = {}, None
        for kind, i in order:
            if kind == "F":
                x = torch.randn(b, cfg.seq_len, cfg.d_model, dtype=dtype, requires_grad=True)
                for blk in blocks:
                    x = checkpoint(blk, x, use_reentrant=True) if recompute else blk(x)
                outs[i] = x
            else:
                if before_backward is None:
                    before_backward = meter.live
                outs.pop(i).sum().backward()
        del x
    assert meter.live == 0  # every saved tensor was released by its backward
    return before_backward, meter.peak


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("recompute", ["none", "full"])
def test_pipeline_stage_in_flight_with_and_without_recomputation(recompute, precision):
    """Stage 1 of 5 (2 blocks) run in 1F1B's order keeps 4 micro-batches in flight.
    Without recomputation the peak is 4 × what a micro-batch saves; with full
    recomputation 4 × the blocks' inputs plus ONE block's working set (the old formula,
    4 × (inputs + working set), fails)."""
    cfg = config(32, 10, 16)
    b, stage = 2, 1
    lay = planner.Layout(pp=5, microbatches=8, recompute=recompute, precision=precision)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
    before_backward, peak = stage_peak(cfg, lay, stage, b, recompute == "full", dtype)
    assert peak == planner.activation_bytes(cfg, lay, b, stage)
    blocks = planner.stage_blocks(cfg.n_layers, lay.pp, stage)
    if recompute == "full":  # 4 micro-batches × their blocks' inputs
        assert before_backward == 4 * blocks * planner.block_input_bytes(cfg, lay, b)
        assert peak > before_backward  # the recomputed block's working set, during backward
    else:
        assert before_backward == 4 * blocks * planner.block_activation_bytes(cfg, lay, b)


# --------------------------------------------------------- tensor and sequence parallelism
FAKE_SP = textwrap.dedent("""
    import json, sys, warnings
    warnings.simplefilter("ignore")
    import torch, torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module
    from lab_utils import models
    from lab_utils.source import load_script
    script = load_script("labs/lab4_model_parallel/scripts/context_parallel.py")
    n, b, s, d, heads = (int(a) for a in sys.argv[1:])
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=n)
    mesh = init_device_mesh("cpu", (n,))
    out = {}
    for sp in (False, True):  # Lab 4.7's plans: TP alone, then SequenceParallel on the norms
        block = parallelize_module(models.Block(d, heads), mesh, script.tp_plan(sp))
        x = torch.randn(b, s // n if sp else s, d, requires_grad=True)
        with script.block_saved(block) as meter:  # the script's meter: local shards
            block(x)
        out["torch" if sp else "none"] = meter.bytes
    # full recomputation under SequenceParallel: kept after the forward, peak in backward
    from torch.utils.checkpoint import checkpoint
    from lab_utils import saved_bytes
    with saved_bytes.SavedBytes(block.parameters()) as meter:  # a DTensor: its local shard
        y = checkpoint(block, x, use_reentrant=True)
        out["torch_full_kept"] = meter.live
        y.sum().backward()
    out["torch_full_peak"] = meter.peak
    # the collectives of a forward and backward, with and without full recomputation,
    # counted by the script's own counter (an all-gather by its output, as lab_utils.traffic)
    for sp in (False, True):
        block = parallelize_module(models.Block(d, heads), mesh, script.tp_plan(sp))
        for recompute in ("none", "full"):
            x = torch.randn(b, s // n if sp else s, d, requires_grad=True)
            comm = script.CollectiveBytes(n)
            with comm:
                y = checkpoint(block, x, use_reentrant=True) if recompute == "full" else block(x)
                y.sum().backward()
            out[f"comm {'torch' if sp else 'none'} {recompute}"] = {
                "counts": comm.counts, "bytes": comm.bytes, "sent": comm.wire_bytes()
            }
            # what this rank would send to the next pipeline stage: its block output
            out[f"output values {'torch' if sp else 'none'}"] = getattr(y, "_local_tensor", y).numel()
    print(json.dumps(out))
""")


@pytest.fixture(scope="module", params=[2, 4])
def sp_measured(request, fake_runs):
    """Rank 0 of a fake n-rank group runs Lab 4.7's tensor- and sequence-parallel block:
    the real DTensor layouts allocate and save the real shards (values are not moved)."""
    n, b, s, d, heads = SP_SIZES[request.param]
    cfg = planner.Config(vocab=text.VOCAB, d_model=d, n_layers=1, n_heads=heads, seq_len=s)
    return n, b, cfg, fake_runs[1 + (2, 4).index(n)]


def test_tensor_and_torch_sequence_parallel_activations_are_exact(sp_measured):
    n, b, cfg, measured = sp_measured
    for form in ("none", "torch"):
        lay = planner.Layout(tp=n, sequence_parallel=form)
        assert 4 * planner.block_activation_values(cfg, lay, b) == measured[form], form


def test_full_recomputation_under_sequence_parallelism_keeps_the_split_input(sp_measured):
    """A checkpointed block keeps its input, split by the tp ranks under sequence
    parallelism; its backward recomputes what the block saves."""
    n, b, cfg, measured = sp_measured
    lay = planner.Layout(tp=n, sequence_parallel="torch", recompute="full")
    assert measured["torch_full_kept"] == 4 * planner.block_input_values(cfg, lay, b)
    assert measured["torch_full_peak"] == 4 * planner.block_activation_values(cfg, lay, b)


@pytest.mark.parametrize("form", ["none", "torch"])
@pytest.mark.parametrize("recompute", ["none", "full"])
def test_tensor_parallel_wire_bytes_are_counted(sp_measured, form, recompute):
    """One block's forward and backward on Lab 4.7's plans: 4 all-reduces of a whole
    (b, s, d) activation, or 4 all-gathers and 4 reduce-scatters of one under sequence
    parallelism; full recomputation (reentrant checkpoint) runs the forward's again: 6.
    The planner's sizes equal the counted ones, and the bytes a rank sends on rings equal
    the script's own 2(n−1)/n, (n−1)/n count. (The old planner gave each of the
    all-gathers and reduce-scatters half of this, and ignored recomputation.)"""
    n, b, cfg, measured = sp_measured
    comm = measured[f"comm {form} {recompute}"]
    lay = planner.Layout(tp=n, sequence_parallel=form, recompute=recompute)
    passes = 6 if recompute == "full" else 4
    kinds = ("all_reduce",) if form == "none" else ("all_gather", "reduce_scatter")
    assert {k: comm["counts"][k] for k in kinds} == dict.fromkeys(kinds, passes)
    wire = planner.wire_bytes(cfg, lay, b)
    assert wire == {f"{k}_tp": comm["bytes"][k] for k in kinds}
    assert sum(planner.sent_bytes(cfg, lay, b).values()) == pytest.approx(comm["sent"], rel=1e-12)


def test_pipeline_sends_the_rank_s_share_of_the_residual_stream(sp_measured):
    """Between pipeline stages a rank sends its block output: whole without sequence
    parallelism, its 1/tp share of the sequence with it (the old planner sent the whole
    tensor in both cases). A middle stage also sends a gradient back."""
    n, b, cfg, measured = sp_measured
    for form in ("none", "torch"):
        lay = planner.Layout(tp=n, pp=3, microbatches=5, sequence_parallel=form)
        out = 4 * measured[f"output values {form}"]  # fp32
        assert planner.wire_bytes(cfg, lay, b, stage=0)["send_recv"] == 5 * out
        assert planner.wire_bytes(cfg, lay, b, stage=1)["send_recv"] == 2 * 5 * out


def test_megatron_sequence_parallel_regathers_in_backward():
    """Korthikanti et al. 2022, §4.2.2: Megatron keeps the LayerNorm outputs split and
    all-gathers them again in backward, 2 more per block than torch's form (the paper's
    rule; no run of the course does it)."""
    cfg = config(32, 1, 16)
    for recompute in ("none", "full"):
        lays = {
            f: planner.Layout(tp=2, sequence_parallel=f, recompute=recompute)
            for f in ("torch", "megatron")
        }
        torch_wire, megatron = (planner.wire_bytes(cfg, lays[f], 2) for f in lays)
        bsh = 2 * 16 * 32 * 4
        assert megatron["all_gather_tp"] - torch_wire["all_gather_tp"] == 2 * bsh
        assert megatron["reduce_scatter_tp"] == torch_wire["reduce_scatter_tp"]


def test_megatron_sequence_parallel_is_not_what_torch_keeps(sp_measured):
    """torch keeps the all-gathered inputs of q/k/v and fc1 whole on every rank; Megatron
    (Korthikanti et al. 2022, §4.2.2) keeps them split, so it plans less than torch saves."""
    n, b, cfg, measured = sp_measured
    megatron = 4 * planner.block_activation_values(
        cfg, planner.Layout(tp=n, sequence_parallel="megatron"), b
    )
    assert megatron < measured["torch"]
    whole_norm_outputs = 4 * 2 * b * cfg.seq_len * cfg.d_model  # 2·bsh, fp32
    assert measured["torch"] - megatron == whole_norm_outputs * (1 - 1 / n)


def test_the_widget_renders_headless():
    panel, update = planner.widget(config(), batch=4)
    assert "per rank: parameters" in update()
    panel.children[0].children[0].value = 3  # dp = 3 does not split a batch of 4
    assert "not a valid layout" in update()


def test_gpt3_recomputation_counts_one_working_set():
    """GPT-3 175B, dp 8 × tp 8 × pp 16, ZeRO-1, bf16, 64 micro-batches of 3 sequences:
    the first stage keeps 16 in flight of 6 blocks' inputs (bsh each), and one block's
    working set once. The old count (16 working sets) planned 39.1 GB and 30.6 GB."""
    base = dict(dp=8, tp=8, pp=16, zero=1, precision="bf16", recompute="full", microbatches=64)
    bs = 3 * 2048
    bsh = bs * 12288
    # working set: a block's saved values less its input; the 96 heads' log-sum-exp split by 8
    for sp, kept, work in (
        ("none", bsh, 4.5 * bsh + 16 * bs),  # norms 4bsh + 4bs, the rest (12bsh + 96bs)/8
        ("megatron", bsh / 8, (15 * bsh + 100 * bs) / 8),  # all of it split by 8
    ):
        lay = planner.Layout(**base, sequence_parallel=sp)
        ids = 16 * (8 * 3 * 2048 + 8 * 2048)  # int64 ids and positions, per micro-batch
        lse = 2 * 96 * bs / 8  # the log-sum-exp is fp32: 2 bytes more per value than bf16
        want = 2 * (16 * 6 * kept + work) + ids + lse
        assert planner.activation_bytes(planner.GPT3, lay, 3, stage=0) == pytest.approx(want)
    full = planner.plan(planner.GPT3, planner.Layout(**base), batch=1536)
    sp = planner.plan(planner.GPT3, planner.Layout(**base, sequence_parallel="megatron"), 1536)
    assert 25e9 < full.total < 27e9 and 12e9 < sp.total < 14e9


def test_gpt3_layout_fits_and_training_time():
    lay = planner.Layout(
        dp=8, tp=8, pp=16, zero=1, precision="bf16", recompute="full", microbatches=64
    )
    p = planner.plan(planner.GPT3, lay, batch=1536)
    assert 174e9 < p.n_params < 176e9 and p.total < 80e9
    assert planner.training_days(175e9, 300e9, 1024, 1e15, 0.5) == pytest.approx(
        6 * 175e9 * 300e9 / (1024 * 1e15 * 0.5) / 86400
    )
    # full recomputation runs the forward (2·N·D) again: 8·N·D at the same utilisation
    full = planner.training_days(175e9, 300e9, 1024, 1e15, 0.5, recompute="full")
    assert full == pytest.approx(planner.training_days(175e9, 300e9, 1024, 1e15, 0.5) * 8 / 6)
    with pytest.raises(ValueError):
        planner.plan(planner.GPT3, planner.Layout(tp=5), batch=8)


# ----------------------------------------------------------------- exercise (notebook 10)
def test_stage_activation_reference_passes_and_is_the_planners_term():
    assert checks.check_stage_activation_bytes(reference.stage_activation_bytes) == 0.0
    middle = [c for c in checks._activation_cases() if 0 < c[4] < c[2].pp - 1]
    assert middle  # a stage with neither the embedding nor the head: only blocks
    for _, cfg, lay, b, stage in middle:
        assert reference.stage_activation_bytes(cfg, lay, b, stage) == planner.activation_bytes(
            cfg, lay, b, stage, loss=False
        )


def _wrong(in_flight=None, recompute=True, per_mb_working=False, with_input=False, act=False):
    def fn(cfg, lay, b, stage):
        blocks = planner.stage_blocks(cfg.n_layers, lay.pp, stage)
        per_block = planner.block_activation_bytes(cfg, lay, b)
        kept = planner.block_input_bytes(cfg, lay, b)
        if act:  # the old given: values times the activation's bytes, the fp32 lse at 2 bytes
            nbytes = planner.PRECISIONS[lay.precision][0]
            per_block = nbytes * planner.block_activation_values(cfg, lay, b)
        k = (in_flight or (lambda lay, s: min(lay.pp - s, lay.microbatches)))(lay, stage)
        if lay.recompute != "full" or not recompute:
            return k * blocks * per_block
        working = per_block if with_input else per_block - kept
        if per_mb_working:
            return k * (blocks * kept + working)
        return k * blocks * kept + working

    return fn


@pytest.mark.parametrize(
    "fn, hint",
    [
        (_wrong(per_mb_working=True), "once, not per micro-batch"),
        (_wrong(with_input=True), "already kept"),
        (_wrong(recompute=False), "keeps only its input"),
        (_wrong(in_flight=lambda lay, s: lay.microbatches), "GPipe"),
        (_wrong(in_flight=lambda lay, s: lay.pp - s), "fewer micro-batches"),
        (_wrong(in_flight=lambda lay, s: min(lay.pp, lay.microbatches)), "pp − stage"),
        (_wrong(act=True), "GPT-3.*expected"),
    ],
    ids=[
        "working set per micro-batch",
        "working set with its input",
        "recomputation ignored",
        "every micro-batch in flight",
        "no min with the micro-batches",
        "pp in flight on every stage",
        "bf16 log-sum-exp",
    ],
)
def test_stage_activation_check_names_the_mistake(fn, hint):
    with pytest.raises(CheckFailed, match=hint):
        checks.check_stage_activation_bytes(fn)


def test_zero1_wire_names_whose_zero1():
    """ZeroRedundancyOptimizer (the default, what Lab 4.4 measures exactly in notebook 10):
    all-reduce + broadcast, 3Ψ on a ring; the ZeRO paper's stage 1 in its reduce-scatter +
    all-gather form, 2Ψ (the volume the paper works out for stage 2 in §7.2.1), the same
    collectives and bytes as its stage 2."""
    cfg = config(32, 2, 16)
    psi = planner.count_params(cfg)
    torch_zero1 = planner.wire_bytes(cfg, planner.Layout(dp=4, zero=1), 2)
    paper = planner.wire_bytes(cfg, planner.Layout(dp=4, zero=1, zero1_comm="paper"), 2)
    assert torch_zero1 == {"all_reduce": 4 * psi, "broadcast": 4 * psi}
    assert paper == {"reduce_scatter": 4 * psi, "all_gather": 4 * psi}
    assert paper == planner.wire_bytes(cfg, planner.Layout(dp=4, zero=2), 2)
    with pytest.raises(ValueError):
        planner.plan(cfg, planner.Layout(dp=4, zero=1, zero1_comm="zero"), batch=4)
