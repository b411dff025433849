"""Lab 7's DiLoCo and Streaming DiLoCo (``scripts/diloco.py``): one two-rank job read by
every test of its run, and the checks of notebook 4 against wrong answers."""

from __future__ import annotations

import copy
import importlib
import inspect
import sys

import pytest
import torch
import torch.distributed as dist
from conftest import REPO

import lab7_checks as checks
import lab7_solutions as solutions
from lab_utils import launch
from lab_utils.checks import CheckFailed

LAB7 = REPO / "labs" / "lab7_communication"
STEPS, PERIODS, FRAGMENTS, CHECK = 8, (1, 4), 2, 4


@pytest.fixture(scope="module")
def job() -> launch.LaunchResult:
    """DDP, DiLoCo H = 1 and 4, Streaming DiLoCo H = 4 with 2 fragments, and the
    local-SGD check at H = 4: one job (each launch costs a few seconds of process starts)."""
    return launch.run(
        LAB7 / "scripts" / "diloco.py",
        [
            *("--steps", str(STEPS), "--periods", *map(str, PERIODS)),
            *("--fragments", str(FRAGMENTS), "--check-period", str(CHECK)),
            *("--d-model", "32", "--layers", "2", "--heads", "4", "--seq-len", "32"),
            *("--batch-size", "16", "--n-chars", "200000"),
            *("--outer-lr", "0.7", "--outer-momentum", "0.9"),
        ],
        nprocs=2,
        cwd=LAB7,
        timeout=240,
        echo=False,
    ).check()


@pytest.fixture(scope="module")
def diloco_module():
    """The script as a module (what compare_methods.py imports)."""
    sys.path.insert(0, str(LAB7 / "scripts"))
    try:
        yield importlib.import_module("diloco")
    finally:
        sys.path.remove(str(LAB7 / "scripts"))


# ----------------------------------------------------------------- the run's bytes
def test_ddp_sends_the_model_every_step_and_diloco_every_h_th(job):
    full = job.event("model")["param_bytes"]
    assert job.event("run", method="ddp")["bytes_by_step"] == [full] * STEPS
    for h in PERIODS:
        run = job.event("run", method="diloco", period=h, fragments=1)
        assert run["bytes_by_step"] == [full if s % h == 0 else 0 for s in range(1, STEPS + 1)]
        checks.check_diloco_bytes(run)


def test_streaming_sends_one_fragment_a_sync_and_diloco_s_total(job):
    """Peak = the largest fragment's 4 bytes a parameter, total = DiLoCo's, fragment f at
    steps (k·F + f + 1)·H/F: predicted from the fragments' numel and counted."""
    model = job.event("model")
    diloco = job.event("run", method="diloco", period=CHECK, fragments=1)
    streaming = job.event("run", method="diloco", period=CHECK, fragments=FRAGMENTS)
    sizes = streaming["fragment_numel"]
    assert sum(sizes) == model["numel"] and len(sizes) == FRAGMENTS and min(sizes) > 0
    every = CHECK // FRAGMENTS
    assert streaming["bytes_by_step"] == [
        4 * sizes[(s // every - 1) % FRAGMENTS] if s % every == 0 else 0
        for s in range(1, STEPS + 1)
    ]
    ratio = checks.check_streaming(diloco, streaming)
    assert ratio == model["param_bytes"] / (4 * max(sizes)) and ratio > 1.5
    # no streaming run where F does not divide H (H = 1 with 2 fragments)
    assert not job.events("run", method="diloco", period=1, fragments=FRAGMENTS)


def test_the_streaming_check_names_wrong_byte_counts(job):
    diloco = job.event("run", method="diloco", period=CHECK, fragments=1)
    streaming = job.event("run", method="diloco", period=CHECK, fragments=FRAGMENTS)
    whole = copy.deepcopy(streaming)  # every sync sends the whole model
    whole["bytes_by_step"] = [
        b and 4 * sum(whole["fragment_numel"]) for b in whole["bytes_by_step"]
    ]
    skipped = copy.deepcopy(streaming)  # the second fragment never sent
    skipped["bytes_by_step"] = [
        0 if b == 4 * skipped["fragment_numel"][1] else b for b in skipped["bytes_by_step"]
    ]
    early = copy.deepcopy(diloco)  # averaged after steps 1, H + 1, ... (the averager's rule)
    early["bytes_by_step"] = [early["bytes_by_step"][-1]] + early["bytes_by_step"][:-1]
    for wrong_diloco, wrong_streaming in ((diloco, whole), (diloco, skipped), (early, streaming)):
        with pytest.raises(CheckFailed):
            checks.check_streaming(wrong_diloco, wrong_streaming)


# ----------------------------------------------------------------- outer lr 1 = local SGD
def test_outer_lr_1_without_momentum_is_local_sgd(job):
    """θ − 1·mean(θ − θᵢ) = mean θᵢ: PyTorch's PostLocalSGDOptimizer(AdamW) weights to
    float32 rounding after one outer step; outer lr 0.7, or momentum, is far off."""
    agreements = job.events("agreement")
    assert {(a["outer_lr"], a["outer_momentum"]) for a in agreements} == {
        (1.0, 0.0),
        (0.7, 0.0),
        (1.0, 0.9),
    }
    assert checks.check_outer_lr_one_is_local_sgd(agreements) <= 1e-6
    local = job.event("run", method="local", period=CHECK)
    assert (
        local["bytes_by_step"]
        == job.event("run", method="diloco", period=CHECK, fragments=1)["bytes_by_step"]
    )


def test_the_local_sgd_check_fails_a_wrong_outer_step(job):
    """The run's own wrong answers, presented as the (1, 0) run, fail the check."""
    agreements = job.events("agreement")
    for wrong in (a for a in agreements if (a["outer_lr"], a["outer_momentum"]) != (1, 0)):
        relabelled = [
            {**a, "outer_lr": 1.0, "outer_momentum": 0.0}
            if a is wrong
            else {**a, "outer_lr": 0.5, "outer_momentum": 0.5}
            for a in agreements
        ]
        with pytest.raises(CheckFailed):
            checks.check_outer_lr_one_is_local_sgd(relabelled)


# ----------------------------------------------------------------- the exercise's check
def test_the_reference_pseudo_gradient_passes_and_a_flat_one_too(diloco_module):
    assert checks.check_pseudo_gradient(solutions.pseudo_gradient) > 0
    assert checks.check_pseudo_gradient(diloco_module.pseudo_gradient) > 0  # the script's own


def _reduced(tensors, n):
    out = [t.clone() for t in tensors]
    for t in out:
        dist.all_reduce(t)
    return [t / n for t in out]


WRONG = {
    "sign is flipped": lambda b, a, n: _reduced([y - x for x, y in zip(b, a)], n),
    "summed over the ranks": lambda b, a, n: _reduced([2 * (x - y) for x, y in zip(b, a)], n),
    "this rank's Δ alone": lambda b, a, n: [x - y for x, y in zip(b, a)],
    "divided by world_size but never all-reduced": lambda b, a, n: [
        (x - y) / n for x, y in zip(b, a)
    ],
    "average of the weights": lambda b, a, n: _reduced(a, n),
    "in place": lambda b, a, n: [_reduced([x.sub_(y)], n)[0] for x, y in zip(b, a)],
    "returned NoneType": lambda b, a, n: None,
}


def _max_then_divide(before, after, n):
    # the reviewer's wrong answer: an all-reduce that takes the largest, not the sum
    out = [x - y for x, y in zip(before, after)]
    for t in out:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [t / n for t in out]


WRONG["not a sum"] = _max_then_divide


@pytest.mark.parametrize("mistake", list(WRONG))
def test_each_wrong_pseudo_gradient_fails_with_its_own_message(mistake):
    with pytest.raises(CheckFailed, match=mistake):
        checks.check_pseudo_gradient(WRONG[mistake])


# ----------------------------------------------------------------- pure pieces
def test_fragments_are_contiguous_non_empty_and_balanced(diloco_module):
    params = [torch.zeros(n) for n in (10, 500, 30, 400, 60, 7, 300)]
    for f in (1, 2, 3, 7):
        groups = diloco_module.split(params, f)
        assert [p for g in groups for p in g] == params  # every tensor once, in order
        assert len(groups) == f and all(groups)
    two = [sum(p.numel() for p in g) for g in diloco_module.split(params, 2)]
    assert max(two) < 0.75 * sum(two)
    with pytest.raises(ValueError):
        diloco_module.split(params, 8)


def test_predicted_bytes_follow_the_fragment_schedule():
    assert checks.diloco_bytes(8, 4, [100]) == [0, 0, 0, 400, 0, 0, 0, 400]
    assert checks.diloco_bytes(8, 4, [100, 30]) == [0, 400, 0, 120, 0, 400, 0, 120]
    assert checks.diloco_bytes(3, 1, [5]) == [20, 20, 20]


def test_train_diloco_keeps_the_signature_compare_methods_calls(diloco_module):
    """scripts/compare_methods.py (notebook 5) imports it: train_diloco(args, batches,
    device, period, fragments=1, outer_lr=..., outer_momentum=...) -> (run, weights)."""
    params = inspect.signature(diloco_module.train_diloco).parameters
    assert list(params) == [
        "args",
        "batches",
        "device",
        "period",
        "fragments",
        "outer_lr",
        "outer_momentum",
    ]
    assert params["fragments"].default == 1
