"""Lab 6's cost of one step: MFU of the reference transformer step, bf16 autocast vs
fp32 step time, and activation recomputation's time overhead and memory saving under
each policy (selective — the attention core, Korthikanti et al. §5 —, the attention and
MLP sub-layers, full).

The model is the Lab 4/6 ``char_transformer`` (cpu: d=128, 4 blocks, 16 × 128 tokens);
its FLOPs are counted from shapes (equal to ``FlopCounterMode``, see Lab 6.1), the peak
is the best fp32 matmul this machine ran (and the card's data sheet on a GPU). Ratios
are medians of per-round ratios of steps timed in alternating order.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from lab_utils import flops, models, paths, saved_bytes, text
from lab_utils.parallel import lm_loss
from lab_utils.profile import device as pick_device

from .common import Report, Settings, alternate, median, paired_ratios

reference = paths.lab_module("lab6", "solutions")  # the lab's own module

NAME = "lab6_cost"
TITLE = "Lab 6 cost of a step: MFU, bf16 vs fp32, recomputation"


def _shapes(quick: bool) -> dict[str, int]:
    if quick:
        return dict(d_model=32, n_layers=1, seq_len=16, batch=2)
    return dict(d_model=128, n_layers=4, seq_len=128, batch=16)


def _step(
    policy: str,
    shapes: dict[str, int],
    dev: torch.device,
    low: torch.dtype | None,
    x: torch.Tensor,
    y: torch.Tensor,
) -> Callable[[], None]:
    """One SGD training step of the transformer under a recomputation policy and an
    autocast dtype (``None``: fp32)."""
    torch.manual_seed(0)
    model = models.build(
        "char_transformer",
        vocab=text.VOCAB,
        d_model=shapes["d_model"],
        n_heads=4,
        n_layers=shapes["n_layers"],
        max_len=shapes["seq_len"],
    )
    model = saved_bytes.recompute(model, policy).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def step() -> None:
        with torch.autocast(dev.type, dtype=low or torch.bfloat16, enabled=low is not None):
            loss = lm_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        flops.synchronize(dev)

    return step


def _saved(policy: str, shapes: dict[str, int], x: torch.Tensor, y: torch.Tensor) -> int:
    """Bytes kept for backward under ``policy`` (counted on the CPU: exact anywhere)."""
    torch.manual_seed(0)
    model = saved_bytes.recompute(
        models.build(
            "char_transformer",
            vocab=text.VOCAB,
            d_model=shapes["d_model"],
            n_heads=4,
            n_layers=shapes["n_layers"],
            max_len=shapes["seq_len"],
        ),
        policy,
    )
    return saved_bytes.saved_bytes(
        lambda: lm_loss(model(x.cpu()), y.cpu()), exclude=model.parameters()
    )


def _add_saved_rows(
    report: Report, shapes: dict[str, int], x: torch.Tensor, y: torch.Tensor
) -> dict[str, int]:
    """Bytes saved for backward under each recomputation policy (counted), as rows."""
    saved = {p: _saved(p, shapes, x, y) for p in saved_bytes.POLICIES}
    for policy in saved_bytes.POLICIES[1:]:
        report.add(
            f"bytes saved for backward, {policy} recomputation / none",
            100 * saved[policy] / saved["none"],
            "%",
            note=f"{saved[policy] / 2**20:.2f} of {saved['none'] / 2**20:.2f} MiB",
        )
    return saved


def run(settings: Settings) -> Report:
    report = Report(NAME, TITLE)
    shapes = _shapes(settings.quick)
    dev = pick_device()
    corpus = text.load(50_000 if settings.quick else 200_000)
    x, y = (t.to(dev) for t in corpus.batch(shapes["batch"], shapes["seq_len"], step=0))
    rounds = settings.rounds(full=7, quick=1)
    step_flops = reference.transformer_train_flops(
        shapes["n_layers"], shapes["d_model"], text.VOCAB, shapes["batch"], shapes["seq_len"]
    )
    peak = flops.matmul_peak(
        torch.float32, 256 if settings.quick else 1024, dev, repeats=rounds + 2
    )

    steps = {
        "fp32": _step("none", shapes, dev, None, x, y),
        "bf16": _step("none", shapes, dev, torch.bfloat16, x, y),
        "full": _step("full", shapes, dev, None, x, y),
    }
    times = alternate(steps, rounds=rounds)
    fp32_s = median(times["fp32"])
    report.add(
        "transformer step, fp32", fp32_s * 1e3, "ms", note=f"{step_flops / 1e9:.3g} GFLOP per step"
    )
    report.add(
        "MFU against the measured fp32 matmul peak",
        100 * flops.mfu(step_flops, fp32_s, peak),
        "%",
        note=f"peak {peak / 1e9:.1f} GFLOP/s, {torch.get_num_threads()} threads",
    )
    if dev.type == "cuda":
        name = torch.cuda.get_device_name(dev)
        card = flops.published_card(name)  # matched by the whole name, or none
        published = flops.published_peak(name, torch.float32)
        report.add(
            f"MFU against {name}'s published fp32 peak",
            None if published is None else 100 * flops.mfu(step_flops, fp32_s, published),
            "%",
            note=card.source if card else "not in flops.PUBLISHED_PEAKS",
        )
    report.add(
        "bf16 autocast / fp32 step time",
        median(paired_ratios(times["bf16"], times["fp32"])),
        "x",
        note=f"cpu capability {torch.backends.cpu.get_cpu_capability()}"
        if dev.type == "cpu"
        else "",
    )
    report.add(
        "full recomputation / none step time",
        median(paired_ratios(times["full"], times["fp32"])),
        "x",
    )
    saved = _add_saved_rows(report, shapes, x, y)
    report.details = {
        "shapes": shapes,
        "times": times,
        "saved": saved,
        "peak_flops": peak,
        "step_flops": step_flops,
    }
    return report
