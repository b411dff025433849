"""Plan it before you run it: bytes per rank and bytes on the wire of a transformer layout.

    cfg = Config(vocab=96, d_model=64, n_layers=4, n_heads=4, seq_len=32)
    lay = Layout(dp=2, zero=3)
    p = plan(cfg, lay, batch=16)      # p.params, p.grads, p.optimizer, p.activations, p.wire

The model is a decoder-only transformer laid out like ``char_transformer``: learned token
and position embeddings, pre-norm blocks (q, k, v, proj; fc1 → GELU → fc2 of width
``mlp_ratio · d``, or a mixture of experts), a final LayerNorm and an output projection.
A layout splits it five ways — data (``dp``), tensor (``tp``: Megatron's column-parallel
q, k, v and fc1 — the output features split, i.e. the rows of ``nn.Linear``'s
``(out, in)`` weight — and row-parallel proj and fc2, the input features split; the norms
whole, and the token embedding and the output head whole on every tensor rank as this
course's ``tp_plan`` leaves them, or with ``vocab_parallel=True`` split by vocabulary into
``ceil(vocab / tp)`` rows, as torch's ``Shard(0)`` cuts them; ``pad_vocab=128`` first pads
the vocabulary as Megatron-LM does, :func:`padded_vocab`), pipeline (``pp``, blocks cut
evenly, the embedding on the first stage, the head on the last), context (``cp``, the
sequence, attended by the course's ring attention, :func:`ring_attention_saved`)
and experts (``ep``) — with a ZeRO stage over the data ranks, a precision, a
recomputation policy and a form of sequence parallelism (:data:`SEQUENCE_PARALLEL`).
The state bytes come from :func:`lab_utils.memory.zero_bytes_per_rank` (the ZeRO
paper's formulas) applied to the parameters this rank holds; ZeRO-3 (FSDP2)
shards every tensor along its first dimension and pads it to a multiple of ``dp``, which
the plan counts exactly. Activation bytes count what autograd saves in this block
implementation, each storage once as :class:`lab_utils.saved_bytes.SavedBytes` counts
(see :func:`block_activation_values` and :func:`activation_bytes`). Wire bytes
(:func:`wire_bytes`) are the sizes of the tensors the collectives carry, as
:mod:`lab_utils.traffic` counts them; :func:`sent_bytes` turns them into the bytes each
rank sends with ring algorithms.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from lab_utils import memory

# bytes of a parameter, a gradient and the optimizer state per parameter (Adam)
# "bf16" is a bf16 model — parameters, gradients and activations in bf16 — whose optimizer
# keeps fp32 master weights and Adam's two moments (the ZeRO paper's mixed precision, K = 12).
# It is not autocast, which keeps fp32 weights and saves other tensors (notebook 10 measures it).
PRECISIONS = {
    "fp32": (4, 4, 8),
    "bf16": (2, 2, 12),
}
RECOMPUTE = ("none", "full")
# "torch": torch.distributed.tensor.parallel.SequenceParallel on the LayerNorms, which the
# course runs (Lab 4.7); "megatron": Korthikanti et al. 2022, §4.2.2 (block_activation_values).
SEQUENCE_PARALLEL = ("none", "torch", "megatron")
# ZeRO-1's gradient and parameter traffic: "torch" is ZeroRedundancyOptimizer (all-reduce the
# gradients, then each rank broadcasts the parameters it updated: 3Ψ on a ring); "paper" is
# stage 1 in the reduce-scatter + all-gather form of Rajbhandari et al. 2020 (2Ψ, as DDP's
# all-reduce; the paper works this volume out for P_os+g, stage 2, in §7.2.1).
ZERO1_COMM = ("torch", "paper")
# Context parallelism's split of the sequence, as lab_utils.ring_attention names them:
# one contiguous chunk per rank, or the load-balanced zig-zag pair of chunks.
CP_LAYOUTS = ("contiguous", "zigzag")


@dataclass(frozen=True)
class Config:
    """A decoder-only transformer."""

    vocab: int
    d_model: int
    n_layers: int
    n_heads: int
    seq_len: int
    max_len: int | None = None  # rows of the position embedding (None: seq_len; 0: none)
    mlp_ratio: int = 4
    n_experts: int = 0  # 0: a dense MLP in every block
    top_k: int = 2
    capacity_factor: float = 1.25


@dataclass(frozen=True)
class Layout:
    """How the training job is split, and what it keeps."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1  # experts split over this many of the data ranks
    zero: int = 0  # 0 = DDP, 1, 2, 3 = FSDP
    precision: str = "fp32"
    recompute: str = "none"
    sequence_parallel: str | bool = "none"  # SEQUENCE_PARALLEL; True = "torch", False = "none"
    microbatches: int = 1  # per step (pipeline micro-batches or gradient accumulation)
    vocab_parallel: bool = False  # token embedding and output head split by vocabulary over tp
    zero1_comm: str = "torch"  # ZERO1_COMM: whose ZeRO-1 the wire bytes count
    cp_layout: str = "contiguous"  # CP_LAYOUTS: how the sequence is cut over the cp ranks
    # pad the vocabulary to a multiple of pad_vocab × tp as Megatron-LM does (its
    # --make-vocab-size-divisible-by, 128 by default there); 0: no padding (padded_vocab)
    pad_vocab: int = 0

    @property
    def sp(self) -> str:
        """The sequence-parallel form by name (``"none"``, ``"torch"``, ``"megatron"``)."""
        if self.sequence_parallel is True:
            return "torch"
        return "none" if self.sequence_parallel is False else str(self.sequence_parallel)

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp


@dataclass
class Plan:
    """Per-rank bytes (the most loaded rank) and per-step wire bytes by collective: ``wire``
    the sizes of the tensors the collectives carry (:func:`wire_bytes`), ``sent`` the bytes
    this rank sends for them on rings (:func:`sent_bytes`)."""

    params: float
    grads: float
    optimizer: float
    activations: float
    wire: dict[str, float] = field(default_factory=dict)
    n_params: int = 0
    sent: dict[str, float] = field(default_factory=dict)

    @property
    def state(self) -> float:
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> float:
        return self.state + self.activations


# ------------------------------------------------------------------------- parameters
def padded_vocab(vocab: int, tp: int, pad_vocab: int) -> int:
    """Rows of the token embedding and the output head: ``vocab``, or with ``pad_vocab``
    the next multiple of ``pad_vocab × tp``, as Megatron-LM pads it so that every tensor
    rank holds the same number of rows, a multiple of ``pad_vocab`` ("Pad vocab size so it
    is divisible by model parallel size and still having GPU friendly size":
    ``vocab_size_with_padding``, megatron/core/tokenizers/utils/build_tokenizer.py:133 at
    NVIDIA/Megatron-LM commit d98e8a6, formerly ``_vocab_size_with_padding``,
    megatron/training/tokenizer/tokenizer.py:65 at commit def3b9c;
    ``--make-vocab-size-divisible-by`` defaults to 128, megatron/training/arguments.py:2441
    at d98e8a6). GPT-3's 50,257 at tp 8: 51,200, 6,400 rows per rank."""
    if not pad_vocab:
        return vocab
    multiple = pad_vocab * tp
    return math.ceil(vocab / multiple) * multiple


def tensors(
    cfg: Config, tp: int = 1, ep: int = 1, vocab_parallel: bool = False, pad_vocab: int = 0
) -> dict[str, list[tuple[int, ...]]]:
    """Shapes of the tensors one rank of a ``tp``-way tensor and ``ep``-way expert split
    holds, by part: ``embed``, ``block`` (one block), ``head``. The token embedding and
    the output head are whole on every tensor rank, or with ``vocab_parallel`` cut by
    vocabulary into ``tp`` pieces (rank 0's, the largest, ``ceil(vocab / tp)`` rows: how
    ``Shard(0)`` cuts them); with ``pad_vocab`` the vocabulary is padded first
    (:func:`padded_vocab`); the position embedding stays whole."""
    d, h = cfg.d_model, cfg.mlp_ratio * cfg.d_model
    vocab = padded_vocab(cfg.vocab, tp, pad_vocab)
    v = math.ceil(vocab / tp) if vocab_parallel else vocab
    for what, n in (("d_model", d), ("n_heads", cfg.n_heads), ("mlp width", h)):
        if n % tp:
            raise ValueError(f"tp={tp} does not divide {what} = {n}")
    embed = [(v, d)] + (
        [(cfg.max_len if cfg.max_len is not None else cfg.seq_len, d)] if cfg.max_len != 0 else []
    )
    norm = [(d,), (d,)]
    # q, k, v column-parallel (rows of the (out, in) weight); proj row-parallel (its columns)
    attn = [(d // tp, d), (d // tp,)] * 3 + [(d, d // tp), (d,)]
    mlp = [(h // tp, d), (h // tp,), (d, h // tp), (d,)]
    if cfg.n_experts:
        if cfg.n_experts % ep:
            raise ValueError(f"ep={ep} does not divide {cfg.n_experts} experts")
        mlp = [(cfg.n_experts, d)] + mlp * (cfg.n_experts // ep)  # router + this rank's experts
    return {
        "embed": embed,
        "block": norm + attn + norm + mlp,
        "head": norm + [(v, d), (v,)],
    }


def count_params(cfg: Config) -> int:
    """Ψ, the parameters of the whole model."""
    t = tensors(cfg)
    return sum(math.prod(s) for s in t["embed"] + t["head"]) + cfg.n_layers * sum(
        math.prod(s) for s in t["block"]
    )


def stage_blocks(n_layers: int, pp: int, stage: int) -> int:
    """Blocks on pipeline stage ``stage``: as even as possible (``char_transformer.stage_layers``)."""
    bounds = [round(i * n_layers / pp) for i in range(pp + 1)]
    return bounds[stage + 1] - bounds[stage]


def stage_tensors(cfg: Config, lay: Layout, stage: int) -> list[tuple[int, ...]]:
    """The tensor shapes one rank of pipeline stage ``stage`` holds before ZeRO/FSDP."""
    t = tensors(cfg, lay.tp, lay.ep, lay.vocab_parallel, lay.pad_vocab)
    out = t["block"] * stage_blocks(cfg.n_layers, lay.pp, stage)
    if stage == 0:
        out = t["embed"] + out
    if stage == lay.pp - 1:
        out = out + t["head"]
    return out


def expert_values(cfg: Config, lay: Layout, stage: int) -> int:
    """Values of the experts one rank of ``stage`` holds (0 for a dense model)."""
    if not cfg.n_experts:
        return 0
    d, h = cfg.d_model, cfg.mlp_ratio * cfg.d_model
    one = (2 * h * d + h + d) // lay.tp + (d - d // lay.tp)  # fc1, fc2 split; fc2's bias whole
    return stage_blocks(cfg.n_layers, lay.pp, stage) * (cfg.n_experts // lay.ep) * one


def fsdp_shard(shape: tuple[int, ...], n: int) -> int:
    """Values rank 0 holds of a tensor that FSDP2 cuts along dim 0 into n padded pieces."""
    return math.ceil(shape[0] / n) * math.prod(shape[1:])


def state_bytes(cfg: Config, lay: Layout, stage: int) -> dict[str, float]:
    """Parameters, gradients and optimizer state of one rank of ``stage``: the ZeRO
    formulas (:func:`lab_utils.memory.zero_bytes_per_rank`) on the values this rank holds,
    ZeRO-3's shards padded as FSDP2 pads them."""
    shapes = stage_tensors(cfg, lay, stage)
    pb, gb, k = PRECISIONS[lay.precision]
    psi = sum(math.prod(s) for s in shapes)
    if lay.zero == 3:  # exact shards: Σ ceil(dim0 / dp) · rest, i.e. the padded Ψ over dp
        psi = lay.dp * sum(fsdp_shard(s, lay.dp) for s in shapes)
    return memory.zero_bytes_per_rank(psi, lay.dp, lay.zero, k, param_bytes=pb, grad_bytes=gb)


# ------------------------------------------------------------------------ activations
def block_activation_values(cfg: Config, lay: Layout, b: int) -> float:
    """Values autograd saves for one block of this implementation for ``b`` sequences of
    one micro-batch, each storage once (as :class:`lab_utils.saved_bytes.SavedBytes`
    counts them):

    - the two LayerNorms' inputs (2·bsh) and statistics (4·bs), and their outputs (2·bsh),
      which q, k, v and fc1 save as their input;
    - q, k, v and the attention output (4·bsh) — the projection's input is a view of the
      attention output (the fused kernel returns it in (b, s, heads, head) order), so it
      adds nothing — the attention's log-sum-exp (a·bs), and the MLP's input to GELU and
      to fc2 (2·r·bsh).

    The fused attention keeps no s × s scores and the block has no dropout, so this is
    this implementation's count, not Korthikanti et al.'s sbh·(34 + 5as/h) bytes per layer
    (Table 2, which keeps the softmax, its dropout mask and output, and two more dropout
    masks). Tensor parallelism splits the second list by ``tp``. Sequence parallelism,
    by name:

    - ``"torch"`` — what the course runs (Lab 4.7): ``SequenceParallel`` on the
      LayerNorms splits their inputs and statistics by ``tp`` (torch 2.13,
      torch/distributed/tensor/parallel/style.py:339, its input and output ``Shard(1)``);
      the attention and the MLP all-gather their input (``PrepareModuleInput`` to
      ``Replicate()``, style.py:522, a ``redistribute`` autograd records), and q, k, v
      and fc1 save that gathered input, whole on every rank. Measured exactly at 2 and 4
      ranks (``tests/test_planner.py``).
    - ``"megatron"`` — Korthikanti et al. 2022, "Reducing Activation Recomputation in
      Large Transformer Models", §4.2.2: the all-gathered LayerNorm output is not kept
      but gathered again in backward, so everything is split by ``tp`` (their
      sbh·(34/t + 5as/(ht)) per layer, in this block's terms). No run of this course
      does this; the term is the paper's rule applied to this block, not a measurement.

    Context parallelism splits the sequence (``s = seq_len / cp``) and attends with the
    course's ring attention (Lab 4.7) in place of the fused kernel: the block's other
    tensors are its own chunk's, the attention core saves what
    :func:`ring_attention_saved` counts on the busiest rank (the K/V blocks it received,
    the scores of every block it attends to), and the projection's input is a copy of the
    ring's output. Measured exactly on Lab 4.7's ring at 2 and 4 ranks, both layouts
    (``tests/test_planner_cp.py``)."""
    s = cfg.seq_len // lay.cp
    bsh, bs = b * s * cfg.d_model, b * s
    t = lay.tp
    norm_in = 2 * bsh + 4 * bs  # LayerNorm inputs and their mean and 1/std
    norm_out = 2 * bsh  # the inputs of q, k, v and of fc1
    split = (4 + 2 * cfg.mlp_ratio) * bsh + cfg.n_heads * bs
    if lay.cp > 1:  # the ring's core, and the projection's input (a copy of its output)
        split = (1 + 2 * cfg.mlp_ratio) * bsh + ring_attention_saved(cfg, lay, b)[0]
    sp = lay.sp
    if sp == "torch":
        return norm_in / t + norm_out + split / t
    if sp == "megatron":
        return (norm_in + norm_out + split) / t
    return norm_in + norm_out + split / t


def ring_attention_saved(cfg: Config, lay: Layout, b: int) -> tuple[float, int]:
    """What the course's ring attention (:mod:`lab_utils.ring_attention`: the contiguous
    ``ring_attention`` of Lab 4.7's exercise or ``zigzag_ring_attention``, by
    ``lay.cp_layout``) saves for backward in one block on the busiest of the ``cp``
    ranks, the last: ``(values, bytes of its boolean causal masks)``, before the tensor
    split (the heads divide every value by ``tp``, not the masks).

    Each ``_Online.add`` of a query block against a key block saves a contiguous copy of
    the query block, the key block's Kᵀ and V (a copy of this rank's own, a view of a
    received (K, V) message, which is saved whole), the masked scores and their
    ``exp`` weights, the running sum it rescales and four per-row vectors (row maximum,
    new maximum, rescale, denominator); the last division keeps the output and the
    denominator. Per (b, heads, chunk) tensor x, chunk × chunk scores S, per-row vector r:

    - contiguous, rank cp − 1 attends to every rank's block: cp·(4x + 2S + 4r) + x + r,
      and one chunk × chunk mask (the diagonal block);
    - zig-zag (half-chunk pieces): 3 adds of quarter score blocks on its own block,
      2 per earlier rank's message, 1 of whole width per later rank's (which saves less:
      see ``zigzag_ring_attention``); the last rank has only earlier ones:
      (12 + 8(cp − 1))·(x + r)/2 + (6 + 4(cp − 1))·S/4 + x + r, and two half-chunk
      masks.

    The ring keeps every score block it computed (plain autograd, no fused kernel). A
    flash-style ring is not this ring: ring-flash-attention's ``RingFlashAttnFunc`` keeps
    only its own q, k, v, output and log-sum-exp (``ctx.save_for_backward``,
    ring_flash_attn/ring_flash_attn.py:192 at zhuzilin/ring-flash-attention commit
    8996282), passes K and V around again in backward (:99) and the gradients of K and V
    with them (:150)."""
    if lay.cp_layout not in CP_LAYOUTS:
        raise ValueError(f"cp_layout is one of {CP_LAYOUTS}, not {lay.cp_layout!r}")
    n, t = lay.cp, cfg.seq_len // lay.cp
    x = b * t * cfg.d_model  # one (b, heads, t, head_dim) tensor
    scores, rows = b * cfg.n_heads * t * t, b * cfg.n_heads * t
    if lay.cp_layout == "contiguous":
        return n * (4 * x + 2 * scores + 4 * rows) + x + rows, t * t
    # halves: x/2, rows/2 and quarter score blocks scores/4. The last rank's own block:
    # 3 adds of (4 half tensors, 2 quarter blocks, 4 half vectors); each earlier rank's
    # message (all cp − 1 are earlier): its (K, V), 2 adds of (q copy, running sum,
    # 2 quarter blocks, 4 half vectors); then two half outputs and denominators.
    earlier = n - 1
    halves = (12 + 8 * earlier) * (x + rows) / 2 + (6 + 4 * earlier) * scores / 4
    return halves + x + rows, 2 * (t // 2) ** 2


def block_activation_bytes(cfg: Config, lay: Layout, b: int) -> float:
    """Bytes one block saves for ``b`` sequences: :func:`block_activation_values` in the
    activation dtype (``PRECISIONS[lay.precision][0]`` bytes), except the fused
    attention's log-sum-exp, which is fp32 whatever the dtype (measured on a bf16 block
    in ``tests/test_planner.py``), and, under context parallelism, the ring's boolean
    masks (one byte a value). The LayerNorm statistics are in the activation dtype
    as torch's CPU kernel keeps them (measured); its CUDA kernel writes them as the
    accumulate type, fp32 for bf16 (``RowwiseMomentsCUDAKernel``'s ``T_ACC* mean, rstd``,
    aten/src/ATen/native/cuda/layer_norm_kernel.cu), 8·bs bytes more per bf16 block."""
    act = PRECISIONS[lay.precision][0]
    if lay.cp > 1:  # the ring has no log-sum-exp
        return act * block_activation_values(cfg, lay, b) + ring_attention_saved(cfg, lay, b)[1]
    lse = cfg.n_heads * b * cfg.seq_len / lay.tp
    return act * (block_activation_values(cfg, lay, b) - lse) + 4 * lse


def block_input_values(cfg: Config, lay: Layout, b: int) -> float:
    """Values of one block's input for ``b`` sequences: what full recomputation keeps per
    block (split by ``tp`` under either form of sequence parallelism: the residual stream
    between blocks is sharded by sequence)."""
    values = b * (cfg.seq_len // lay.cp) * cfg.d_model
    return values / lay.tp if lay.sp != "none" else values


def block_input_bytes(cfg: Config, lay: Layout, b: int) -> float:
    """Bytes of one block's input (:func:`block_input_values` in the activation dtype)."""
    return PRECISIONS[lay.precision][0] * block_input_values(cfg, lay, b)


def activation_bytes(cfg: Config, lay: Layout, b: int, stage: int = 0, loss: bool = True) -> float:
    """Bytes saved for backward at their peak on one rank of ``stage`` with micro-batches
    of ``b`` sequences: what one micro-batch saves, times the micro-batches in flight
    (1F1B keeps ``min(pp − stage, microbatches)``).

    With full recomputation (``torch.utils.checkpoint`` on every block) a micro-batch
    keeps only each block's input; in backward one block at a time is run again, and its
    saved tensors exist only until its backward is done. So the peak adds ONE block's
    working set — what it saves, less its input, which is the kept one — once, not per
    micro-batch in flight (measured in ``tests/test_planner.py`` with
    :attr:`lab_utils.saved_bytes.SavedBytes.peak`)."""
    act = PRECISIONS[lay.precision][0]
    s = cfg.seq_len // lay.cp
    blocks = stage_blocks(cfg.n_layers, lay.pp, stage)
    per_block = block_activation_bytes(cfg, lay, b)
    once = 0.0
    if lay.recompute == "full":
        kept = block_input_bytes(cfg, lay, b)
        nbytes = blocks * kept
        once = per_block - kept if blocks else 0.0
    else:
        nbytes = blocks * per_block
    extra = 0.0
    if stage == 0:
        extra += 8 * b * s + 8 * s  # the int64 ids and positions the embedding saves
    if stage == lay.pp - 1:  # final LayerNorm (in, out, stats)
        nbytes += act * (2 * b * s * cfg.d_model + 2 * b * s)
        if loss:  # cross-entropy on fp32 logits (bf16's cast up): log-probabilities, targets
            vocab = padded_vocab(cfg.vocab, lay.tp, lay.pad_vocab)
            v = math.ceil(vocab / lay.tp) if lay.vocab_parallel else vocab
            extra += 4 * b * s * v + 8 * b * s + 4
    in_flight = min(lay.pp - stage, lay.microbatches)
    return in_flight * (nbytes + extra) + once


# ------------------------------------------------------------------------------ wire
def wire_bytes(cfg: Config, lay: Layout, b: int, stage: int = 0) -> dict[str, float]:
    """Bytes of the tensors each collective carries in one step on one rank of ``stage``:
    the full tensor, as :mod:`lab_utils.traffic` counts it (an all-reduce's input, an
    all-gather's output, a reduce-scatter's input); point-to-point, what this rank sends.
    :func:`sent_bytes` turns these into bytes each rank sends on a ring.

    Data-parallel sync by ZeRO stage: 0 (DDP) all-reduces the gradients; 1 as
    ``lay.zero1_comm`` names it — ``"torch"``, PyTorch's ``ZeroRedundancyOptimizer``
    (what Lab 4.4 runs): the same all-reduce, then a broadcast of each rank's updated
    parameters; ``"paper"``, ZeRO stage 1 in Rajbhandari et al. 2020's reduce-scatter +
    all-gather form (the paper works out its volume for P_os+g in §7.2.1: 2Ψ on a ring,
    as DDP); 2 the same reduce-scatter + all-gather; 3 (FSDP2) all-gathers the parameters
    in forward and again in backward and reduce-scatters the gradients.

    Tensor parallelism, per block and micro-batch, each of a whole (b, s, d) activation:
    4 all-reduces (2 in forward, their gradients' 2 in backward), or with sequence
    parallelism 4 all-gathers and 4 reduce-scatters (each all-reduce's two halves);
    full recomputation runs the forward's collectives again in backward: 6 and 6 + 6
    (counted on Lab 4.7's block with ``checkpoint(use_reentrant=True)`` in
    ``tests/test_planner.py``). Megatron's form (``"megatron"``) gathers each LayerNorm
    output again in backward (Korthikanti et al. 2022, §4.2.2): 2 all-gathers more, the
    paper's rule, not a measurement.

    Pipeline: this rank sends its activation to the next stage and its input's gradient
    to the previous one, each a (b, s, d) tensor per micro-batch, split by ``tp`` under
    sequence parallelism (the residual stream is sharded by sequence). Context
    parallelism, per block and micro-batch, the course's ring
    (:func:`lab_utils.ring_attention.ring_pass`): cp − 1 messages of this rank's (K, V)
    chunk in forward, cp − 1 of their gradient (the same size, the activation dtype) in
    backward — the ring keeps the blocks it received, so it does not pass K and V again —
    and with full recomputation the forward's cp − 1 again (counted on Lab 4.7's ring in
    ``tests/test_planner_cp.py``). Experts: 4 all-to-alls per layer (6 with full
    recomputation)."""
    pb, gb, _ = PRECISIONS[lay.precision]
    act = pb
    shapes = stage_tensors(cfg, lay, stage)
    psi = sum(math.prod(s) for s in shapes)
    out: dict[str, float] = {}
    if lay.dp > 1:
        if lay.zero == 3:
            padded = lay.dp * sum(fsdp_shard(s, lay.dp) for s in shapes)
            out["all_gather"] = 2 * padded * pb  # forward and backward
            out["reduce_scatter"] = padded * gb
        elif lay.zero == 2 or (lay.zero == 1 and lay.zero1_comm == "paper"):
            out["reduce_scatter"] = psi * gb
            out["all_gather"] = psi * pb
        else:  # an expert's gradient is summed only over the data ranks that share it
            experts = expert_values(cfg, lay, stage) if lay.dp // lay.ep == 1 else 0
            out["all_reduce"] = (psi - experts) * gb
            if lay.zero == 1:
                out["broadcast"] = psi * pb
    s = cfg.seq_len // lay.cp
    m = lay.microbatches
    blocks = stage_blocks(cfg.n_layers, lay.pp, stage)
    full = lay.recompute == "full"
    bsh = b * s * cfg.d_model * act  # one (b, s, d) activation, whole
    if lay.tp > 1:
        passes = 6 if full else 4
        if lay.sp == "none":
            out["all_reduce_tp"] = passes * blocks * m * bsh
        else:
            regather = 2 if lay.sp == "megatron" else 0
            out["all_gather_tp"] = (passes + regather) * blocks * m * bsh
            out["reduce_scatter_tp"] = passes * blocks * m * bsh
    if lay.pp > 1:
        neighbours = (stage < lay.pp - 1) + (stage > 0)  # activations on, gradients back
        out["send_recv"] = neighbours * m * bsh / (lay.tp if lay.sp != "none" else 1)
    if lay.cp > 1:
        kv = 2 * b * s * cfg.d_model / lay.tp * act  # one message: this rank's K and V
        messages = (lay.cp - 1) * (3 if full else 2)  # forward, backward, recomputed forward
        out["send_recv_cp"] = blocks * m * messages * kv
    if cfg.n_experts and lay.ep > 1:
        tokens = b * s
        slots = math.ceil(cfg.capacity_factor * tokens * cfg.top_k / cfg.n_experts)
        a2a = 6 if full else 4
        out["all_to_all"] = a2a * blocks * m * cfg.n_experts * slots * cfg.d_model * act
    return out


# bytes a rank sends per byte of the collective's full tensor, on a ring of n ranks
RING_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "broadcast": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,  # a rank keeps its own share
    "send_recv": lambda n: 1.0,  # already what this rank sends
}


def sent_bytes(cfg: Config, lay: Layout, b: int, stage: int = 0) -> dict[str, float]:
    """Bytes this rank sends in one step for each entry of :func:`wire_bytes`, with ring
    algorithms: 2(n−1)/n of an all-reduce's size, (n−1)/n of an all-gather's,
    reduce-scatter's, broadcast's or all-to-all's (:mod:`lab_utils.traffic`, Lab 6.6),
    n the group it runs in — the tensor ranks for ``*_tp``, the expert ranks for
    ``all_to_all``, the data ranks otherwise; point-to-point sends as they are."""
    out = {}
    for kind, size in wire_bytes(cfg, lay, b, stage).items():
        base = kind.removesuffix("_tp").removesuffix("_cp")
        n = lay.tp if kind.endswith("_tp") else lay.ep if kind == "all_to_all" else lay.dp
        out[kind] = RING_FACTOR[base](n) * size
    return out


def plan(cfg: Config, lay: Layout, batch: int) -> Plan:
    """The most loaded rank's bytes for a step of ``batch`` sequences in all (split over
    the data ranks and the micro-batches), and that rank's wire and sent bytes per step."""
    if (
        lay.zero not in (0, 1, 2, 3)
        or lay.precision not in PRECISIONS
        or lay.recompute not in RECOMPUTE
        or lay.sp not in SEQUENCE_PARALLEL
        or lay.zero1_comm not in ZERO1_COMM
    ):
        raise ValueError(
            f"unknown ZeRO stage, precision, recomputation, sequence parallelism or ZeRO-1 "
            f"communication in {lay}"
        )
    if batch % (lay.dp * lay.microbatches):
        raise ValueError(
            f"batch {batch} does not split into dp={lay.dp} × {lay.microbatches} micro-batches"
        )
    if cfg.seq_len % lay.cp:
        raise ValueError(f"cp={lay.cp} does not divide the sequence length {cfg.seq_len}")
    if lay.cp_layout not in CP_LAYOUTS or (
        lay.cp > 1 and lay.cp_layout == "zigzag" and cfg.seq_len % (2 * lay.cp)
    ):
        raise ValueError(
            f"cp_layout is one of {CP_LAYOUTS}; zig-zag cuts the sequence into 2·cp pieces "
            f"({lay.cp_layout!r}, cp={lay.cp}, sequence length {cfg.seq_len})"
        )
    b = batch // (lay.dp * lay.microbatches)
    best: Plan | None = None
    for stage in range(lay.pp):
        st = state_bytes(cfg, lay, stage)
        p = Plan(
            st["params"],
            st["grads"],
            st["optimizer"],
            activation_bytes(cfg, lay, b, stage),
            wire_bytes(cfg, lay, b, stage),
            count_params(cfg),
            sent_bytes(cfg, lay, b, stage),
        )
        if best is None or p.total > best.total:
            best = p
    assert best is not None
    return best


def training_days(
    n_params: float,
    tokens: float,
    gpus: int,
    peak_flops: float,
    utilisation: float,
    recompute: str = "none",
) -> float:
    """Days to train on ``tokens`` with the GPUs running at ``utilisation`` of
    ``peak_flops``: 6·N·D FLOPs (forward 2, backward 4 per parameter and token), or
    8·N·D with full recomputation, whose backward runs the forward again. Without
    recomputation ``utilisation`` is the model FLOPs utilisation (MFU, which counts
    6·N·D); with it, the hardware's (MFU is then 6/8 of it)."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute is one of {RECOMPUTE}, not {recompute!r}")
    flops = (8 if recompute == "full" else 6) * n_params * tokens
    return flops / (gpus * peak_flops * utilisation) / 86400


GPT3 = Config(vocab=50257, d_model=12288, n_layers=96, n_heads=96, seq_len=2048)


def table(cfg: Config, lay: Layout, batch: int) -> str:
    """The plan as a few lines of text (GB = 10⁹ bytes)."""
    p = plan(cfg, lay, batch)
    wire = ", ".join(f"{k} {v / 1e9:.3g}" for k, v in p.wire.items()) or "nothing"
    sent = sum(p.sent.values()) / 1e9
    return (
        f"{lay.world} ranks (dp {lay.dp} × tp {lay.tp} × pp {lay.pp} × cp {lay.cp}, ep {lay.ep}), "
        f"ZeRO-{lay.zero}, {lay.precision}, recompute {lay.recompute}, sequence parallel "
        f"{lay.sp}{', vocabulary split' if lay.vocab_parallel else ''}"
        f"{f', vocabulary padded to {padded_vocab(cfg.vocab, lay.tp, lay.pad_vocab):,}' if lay.pad_vocab else ''}"
        f"{f', {lay.cp_layout} ring' if lay.cp > 1 else ''}; "
        f"Ψ = {p.n_params / 1e9:.3g} B\n"
        f"per rank: parameters {p.params / 1e9:.3g} GB, gradients {p.grads / 1e9:.3g} GB, "
        f"optimizer {p.optimizer / 1e9:.3g} GB, activations {p.activations / 1e9:.3g} GB "
        f"→ {p.total / 1e9:.3g} GB\ncollectives' tensors per step (GB): {wire}\n"
        f"sent by this rank per step on rings: {sent:.3g} GB"
    )


def widget(cfg: Config, batch: int, memory_gb: float = 80.0):
    """An ipywidgets panel of the layout's knobs; returns ``(panel, update)``. ``update()``
    redraws the plan for the current values (call it once to render headless)."""
    import ipywidgets as w

    ints = {
        name: w.IntText(value=value, description=name, layout=w.Layout(width="150px"))
        for name, value in (
            ("dp", 1),
            ("tp", 1),
            ("pp", 1),
            ("cp", 1),
            ("ep", 1),
            ("microbatches", 1),
        )
    }
    zero = w.Dropdown(options=[0, 1, 2, 3], value=0, description="ZeRO")
    precision = w.Dropdown(options=list(PRECISIONS), value="fp32", description="precision")
    recompute = w.Dropdown(options=list(RECOMPUTE), value="none", description="recompute")
    sp = w.Dropdown(options=list(SEQUENCE_PARALLEL), value="none", description="seq. parallel")
    vocab = w.Checkbox(value=False, description="vocabulary split")
    ring = w.Dropdown(options=list(CP_LAYOUTS), value="contiguous", description="cp layout")
    out = w.Output()

    def update(*_: object) -> str:
        try:
            lay = Layout(
                **{k: v.value for k, v in ints.items()},
                zero=zero.value,
                precision=precision.value,
                recompute=recompute.value,
                sequence_parallel=sp.value,
                cp_layout=ring.value,
                vocab_parallel=vocab.value,
            )
            text = table(cfg, lay, batch)
            total = plan(cfg, lay, batch).total / 1e9
            text += f"\n{'fits' if total <= memory_gb else 'does NOT fit'} in {memory_gb:g} GB"
        except ValueError as e:
            text = f"not a valid layout: {e}"
        out.clear_output()
        with out:
            print(text)
        return text

    for control in (*ints.values(), zero, precision, recompute, sp, ring, vocab):
        control.observe(update, names="value")
    panel = w.VBox(
        [
            w.HBox(list(ints.values())[:3]),
            w.HBox(list(ints.values())[3:]),
            w.HBox([zero, precision, recompute]),
            w.HBox([sp, ring, vocab]),
            out,
        ]
    )
    return panel, update
