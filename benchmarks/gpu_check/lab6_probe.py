"""Lab 6 on the device: ``python -m benchmarks.gpu_check.lab6_probe [--small]``.

Each part runs the course's own pieces on ``profile.device()`` and emits one record
(``event: part``) with its status and numbers; a part that raises is reported failed
and the next part still runs.

- ``bf16``: a few training steps of the Lab 4/6 ``char_transformer`` under
  ``torch.autocast(dtype=bfloat16)``: the dtype autocast gave the logits, the losses.
- ``fp16_scaler``: fp16 autocast with ``torch.amp.GradScaler("cuda")`` (notebook 2 runs
  the same lesson on a CPU with ``GradScaler("cpu")``; this part is CUDA's kernels): the
  scale, the steps it skipped, the losses.
- ``recompute_memory``: the forward's peak ``torch.cuda.max_memory_allocated`` above the
  model's own memory, without and with recomputation, against ``saved_bytes``' count
  of the bytes saved for backward. Asserted (counts, not times): the peak holds at
  least what was saved, and full recomputation lowers it.
- ``mfu``: FLOPs of one step counted by ``FlopCounterMode`` (``flops.count_flops``), the
  step timed, against the matmul peak measured here and the card's published peak, in
  fp32 and in bf16 autocast. Shown, not asserted (a time).
- ``trace``: ``torch.profiler`` over a few steps, exported as a Chrome trace and read
  by the course's reader (``lab_utils.trace``): the GPU kernels it holds, per-step times.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lab_utils import flops, metrics, models, profile, saved_bytes, text, trace
from lab_utils.parallel import lm_loss

PARTS = ("bf16", "fp16_scaler", "recompute_memory", "mfu", "trace")
NO_CUDA = "no CUDA"


class Skipped(Exception):
    """A part that cannot run on this device (its reason is the message)."""


def shapes(small: bool) -> dict[str, int]:
    if small:
        return dict(d_model=32, n_heads=4, n_layers=1, seq_len=16, batch=2)
    return dict(d_model=1024, n_heads=16, n_layers=8, seq_len=512, batch=8)


def build(s: dict[str, int], dev: torch.device, policy: str = "none") -> torch.nn.Module:
    torch.manual_seed(0)
    model = models.build(
        "char_transformer",
        vocab=text.VOCAB,
        d_model=s["d_model"],
        n_heads=s["n_heads"],
        n_layers=s["n_layers"],
        max_len=s["seq_len"],
    )
    return saved_bytes.recompute(model, policy).to(dev)


def batch(s: dict[str, int], dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    xy = torch.randint(0, text.VOCAB, (s["batch"], s["seq_len"] + 1), generator=g).to(dev)
    return xy[:, :-1], xy[:, 1:]


def train_step(
    model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, low: torch.dtype | None
) -> Callable[[], float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def step() -> float:
        with torch.autocast(x.device.type, dtype=low or torch.bfloat16, enabled=low is not None):
            loss = lm_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss.detach()

    return step


def part_bf16(s: dict[str, int], dev: torch.device, out: Path) -> dict[str, Any]:
    model = build(s, dev)
    x, y = batch(s, dev)
    with torch.autocast(dev.type, dtype=torch.bfloat16):
        logits_dtype = str(model(x).dtype).removeprefix("torch.")
    step = train_step(model, x, y, torch.bfloat16)
    losses = [float(step()) for _ in range(5)]
    if logits_dtype != "bfloat16" or not all(map(math.isfinite, losses)):
        raise AssertionError(f"logits {logits_dtype}, losses {losses}")
    return {"logits_dtype": logits_dtype, "loss_first": losses[0], "loss_last": losses[-1]}


def part_fp16_scaler(s: dict[str, int], dev: torch.device, out: Path) -> dict[str, Any]:
    if dev.type != "cuda":
        raise Skipped(
            f"{NO_CUDA}: this part checks CUDA's fp16 kernels (Lab 6.2 runs GradScaler on a CPU)"
        )
    model = build(s, dev)
    x, y = batch(s, dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cuda")
    scales, losses = [scaler.get_scale()], []
    for _ in range(10):
        with torch.autocast("cuda", dtype=torch.float16):
            loss = lm_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(opt)  # skipped when the scaled gradients hold an inf or a NaN
        scaler.update()
        scales.append(scaler.get_scale())
        losses.append(float(loss))
    skipped = sum(b < a for a, b in zip(scales, scales[1:]))  # the scale halves on a skip
    if skipped == len(losses) or not math.isfinite(losses[-1]):
        raise AssertionError(
            f"every step skipped or a non-finite loss: scales {scales}, losses {losses}"
        )
    return {
        "scale_first": scales[0],
        "scale_last": scales[-1],
        "steps_skipped": skipped,
        "loss_first": losses[0],
        "loss_last": losses[-1],
    }


def forward_memory(s: dict[str, int], dev: torch.device, policy: str) -> tuple[int, int, int]:
    """``(saved bytes counted, peak above the start, held at the end)`` of one forward."""
    model = build(s, dev, policy)
    x, y = batch(s, dev)
    torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    with saved_bytes.SavedBytes(exclude=list(model.parameters())) as meter:
        loss = lm_loss(model(x), y)
        torch.cuda.synchronize(dev)
        held = torch.cuda.memory_allocated(dev) - base
        peak = torch.cuda.max_memory_allocated(dev) - base
        counted = meter.bytes
        loss.backward()
    return counted, peak, held


def part_recompute_memory(s: dict[str, int], dev: torch.device, out: Path) -> dict[str, Any]:
    if dev.type != "cuda":
        raise Skipped(f"{NO_CUDA}: torch.cuda.max_memory_allocated measures GPU memory only")
    numbers: dict[str, Any] = {}
    peaks = {}
    for policy in ("none", "selective", "full"):
        counted, peak, held = forward_memory(s, dev, policy)
        peaks[policy] = peak
        numbers[f"{policy}_saved_MB"] = counted / 2**20
        numbers[f"{policy}_peak_MB"] = peak / 2**20
        numbers[f"{policy}_held/saved"] = held / max(counted, 1)
        if peak < counted:
            raise AssertionError(
                f"{policy}: peak {peak} B below the {counted} B saved for backward"
            )
    if not peaks["full"] < peaks["none"]:
        raise AssertionError(f"full recomputation did not lower the peak: {peaks}")
    return numbers


def part_mfu(s: dict[str, int], dev: torch.device, out: Path) -> dict[str, Any]:
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    n = 4096 if dev.type == "cuda" else 256
    numbers: dict[str, Any] = {}
    for label, low in (("fp32", None), ("bf16", torch.bfloat16)):
        model = build(s, dev)
        x, y = batch(s, dev)
        step = train_step(model, x, y, low)
        step_flops = flops.count_flops(step)
        seconds = statistics.median(flops.timed(step, repeats=5, device=dev, warmup=2))
        dtype = low or torch.float32
        measured = flops.matmul_peak(dtype, n=n, device=dev)
        published = flops.published_peak(name, dtype)
        numbers[f"{label}_TFLOP/s"] = step_flops / seconds / 1e12
        numbers[f"{label}_mfu_measured_peak"] = flops.mfu(step_flops, seconds, measured)
        numbers[f"{label}_measured_peak_TFLOP/s"] = measured / 1e12
        if published:
            numbers[f"{label}_mfu_published_peak"] = flops.mfu(step_flops, seconds, published)
    numbers["published_card"] = (
        name if flops.published_card(name) else f"{name}: not in flops.PUBLISHED_PEAKS"
    )
    return numbers


def part_trace(s: dict[str, int], dev: torch.device, out: Path) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, schedule
    from torch.profiler import profile as torch_profile

    model = build(s, dev)
    x, y = batch(s, dev)
    step = train_step(model, x, y, None)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with torch_profile(
        activities=activities, schedule=schedule(wait=1, warmup=1, active=3)
    ) as prof:
        for _ in range(5):
            step()
            prof.step()
    path = out / "lab6_trace.json"
    prof.export_chrome_trace(str(path))
    t = trace.load(path)
    doc = json.loads(path.read_text())
    events = doc["traceEvents"] if isinstance(doc, dict) else doc
    kernels = sum(1 for e in events if e.get("cat") == "kernel")
    numbers = {"steps": len(t.steps), "cuda_kernels": kernels, **trace.summary(t)}
    if not t.steps or trace.total(t.compute) <= 0:
        raise AssertionError(f"the reader found no steps or no compute: {numbers}")
    if dev.type == "cuda" and kernels == 0:
        raise AssertionError("a CUDA trace without kernel events")
    return numbers


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--small", action="store_true", help="the smallest sizes (the CPU form)")
    p.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    args = p.parse_args(argv)
    dev = profile.device()
    s = shapes(args.small)
    out = Path(os.getcwd())
    print(
        f"device {dev} ({torch.cuda.get_device_name(dev) if dev.type == 'cuda' else 'cpu'}), {s}",
        flush=True,
    )
    failed = 0
    for name in args.parts:
        record: dict[str, Any] = {"event": "part", "part": name}
        try:
            record.update(status="passed", **globals()[f"part_{name}"](s, dev, out))
        except Skipped as e:
            record.update(status="skipped", reason=str(e))
        except Exception as e:  # reported, and the next part still runs
            traceback.print_exc()
            failed += 1
            record.update(status="failed", reason=f"{type(e).__name__}: {e}"[:500])
        print(f"{name}: {record}", flush=True)
        metrics.emit(record)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
