"""What one training step costs in floating-point operations, and how fast a machine can go.

    flops = count_flops(lambda: loss_of(model).backward())    # PyTorch's own counter
    peak = matmul_peak(torch.float32)                          # FLOP/s of a large matmul
    bandwidth = copy_bandwidth()                               # bytes/s of a large copy
    mfu(flops, step_seconds, peak)                             # model FLOPs utilisation

FLOPs are counted by ``torch.utils.flop_counter.FlopCounterMode``, which counts the
matrix products (``mm``, ``addmm``, ``bmm``, convolutions and their backward) from their
shapes; element-wise work (softmax, GELU, LayerNorm) is not counted, as in the 6·N·D
rule. Attention is counted through PyTorch's math kernel: the fused CPU attention
kernel of this PyTorch has no FLOP formula registered, so the counter would skip it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import nullcontext

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

# Dense (no sparsity) peak FLOP/s from the vendors' data sheets, by a fragment of
# torch.cuda.get_device_name(). "fp32" is plain IEEE fp32 on the CUDA cores.
PUBLISHED_PEAKS: dict[str, dict[str, float]] = {
    "H200": {"fp32": 67e12, "tf32": 494.7e12, "bf16": 989.4e12, "fp16": 989.4e12},
    "H100": {"fp32": 67e12, "tf32": 494.7e12, "bf16": 989.4e12, "fp16": 989.4e12},
    "A100": {"fp32": 19.5e12, "tf32": 156e12, "bf16": 312e12, "fp16": 312e12},
    "L40S": {"fp32": 91.6e12, "tf32": 183e12, "bf16": 362e12, "fp16": 362e12},
    "A10": {"fp32": 31.2e12, "tf32": 62.5e12, "bf16": 125e12, "fp16": 125e12},
    "L4": {"fp32": 30.3e12, "tf32": 60e12, "bf16": 121e12, "fp16": 121e12},
    "V100": {"fp32": 15.7e12, "fp16": 125e12},
    "T4": {"fp32": 8.1e12, "fp16": 65e12},
}

_DTYPE_KEY = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def published_peak(
    device_name: str, dtype: torch.dtype = torch.float32, tf32: bool = False
) -> float | None:
    """The data sheet's dense peak FLOP/s of the card called ``device_name`` (as
    ``torch.cuda.get_device_name`` spells it) for ``dtype``; ``None`` when unknown.
    ``tf32=True`` reads fp32 matmuls as TF32 tensor-core work."""
    key = "tf32" if tf32 and dtype == torch.float32 else _DTYPE_KEY.get(dtype)
    for fragment, peaks in PUBLISHED_PEAKS.items():
        if fragment in device_name:
            return peaks.get(key)
    return None


def linear_weights(model: nn.Module) -> int:
    """Number of weights in the model's ``nn.Linear`` layers: the N of 6·N per token
    (embeddings are look-ups, biases additions: neither is a matrix product)."""
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))


def count_flops(fn: Callable[[], object], math_attention: bool = True) -> int:
    """FLOPs PyTorch's counter sees while ``fn`` runs (forward and backward if ``fn``
    calls ``backward``). With ``math_attention`` attention runs in the math kernel,
    whose matrix products the counter counts."""
    kernel = sdpa_kernel(SDPBackend.MATH) if math_attention else nullcontext()
    with kernel, FlopCounterMode(display=False) as counter:
        fn()
    return int(counter.get_total_flops())


def flops_by_op(fn: Callable[[], object], math_attention: bool = True) -> dict[str, int]:
    """The counter's FLOPs per operator (``aten.mm``, ``aten.convolution``...)."""
    kernel = sdpa_kernel(SDPBackend.MATH) if math_attention else nullcontext()
    with kernel, FlopCounterMode(display=False) as counter:
        fn()
    return {str(op): int(n) for op, n in counter.get_flop_counts()["Global"].items()}


def synchronize(device: torch.device | str) -> None:
    """Wait for the device's queued work (CUDA runs asynchronously)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def timed(
    fn: Callable[[], object], repeats: int, device: torch.device | str = "cpu", warmup: int = 1
) -> list[float]:
    """Seconds of each of ``repeats`` calls of ``fn`` after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        synchronize(device)
        samples.append(time.perf_counter() - start)
    return samples


def matmul_peak(
    dtype: torch.dtype = torch.float32,
    n: int = 1024,
    device: torch.device | str = "cpu",
    repeats: int = 5,
) -> float:
    """FLOP/s of an n×n by n×n matrix product (2·n³ FLOPs), from its fastest run:
    the best this machine showed, the denominator of MFU where no data sheet applies."""
    g = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(n, n, generator=g).to(device=device, dtype=dtype)
    b = torch.randn(n, n, generator=g).to(device=device, dtype=dtype)
    return 2 * n**3 / min(timed(lambda: a @ b, repeats, device))


def copy_bandwidth(
    n_bytes: int = 64 * 2**20, device: torch.device | str = "cpu", repeats: int = 5
) -> float:
    """Bytes/s of a large copy (it reads and writes ``n_bytes`` each: 2·n_bytes moved),
    from its fastest run."""
    src = torch.ones(n_bytes // 4, device=device)
    dst = torch.empty_like(src)
    return 2 * n_bytes / min(timed(lambda: dst.copy_(src), repeats, device))


def mfu(flops_per_step: float, step_seconds: float, peak_flops: float) -> float:
    """Model FLOPs utilisation: the FLOP/s the step achieved over the peak."""
    return flops_per_step / step_seconds / peak_flops


def matmul_cost(m: int, k: int, n: int, element_bytes: int = 4) -> tuple[int, int]:
    """``(FLOPs, bytes)`` of an (m×k)·(k×n) product: 2·m·k·n FLOPs; at least both
    inputs read and the output written once."""
    return 2 * m * k * n, element_bytes * (m * k + k * n + m * n)


def elementwise_cost(
    numel: int, flops_per_element: int, inputs: int = 1, element_bytes: int = 4
) -> tuple[int, int]:
    """``(FLOPs, bytes)`` of an element-wise op on ``numel`` elements reading
    ``inputs`` tensors and writing one."""
    return flops_per_element * numel, element_bytes * numel * (inputs + 1)


def allreduce_cost(numel: int, world_size: int, element_bytes: int = 4) -> tuple[float, float]:
    """``(FLOPs, bytes)`` per rank of a ring all-reduce of ``numel`` elements: (p−1)/p·n
    additions while 2·(p−1)/p·n elements are sent and as many received."""
    share = (world_size - 1) / world_size
    return share * numel, 4 * share * numel * element_bytes
