"""Plan it before you run it: bytes per rank and bytes on the wire of a transformer layout.

    cfg = Config(vocab=96, d_model=64, n_layers=4, n_heads=4, seq_len=32)
    lay = Layout(dp=2, zero=3)
    p = plan(cfg, lay, batch=16)      # p.params, p.grads, p.optimizer, p.activations, p.wire

The model is a decoder-only transformer laid out like ``char_transformer``: learned token
and position embeddings, pre-norm blocks (q, k, v, proj; fc1 → GELU → fc2 of width
``mlp_ratio · d``, or a mixture of experts), a final LayerNorm and an output projection.
A layout splits it five ways — data (``dp``), tensor (``tp``, Megatron's column/row
split, the embeddings and norms whole), pipeline (``pp``, blocks cut evenly, the
embedding on the first stage, the head on the last), context (``cp``, the sequence) and
experts (``ep``) — with a ZeRO stage over the data ranks, a precision and a
recomputation policy. The state bytes come from :func:`lab_utils.memory.zero_bytes_per_rank`
(the ZeRO paper's formulas) applied to the parameters this rank holds; ZeRO-3 (FSDP2)
shards every tensor along its first dimension and pads it to a multiple of ``dp``, which
the plan counts exactly. Activation bytes count what autograd saves in this block
implementation (see :func:`block_activation_values`). Wire bytes are the sizes of the
tensors the collectives carry, as :mod:`lab_utils.traffic` counts them.
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
    sequence_parallel: bool = False
    microbatches: int = 1  # per step (pipeline micro-batches or gradient accumulation)

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
def tensors(cfg: Config, tp: int = 1, ep: int = 1) -> dict[str, list[tuple[int, ...]]]:
    """Shapes of the tensors one rank of a ``tp``-way tensor and ``ep``-way expert split
    holds, by part: ``embed``, ``block`` (one block), ``head``."""
    d, h = cfg.d_model, cfg.mlp_ratio * cfg.d_model
    for what, n in (("d_model", d), ("n_heads", cfg.n_heads), ("mlp width", h)):
        if n % tp:
            raise ValueError(f"tp={tp} does not divide {what} = {n}")
    embed = [(cfg.vocab, d)] + (
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
        "head": norm + [(cfg.vocab, d), (cfg.vocab,)],
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
    t = tensors(cfg, lay.tp, lay.ep)
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
    """Values autograd saves for one block of this implementation for ``b`` sequences
    (measured tensor by tensor with ``saved_tensors_hooks``): the two LayerNorms' inputs
    and outputs (4·bsh) and their statistics (4·bs), q, k, v, the attention output and
    the projection's input (5·bsh), the attention's log-sum-exp (a·bs), and the MLP's
    input to GELU and to fc2 (2·r·bsh). Tensor parallelism splits what lies between the
    column and the row split by tp; sequence parallelism also the rest; context
    parallelism splits the sequence."""
    s = cfg.seq_len // lay.cp
    bsh, bs = b * s * cfg.d_model, b * s
    t = lay.tp
    whole = 4 * bsh + 4 * bs  # norms: replicated under tensor parallelism
    split = (5 + 2 * cfg.mlp_ratio) * bsh + cfg.n_heads * bs
    if lay.sequence_parallel:
        whole /= t
    return whole + split / t


def activation_bytes(cfg: Config, lay: Layout, b: int, stage: int = 0, loss: bool = True) -> float:
    """Bytes saved for backward on one rank of ``stage`` while ``b`` sequences of one
    micro-batch are in flight, times the micro-batches in flight (1F1B keeps
    ``min(pp − stage, microbatches)``). With full recomputation a block keeps only its
    input, and one block's saved tensors exist at a time during its backward."""
    act = PRECISIONS[lay.precision][0]
    s = cfg.seq_len // lay.cp
    blocks = stage_blocks(cfg.n_layers, lay.pp, stage)
    per_block = block_activation_values(cfg, lay, b)
    if lay.recompute == "full":
        values = blocks * b * s * cfg.d_model + per_block
    else:
        values = blocks * per_block
    extra = 0.0
    if stage == 0:
        extra += 8 * b * s + 8 * s  # the int64 ids and positions the embedding saves
    if stage == lay.pp - 1:  # final LayerNorm (in, out, stats)
        values += 2 * b * s * cfg.d_model + 2 * b * s
        if loss:  # cross-entropy: fp32 log-probabilities (autocast too), int64 targets, a scalar
            extra += 4 * b * s * cfg.vocab + 8 * b * s + 4
    in_flight = min(lay.pp - stage, lay.microbatches)
    return in_flight * (act * values + extra)


# ------------------------------------------------------------------------------ wire
def wire_bytes(cfg: Config, lay: Layout, b: int, stage: int = 0) -> dict[str, float]:
    """Bytes of the tensors each collective carries in one step on one rank of ``stage``
    (the full tensor, as :mod:`lab_utils.traffic` counts; a ring sends about that much, an
    all-reduce twice): data-parallel gradient sync by ZeRO stage, tensor-parallel
    all-reduces (4 per block: 2 forward, 2 backward) or, with sequence parallelism, the
    same bytes as all-gathers and reduce-scatters, pipeline sends between neighbours,
    and the experts' 4 all-to-alls per layer."""
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
        elif lay.zero == 2:
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
        if lay.sequence_parallel:
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
    ):
        raise ValueError(f"unknown ZeRO stage, precision or recomputation in {lay}")
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
        f"ZeRO-{lay.zero}, {lay.precision}, recompute {lay.recompute}; Ψ = {p.n_params / 1e9:.3g} B\n"
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
    sp = w.Checkbox(value=False, description="sequence parallel")
    out = w.Output()

    def update(*_: object) -> str:
        try:
            lay = Layout(
                **{k: v.value for k, v in ints.items()},
                zero=zero.value,
                precision=precision.value,
                recompute=recompute.value,
                sequence_parallel=sp.value,
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

    for control in (*ints.values(), zero, precision, recompute, sp):
        control.observe(update, names="value")
    panel = w.VBox(
        [
            w.HBox(list(ints.values())[:3]),
            w.HBox(list(ints.values())[3:]),
            w.HBox([zero, precision, recompute, sp]),
            out,
        ]
    )
    return panel, update
