"""Lab 4.8: the top-k router exercise and its check (wrong routers fail it), the MoE layer's
routing groups, the load-balancing loss, and scripts/experts.py under torchrun with 4
processes: equal to one process, all-to-all bytes against the formula (a wrong count fails
the check), the checkpoint rebuilt, a process count that does not fit, --help."""

import copy

import pytest
import torch
from conftest import REPO, launch_quick, script_help, script_stop, tiny_transformer

import lab4_checks as checks
import lab4_solutions as solutions
from lab_utils import models, moe
from lab_utils.checks import CheckFailed

SCRIPT = REPO / "labs" / "lab4_model_parallel" / "scripts" / "experts.py"
TINY = tiny_transformer(steps=2)


def test_reference_router_passes_its_check():
    checks.check_top_k_route(solutions.top_k_route)


def _unnormalised(logits, k, cap):
    experts, gates, slots, kept = solutions.top_k_route(logits, k, cap)
    return experts, torch.softmax(logits, -1).gather(1, experts), slots, kept


def _token_major(logits, k, cap):  # slots counted token by token, second choices mixed in
    experts, gates, _, _ = solutions.top_k_route(logits, k, cap)
    onehot = torch.nn.functional.one_hot(experts.reshape(-1), logits.shape[1])
    slots = ((onehot.cumsum(0) - 1) * onehot).sum(-1).view_as(experts)
    return experts, gates, slots, slots < cap


def _off_by_one(logits, k, cap):
    experts, gates, slots, _ = solutions.top_k_route(logits, k, cap)
    return experts, gates, slots, slots <= cap


@pytest.mark.parametrize("wrong", [_unnormalised, _token_major, _off_by_one])
def test_wrong_routers_fail_the_check(wrong):
    with pytest.raises(CheckFailed):
        checks.check_top_k_route(wrong)


def test_groups_route_each_part_alone():
    """groups = n equals the layer applied to each of the n parts on its own (what the
    ranks of an expert-parallel job do)."""
    torch.manual_seed(0)
    layer = moe.MoE(8, 4, 16, top_k=2, capacity_factor=1.0)
    x = torch.randn(2, 12, 8)
    layer.groups = 2
    both = layer(x)
    layer.groups = 1
    parts = torch.cat([layer(x[:1]), layer(x[1:])])
    assert torch.allclose(both, parts, atol=1e-6)
    layer.groups = 2
    layer(x)
    assert layer.stats["capacity"] == moe.capacity(12, 4, 2, 1.0) == 6
    assert sum(layer.stats["tokens_per_expert"]) == 2 * 12 * 2


def test_dropped_choices_give_zero_and_count():
    torch.manual_seed(1)
    layer = moe.MoE(4, 2, 8, top_k=1, capacity_factor=0.5)
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[0, 0] = 10.0
    x = torch.zeros(8, 4)
    x[:, 0] = 1.0  # every token prefers expert 0, which has 2 slots
    y = layer(x)
    assert layer.stats["dropped"] == 8 - 2
    assert torch.count_nonzero(y.abs().sum(1)) == 2


def test_load_balancing_loss_is_one_when_uniform_and_grows_with_skew():
    probs = torch.full((8, 4), 0.25)
    experts = torch.arange(8).remainder(4).unsqueeze(1)
    assert moe.load_balancing_loss(probs, experts, 4).item() == pytest.approx(1.0)
    skew = torch.tensor([[0.7, 0.1, 0.1, 0.1]]).repeat(8, 1)
    assert moe.load_balancing_loss(
        skew, torch.zeros(8, 1, dtype=torch.long), 4
    ).item() == pytest.approx(2.8)


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("moe") / "moe.pt"
    result = launch_quick(SCRIPT, [*TINY, "--experts", "4", "--checkpoint", ckpt], nprocs=4)
    assert result.ok, result.output
    return result.event("experts"), ckpt


def test_four_processes_equal_one_and_count_bytes(four):
    run, _ = four
    checks.check_moe_run(run)
    assert run["owned_by_rank0"] == [0]
    assert run["errors"]["gradients"] < 1e-5


@pytest.mark.parametrize(
    "field, value",
    [
        ("formula_bytes", lambda r: r["formula_bytes"] // 2),
        ("errors", lambda r: dict(r["errors"], gradients=0.1)),
        ("all_to_all_bytes", lambda r: r["all_to_all_bytes"][:2]),
    ],
)
def test_a_wrong_run_fails_the_check(four, field, value):
    run = copy.deepcopy(four[0])
    run[field] = value(run)
    with pytest.raises(CheckFailed):
        checks.check_moe_run(run)


def test_checkpoint_rebuilds_the_trained_model(four):
    model = models.load(four[1])
    assert isinstance(model, moe.MoECharTransformer)
    assert len(model.layers[1].moe.experts) == 4


def test_process_count_that_does_not_fit_stops_cleanly(monkeypatch, capsys):
    # as rank 0 of 3 under torchrun, before any process group (test_lab4.py runs that
    # path under torchrun itself)
    argv = [*TINY, "--experts", "4"]
    assert script_stop(monkeypatch, SCRIPT, argv, world_size=3) == 2
    assert "error: --experts 4 cannot be spread over 3 processes" in capsys.readouterr().err


def test_help_shows_the_profile_defaults(monkeypatch):
    out = script_help(monkeypatch, SCRIPT)
    assert "--capacity-factor" in out and "'quick' profile" in out
