"""Reference solutions for Lab 6 (used when ``LABS_SOLUTIONS=1``)."""

from __future__ import annotations

import torch

# Lab 6.5's reference make_buckets is library code, re-exported here: ddp_by_hand.py
# buckets with it, and a script never imports this module.
from lab_utils.buckets import make_buckets as make_buckets


# --------------------------------------------------------------------- 01–03
def transformer_train_flops(
    n_layers: int, d_model: int, vocab: int, batch: int, seq_len: int
) -> int:
    """FLOPs of one training step (forward + backward) of ``char_transformer``.

    Matrix products only. Each block has 12·d² weights in linear layers (q, k, v and
    proj: 4·d²; the MLP d → 4d → d: 8·d²), the head d·vocab more: N weights. Every
    token costs 2·N in the forward and 4·N in the backward (the gradients of the
    input and of the weight): 6·N per token. Attention adds two products per layer,
    QKᵀ and (softmax)·V, each 2·s²·d per sequence forward (the full s×s matrix, by the
    counting convention of MFU and of torch's counter, even where a fused causal kernel
    skips the masked half), three times that for a step.
    """
    tokens = batch * seq_len
    n = n_layers * 12 * d_model**2 + d_model * vocab
    attention = n_layers * 3 * (2 * 2 * batch * seq_len**2 * d_model)
    return 6 * n * tokens + attention


def cnn_train_flops(
    width: int, batch: int, image_size: int = 28, in_channels: int = 1, num_classes: int = 10
) -> int:
    """FLOPs of one training step of ``fmnist_cnn`` from its layer shapes.

    A 3×3 convolution from C_in to C_out channels on an H×W map costs 2·9·C_in·C_out·H·W
    per image forward; its backward computes the weight gradient (as much again) and the
    input gradient (as much again), except for the first layer: its input is the data,
    which needs no gradient. The classifier is a linear layer: 6·in·out per image.
    """
    convs = [
        (in_channels, width, image_size),
        (width, 2 * width, image_size // 2),
        (2 * width, 4 * width, image_size // 4),
    ]
    total = 0
    for i, (c_in, c_out, side) in enumerate(convs):
        forward = 2 * 9 * c_in * c_out * side * side * batch
        total += forward * (2 if i == 0 else 3)
    features = 4 * width * (image_size // 4) ** 2
    return total + 6 * features * num_classes * batch


def matmul_roofline(
    m: int, k: int, n: int, dtype: torch.dtype, peak: dict, bandwidth: float
) -> tuple[float, bool]:
    """``(intensity, memory_bound)`` of an (m×k)·(k×n) product in ``dtype`` on a machine
    whose matmul peak in that dtype is ``peak[dtype]`` FLOP/s and whose memory moves
    ``bandwidth`` bytes/s.

    FLOPs: a multiply and an add per term, 2·m·k·n. Bytes: at least both inputs read
    and the output written once, (m·k + k·n + m·n) elements of ``dtype.itemsize`` bytes.
    Memory-bound when the intensity is below the ridge point of that dtype's roof,
    peak[dtype] / bandwidth: the memory cannot feed the arithmetic units."""
    intensity = 2 * m * k * n / (dtype.itemsize * (m * k + k * n + m * n))
    return intensity, intensity < peak[dtype] / bandwidth


def fp16_gradients(grads: torch.Tensor, scale: float) -> torch.Tensor:
    """What fp16 keeps of fp32 gradients under loss scaling: scale, cast to fp16 (which
    rounds to 11 significant bits and |x| ≤ 2⁻²⁵ to zero: tiny values underflow), then back
    to fp32 and unscale."""
    return (grads * scale).to(torch.float16).to(torch.float32) / scale


def layer_activation_bytes(seq_len: int, batch: int, d_model: int, n_heads: int) -> int:
    """Bytes one ``char_transformer`` block saves for backward in fp32 (4-byte values)
    with PyTorch's fused CPU attention.

    Korthikanti et al. count s·b·h·(34 + 5·a·s/h) bytes in 16-bit with dropout. Here:
    no dropout (no masks) and a fused attention kernel that keeps no s×s matrix, only a
    log-sum-exp per head and position. Saved s·b·h tensors: the block's input, LN1's
    output, q, k, v, the attention output, the residual sum (LN2's input), LN2's output
    (8 in all), the MLP's 4h-wide fc1 output and GELU output (8 more): 16·s·b·h values.
    Each LayerNorm keeps a mean and 1/std per token (4·s·b), attention a log-sum-exp
    per head (a·s·b).
    """
    sb = seq_len * batch
    return 4 * (16 * sb * d_model + 4 * sb + n_heads * sb)


# --------------------------------------------------------------------- 04–06
def bytes_sent_per_rank(
    strategy: str,
    *,
    n: int,
    psi: int,
    batch: int,
    seq_len: int,
    d_model: int,
    layers: int,
    value_bytes: int = 4,
) -> float:
    """Bytes each of ``n`` ranks sends in one training step (averaged over the ranks),
    with bandwidth-optimal collectives: a ring all-reduce of S bytes sends 2(n−1)/n·S per
    rank, an all-gather, reduce-scatter or broadcast (n−1)/n·S.

    ddp: the gradients all-reduced (S = Ψ values). zero1_torch, PyTorch's
    ``ZeroRedundancyOptimizer`` beside DDP: the same all-reduce, then each rank broadcasts
    the parameters it updated (S = Ψ in all): 3(n−1)/n·Ψ. zero2, ZeRO stage 2 (and 1) as
    Rajbhandari et al. 2020 define it (§7.2.1): the gradients reduce-scattered, each rank
    steps its shard, the updated parameters all-gathered: 2(n−1)/n·Ψ, as DDP. fsdp (ZeRO
    stage 3, §7.2.2): the weights all-gathered in forward and again in backward, the
    gradients reduce-scattered: 3(n−1)/n·Ψ. tp (Megatron): per block two all-reduces of a
    (batch, seq_len, d) activation forward and two of its gradient backward. pp (n
    stages): across each of the n − 1 boundaries the activation goes forward and its
    gradient comes back."""
    grads = psi * value_bytes
    act = batch * seq_len * d_model * value_bytes
    ring = (n - 1) / n
    per_rank = {
        "ddp": 2 * ring * grads,
        "zero1_torch": 2 * ring * grads + ring * grads,
        "zero2": ring * grads + ring * grads,
        "fsdp": 3 * ring * grads,
        "tp": 2 * ring * 4 * layers * act,
        "pp": 2 * (n - 1) * act / n,
    }
    return per_rank[strategy]
