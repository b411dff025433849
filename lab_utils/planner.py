"""Plan it before you run it: bytes per rank and bytes on the wire of a transformer layout.

    cfg = Config(vocab=96, d_model=64, n_layers=4, n_heads=4, seq_len=32)
    lay = Layout(dp=2, zero=3)
    p = plan(cfg, lay, batch=16)      # p.params, p.grads, p.optimizer, p.activations, p.wire

The model is a decoder-only transformer laid out like ``char_transformer``: learned token
and position embeddings, pre-norm blocks (q, k, v, proj; fc1 → GELU → fc2 of width
``mlp_ratio · d``, or a mixture of experts), a final LayerNorm and an output projection.
A layout splits it five ways — data (``dp``), tensor (``tp``, Megatron's column/row
split of each block; the norms whole, and the token embedding and the output head whole
on every tensor rank as this course's ``tp_plan`` leaves them, or split by vocabulary
as Megatron-LM does with ``vocab_parallel=True``), pipeline (``pp``, blocks cut evenly,
the embedding on the first stage, the head on the last), context (``cp``, the sequence)
and experts (``ep``) — with a ZeRO stage over the data ranks, a precision, a
recomputation policy and a form of sequence parallelism (:data:`SEQUENCE_PARALLEL`).
The state bytes come from :func:`lab_utils.memory.zero_bytes_per_rank` (the ZeRO
paper's formulas) applied to the parameters this rank holds; ZeRO-3 (FSDP2)
shards every tensor along its first dimension and pads it to a multiple of ``dp``, which
the plan counts exactly. Activation bytes count what autograd saves in this block
implementation, each storage once as :class:`lab_utils.saved_bytes.SavedBytes` counts
(see :func:`block_activation_values` and :func:`activation_bytes`). Wire bytes are the
sizes of the tensors the collectives carry, as :mod:`lab_utils.traffic` counts them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from lab_utils import memory

# bytes of a parameter, a gradient and the optimizer state per parameter (Adam)
PRECISIONS = {
    "fp32": (4, 4, 8),
    "bf16": (2, 2, 12),
}  # bf16: fp32 master + 2 moments (ZeRO paper's K=12)
RECOMPUTE = ("none", "full")
# "torch": torch.distributed.tensor.parallel.SequenceParallel on the LayerNorms, which the
# course runs (Lab 4.7); "megatron": Korthikanti et al. 2022, §4.2.2 (block_activation_values).
SEQUENCE_PARALLEL = ("none", "torch", "megatron")
# ZeRO-1's gradient and parameter traffic: "torch" is ZeroRedundancyOptimizer (all-reduce the
# gradients, then each rank broadcasts the parameters it updated: 3Ψ on a ring); "paper" is
# stage 1 as Rajbhandari et al. 2020 define it (§7.2.1: reduce-scatter + all-gather, 2Ψ).
ZERO1_COMM = ("torch", "paper")


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
    """Per-rank bytes (the most loaded rank) and per-step wire bytes by collective."""

    params: float
    grads: float
    optimizer: float
    activations: float
    wire: dict[str, float] = field(default_factory=dict)
    n_params: int = 0

    @property
    def state(self) -> float:
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> float:
        return self.state + self.activations


# ------------------------------------------------------------------------- parameters
def tensors(
    cfg: Config, tp: int = 1, ep: int = 1, vocab_parallel: bool = False
) -> dict[str, list[tuple[int, ...]]]:
    """Shapes of the tensors one rank of a ``tp``-way tensor and ``ep``-way expert split
    holds, by part: ``embed``, ``block`` (one block), ``head``. The token embedding and
    the output head are whole on every tensor rank, or with ``vocab_parallel`` cut by
    vocabulary into ``tp`` pieces (rank 0's, the largest, ``ceil(vocab / tp)`` rows: how
    ``Shard(0)`` cuts them); the position embedding stays whole."""
    d, h = cfg.d_model, cfg.mlp_ratio * cfg.d_model
    v = math.ceil(cfg.vocab / tp) if vocab_parallel else cfg.vocab
    for what, n in (("d_model", d), ("n_heads", cfg.n_heads), ("mlp width", h)):
        if n % tp:
            raise ValueError(f"tp={tp} does not divide {what} = {n}")
    embed = [(v, d)] + (
        [(cfg.max_len if cfg.max_len is not None else cfg.seq_len, d)] if cfg.max_len != 0 else []
    )
    norm = [(d,), (d,)]
    attn = [(d // tp, d), (d // tp,)] * 3 + [(d, d // tp), (d,)]  # q, k, v by rows; proj by columns
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
    t = tensors(cfg, lay.tp, lay.ep, lay.vocab_parallel)
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
    measures them; ``tests/test_planner.py`` checks every form below against it):

    - the two LayerNorms' inputs (2·bsh) and statistics (4·bs), and their outputs (2·bsh),
      which q, k, v and fc1 save as their input;
    - q, k, v and the attention output (4·bsh) — the projection's input is a view of the
      attention output (the fused kernel returns it in (b, s, heads, head) order), so it
      adds nothing — the attention's log-sum-exp (a·bs), and the MLP's input to GELU and
      to fc2 (2·r·bsh).

    Tensor parallelism splits the second list by ``tp``. Sequence parallelism, by name:

    - ``"torch"`` — what the course runs (Lab 4.7): ``SequenceParallel`` on the
      LayerNorms splits their inputs and statistics by ``tp`` (torch 2.13,
      torch/distributed/tensor/parallel/style.py:339, its input and output ``Shard(1)``);
      the attention and the MLP all-gather their input (``PrepareModuleInput`` to
      ``Replicate()``, style.py:522, a ``redistribute`` autograd records), and q, k, v
      and fc1 save that gathered input, whole on every rank.
    - ``"megatron"`` — Korthikanti et al. 2022, "Reducing Activation Recomputation in
      Large Transformer Models", §4.2.2: the all-gathered LayerNorm output is not kept
      but gathered again in backward, so everything is split by ``tp``
      (their sbh·(34/t + 5as/(ht)) per layer, in this block's terms).

    Context parallelism splits the sequence (``s = seq_len / cp``): each rank saves its
    own chunk's tensors, as a ring whose backward passes K and V around again does. No
    run of this course measures a context-parallel block (Lab 4.7 meters its ring
    attention alone), so this term is the one not checked against a measurement."""
    s = cfg.seq_len // lay.cp
    bsh, bs = b * s * cfg.d_model, b * s
    t = lay.tp
    norm_in = 2 * bsh + 4 * bs  # LayerNorm inputs and their mean and 1/std
    norm_out = 2 * bsh  # the inputs of q, k, v and of fc1
    split = (4 + 2 * cfg.mlp_ratio) * bsh + cfg.n_heads * bs
    sp = lay.sp
    if sp == "torch":
        return norm_in / t + norm_out + split / t
    if sp == "megatron":
        return (norm_in + norm_out + split) / t
    return norm_in + norm_out + split / t


def block_input_values(cfg: Config, lay: Layout, b: int) -> float:
    """Values of one block's input for ``b`` sequences: what full recomputation keeps per
    block (split by ``tp`` under either form of sequence parallelism: the residual stream
    between blocks is sharded by sequence)."""
    values = b * (cfg.seq_len // lay.cp) * cfg.d_model
    return values / lay.tp if lay.sp != "none" else values


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
    per_block = block_activation_values(cfg, lay, b)
    once = 0.0
    if lay.recompute == "full":
        kept = block_input_values(cfg, lay, b)
        values = blocks * kept
        once = per_block - kept if blocks else 0.0
    else:
        values = blocks * per_block
    extra = 0.0
    if stage == 0:
        extra += 8 * b * s + 8 * s  # the int64 ids and positions the embedding saves
    if stage == lay.pp - 1:  # final LayerNorm (in, out, stats)
        values += 2 * b * s * cfg.d_model + 2 * b * s
        if loss:  # cross-entropy: fp32 log-probabilities (autocast too), int64 targets, a scalar
            v = math.ceil(cfg.vocab / lay.tp) if lay.vocab_parallel else cfg.vocab
            extra += 4 * b * s * v + 8 * b * s + 4
    in_flight = min(lay.pp - stage, lay.microbatches)
    return in_flight * (act * values + extra) + act * once


# ------------------------------------------------------------------------------ wire
def wire_bytes(cfg: Config, lay: Layout, b: int, stage: int = 0) -> dict[str, float]:
    """Bytes of the tensors each collective carries in one step on one rank of ``stage``
    (the full tensor, as :mod:`lab_utils.traffic` counts; a ring sends about that much, an
    all-reduce twice): data-parallel gradient sync by ZeRO stage, tensor-parallel
    all-reduces (4 per block: 2 forward, 2 backward) or, with sequence parallelism, the
    same bytes as all-gathers and reduce-scatters, pipeline sends between neighbours,
    and the experts' 4 all-to-alls per layer.

    Data-parallel sync by ZeRO stage: 0 (DDP) all-reduces the gradients; 1 as
    ``lay.zero1_comm`` names it — ``"torch"``, PyTorch's ``ZeroRedundancyOptimizer``
    (what Lab 4.4 runs): the same all-reduce, then a broadcast of each rank's updated
    parameters (Ψ more, 3Ψ on a ring); ``"paper"``, ZeRO stage 1 as Rajbhandari et al.
    2020 define it (§7.2.1): a reduce-scatter of the gradients and an all-gather of the
    updated parameters (2Ψ on a ring, as DDP); 2 the same reduce-scatter + all-gather; 3
    (FSDP2) all-gathers the parameters in forward and again in backward and
    reduce-scatters the gradients (3Ψ)."""
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
    if lay.tp > 1:
        size = 4 * blocks * m * b * s * cfg.d_model * act
        if lay.sp != "none":
            out["all_gather_tp"] = out["reduce_scatter_tp"] = size / 2
        else:
            out["all_reduce_tp"] = size
    if lay.pp > 1:
        out["send_recv"] = 2 * m * b * s * cfg.d_model * act  # activations forward, gradients back
    if lay.cp > 1:  # ring attention: K and V blocks go around the ring, their gradients back
        out["send_recv_cp"] = 2 * 2 * (lay.cp - 1) * blocks * m * b * s * cfg.d_model * act / lay.tp
    if cfg.n_experts and lay.ep > 1:
        tokens = b * s
        slots = math.ceil(cfg.capacity_factor * tokens * cfg.top_k / cfg.n_experts)
        out["all_to_all"] = 4 * blocks * m * cfg.n_experts * slots * cfg.d_model * act
    return out


def plan(cfg: Config, lay: Layout, batch: int) -> Plan:
    """The most loaded rank's bytes for a step of ``batch`` sequences in all (split over
    the data ranks and the micro-batches), and that rank's wire bytes per step."""
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
        )
        if best is None or p.total > best.total:
            best = p
    assert best is not None
    return best


def training_days(
    n_params: float, tokens: float, gpus: int, peak_flops: float, mfu: float
) -> float:
    """Days to train on ``tokens`` at ``mfu`` of ``peak_flops`` per GPU: 6·N·D FLOPs."""
    return 6 * n_params * tokens / (gpus * peak_flops * mfu) / 86400


GPT3 = Config(vocab=50257, d_model=12288, n_layers=96, n_heads=96, seq_len=2048)


def table(cfg: Config, lay: Layout, batch: int) -> str:
    """The plan as a few lines of text (GB = 10⁹ bytes)."""
    p = plan(cfg, lay, batch)
    wire = ", ".join(f"{k} {v / 1e9:.3g}" for k, v in p.wire.items()) or "nothing"
    return (
        f"{lay.world} ranks (dp {lay.dp} × tp {lay.tp} × pp {lay.pp} × cp {lay.cp}, ep {lay.ep}), "
        f"ZeRO-{lay.zero}, {lay.precision}, recompute {lay.recompute}, sequence parallel "
        f"{lay.sp}{', vocabulary split' if lay.vocab_parallel else ''}; "
        f"Ψ = {p.n_params / 1e9:.3g} B\n"
        f"per rank: parameters {p.params / 1e9:.3g} GB, gradients {p.grads / 1e9:.3g} GB, "
        f"optimizer {p.optimizer / 1e9:.3g} GB, activations {p.activations / 1e9:.3g} GB "
        f"→ {p.total / 1e9:.3g} GB\nwire per step (GB): {wire}"
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
    out = w.Output()

    def update(*_: object) -> str:
        try:
            lay = Layout(
                **{k: v.value for k, v in ints.items()},
                zero=zero.value,
                precision=precision.value,
                recompute=recompute.value,
                sequence_parallel=sp.value,
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

    for control in (*ints.values(), zero, precision, recompute, sp, vocab):
        control.observe(update, names="value")
    panel = w.VBox(
        [
            w.HBox(list(ints.values())[:3]),
            w.HBox(list(ints.values())[3:]),
            w.HBox([zero, precision, recompute]),
            w.HBox([sp, vocab]),
            out,
        ]
    )
    return panel, update
