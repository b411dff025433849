"""What one training step costs in floating-point operations, and how fast a machine can go.

    flops = count_flops(lambda: loss_of(model).backward())    # PyTorch's own counter
    peak = matmul_peak(torch.float32)                          # FLOP/s of a large matmul
    bandwidth = copy_bandwidth()                               # bytes/s of a large copy
    mfu(flops, step_seconds, peak)                             # model FLOPs utilisation

FLOPs are counted by ``torch.utils.flop_counter.FlopCounterMode``, which counts the
matrix products (``mm``, ``addmm``, ``bmm``, convolutions and their backward) from their
shapes; element-wise work (softmax, GELU, LayerNorm) is not counted, as in the 6·N·D
rule. Attention is counted through PyTorch's math kernel: the fused attention a CPU runs
by default (``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward) has no
formula in ``flop_registry`` (torch/utils/flop_counter.py, line 729 in torch 2.13), so on
real CPU tensors the counter skips it; :func:`attention_ops` lists which attention
operators ran and whether the counter has a formula for them. (On the ``meta`` device
``scaled_dot_product_attention`` always takes the math path, so a count there cannot show
what the fused kernel hides.)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode, flop_registry


@dataclass(frozen=True)
class Card:
    """One card's dense (no sparsity) peak FLOP/s from its vendor's data sheet.

    ``name`` is the whole name ``torch.cuda.get_device_name`` returns for it: cards
    whose names share a fragment have other peaks ("NVIDIA H100 PCIe" and "NVIDIA H100
    NVL" are not the SXM card "NVIDIA H100 80GB HBM3"; "NVIDIA L4" is not "NVIDIA L40").
    ``source`` names the data sheet and the column read. The H100 and H200 sheets print
    tensor-core rates with sparsity only (marked *), so the dense rates here are half of
    those; the A100, A10, L40 and L40S sheets print dense | sparse pairs (the dense one
    is used); the V100 and T4 sheets have no sparsity. "fp32" is plain IEEE fp32 on the
    CUDA cores."""

    name: str
    source: str
    peaks: dict[str, float]


def _cards(names: tuple[str, ...], source: str, peaks: dict[str, float]) -> list[Card]:
    return [Card(n, source, peaks) for n in names]


_H100_SXM = {"fp32": 67e12, "tf32": 494.5e12, "bf16": 989.5e12, "fp16": 989.5e12}  # 989*/1,979* ÷ 2
_H100_NVL = {"fp32": 60e12, "tf32": 417.5e12, "bf16": 835.5e12, "fp16": 835.5e12}
_A100 = {"fp32": 19.5e12, "tf32": 156e12, "bf16": 312e12, "fp16": 312e12}
PUBLISHED_PEAKS: dict[str, Card] = {
    card.name: card
    for card in [
        *_cards(("NVIDIA H100 80GB HBM3",), "NVIDIA H100 data sheet, H100 SXM", _H100_SXM),
        *_cards(
            ("NVIDIA H100 PCIe",),
            "NVIDIA H100 data sheet, H100 PCIe",
            {"fp32": 51e12, "tf32": 378e12, "bf16": 756e12, "fp16": 756e12},
        ),
        *_cards(("NVIDIA H100 NVL",), "NVIDIA H100 data sheet, H100 NVL (one GPU)", _H100_NVL),
        *_cards(("NVIDIA H200",), "NVIDIA H200 data sheet, H200 SXM", _H100_SXM),
        *_cards(("NVIDIA H200 NVL",), "NVIDIA H200 data sheet, H200 NVL", _H100_NVL),
        *_cards(
            (
                "NVIDIA A100-SXM4-40GB",
                "NVIDIA A100-SXM4-80GB",
                "NVIDIA A100-PCIE-40GB",
                "NVIDIA A100 80GB PCIe",
            ),
            "NVIDIA A100 data sheet (SXM and PCIe alike)",
            _A100,
        ),
        *_cards(
            ("NVIDIA L40S",),
            "NVIDIA L40S data sheet",
            {"fp32": 91.6e12, "tf32": 183e12, "bf16": 362e12, "fp16": 362e12},
        ),
        *_cards(
            ("NVIDIA L40",),
            "NVIDIA L40 data sheet",
            {"fp32": 90.5e12, "tf32": 90.5e12, "bf16": 181e12, "fp16": 181e12},
        ),
        *_cards(
            ("NVIDIA L4",),
            "NVIDIA L4 data sheet",
            {"fp32": 30.3e12, "tf32": 60e12, "bf16": 121e12, "fp16": 121e12},
        ),
        *_cards(
            ("NVIDIA A10",),
            "NVIDIA A10 data sheet",
            {"fp32": 31.2e12, "tf32": 62.5e12, "bf16": 125e12, "fp16": 125e12},
        ),
        *_cards(
            ("Tesla V100-SXM2-16GB", "Tesla V100-SXM2-32GB"),
            "NVIDIA V100 data sheet, V100 SXM2",
            {"fp32": 15.7e12, "fp16": 125e12},
        ),
        *_cards(
            ("Tesla V100-PCIE-16GB", "Tesla V100-PCIE-32GB"),
            "NVIDIA V100 data sheet, V100 PCIe",
            {"fp32": 14e12, "fp16": 112e12},
        ),
        *_cards(("Tesla T4",), "NVIDIA T4 data sheet", {"fp32": 8.1e12, "fp16": 65e12}),
    ]
}

_DTYPE_KEY = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def published_card(device_name: str) -> Card | None:
    """The entry for the card whose whole name is ``device_name`` (as
    ``torch.cuda.get_device_name`` returns it), or ``None``: a name not in the table
    gets no peak rather than the peak of a card whose name shares a fragment."""
    return PUBLISHED_PEAKS.get(device_name.strip())


def published_peak(
    device_name: str, dtype: torch.dtype = torch.float32, tf32: bool = False
) -> float | None:
    """The data sheet's dense peak FLOP/s of the card called ``device_name`` for
    ``dtype`` (:func:`published_card` says which entry and data sheet); ``None`` when the
    card or the dtype is not in the table. ``tf32=True`` reads fp32 matmuls as TF32
    tensor-core work."""
    card = published_card(device_name)
    key = "tf32" if tf32 and dtype == torch.float32 else _DTYPE_KEY.get(dtype)
    return None if card is None or key is None else card.peaks.get(key)


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


class _AttentionOps(TorchDispatchMode):
    """Records the attention operators that reach the kernels (below autocast and
    the choice of kernel), in the order they ran."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[object] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "attention" in func.name() and func.overloadpacket not in self.ops:
            self.ops.append(func.overloadpacket)
        return func(*args, **(kwargs or {}))


def attention_ops(fn: Callable[[], object], math_attention: bool = False) -> dict[str, bool]:
    """The attention operators that ran while ``fn`` ran, each with whether
    ``FlopCounterMode`` has a FLOP formula for it (``torch.utils.flop_counter.
    flop_registry``). With ``math_attention=False`` (the default kernels) a CPU runs
    ``aten._scaled_dot_product_flash_attention_for_cpu``, which has none."""
    kernel = sdpa_kernel(SDPBackend.MATH) if math_attention else nullcontext()
    with kernel, _AttentionOps() as seen:
        fn()
    return {str(op): op in flop_registry for op in seen.ops}


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
