"""lab_utils.planner against measurement: parameter counts, one process's state and saved
activations (exact), FSDP2's padded shards on 4 ranks and a (2 × 2) FSDP × tensor-parallel
mesh measured from the real wrappers on a fake process group (exact; the unpadded ZeRO
formula fails the same check), the expert-parallel state, the widget headless, GPT-3."""

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import REPO

from lab_utils import memory, models, moe, parallel, planner, text
from lab_utils.checks import CheckFailed
from lab_utils.checks import lab4 as checks


def config(d=36, layers=2, seq=20, **kw):
    return planner.Config(
        vocab=text.VOCAB, d_model=d, n_layers=layers, n_heads=4, seq_len=seq, **kw
    )


def char_model(cfg):
    torch.manual_seed(0)
    return models.build(
        "char_transformer",
        vocab=cfg.vocab,
        d_model=cfg.d_model,
        n_heads=cfg.n_heads,
        n_layers=cfg.n_layers,
        max_len=cfg.seq_len,
    )


@pytest.mark.parametrize("d, layers", [(32, 1), (36, 2), (64, 3)])
def test_parameter_count_and_one_process_state_are_exact(d, layers):
    cfg = config(d, layers)
    model = char_model(cfg)
    assert planner.count_params(cfg) == sum(p.numel() for p in model.parameters())
    opt = torch.optim.Adam(model.parameters())
    x = torch.randint(0, cfg.vocab, (2, cfg.seq_len))
    parallel.lm_loss(model(x), x).backward()
    opt.step()
    p = planner.plan(cfg, planner.Layout(), batch=2)
    assert memory.state_bytes(model, opt) == {
        "params": p.params,
        "grads": p.grads,
        "optimizer": p.optimizer,
    }


@pytest.mark.parametrize("b, seq, d, layers", [(2, 16, 32, 1), (3, 20, 36, 2), (4, 32, 64, 2)])
def test_activation_bytes_are_exact(b, seq, d, layers):
    cfg = config(d, layers, seq)
    model = char_model(cfg)
    x = torch.randint(0, cfg.vocab, (b, seq))
    saved = memory.activation_bytes(lambda: parallel.lm_loss(model(x), x), model.parameters())
    assert planner.plan(cfg, planner.Layout(), batch=b).activations == saved


def test_moe_parameter_count_is_exact():
    cfg = config(32, 2, 16, n_experts=4, top_k=2)
    model = models.build(
        "moe_char_transformer",
        vocab=cfg.vocab,
        d_model=32,
        n_heads=4,
        n_layers=2,
        max_len=16,
        n_experts=4,
    )
    assert planner.count_params(cfg) == sum(p.numel() for p in model.parameters())
    assert (
        planner.expert_values(cfg, planner.Layout(dp=2, ep=2), 0)
        == sum(p.numel() for n, p in model.named_parameters() if moe.is_expert_param(n)) // 2
    )


FAKE = textwrap.dedent("""
    import json, sys, warnings
    warnings.simplefilter("ignore")
    import torch, torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module
    sys.path.insert(0, "labs/lab4_model_parallel/scripts")
    from tensor_parallel import tp_plan
    from lab_utils import models, memory, text
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    def measured(model, mesh):
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.Adam(model.parameters())
        model(torch.randint(0, text.VOCAB, (2, 18))).sum().backward()
        opt.step()
        return memory.state_bytes(model, opt)
    def build(d):
        return models.build("char_transformer", vocab=text.VOCAB, d_model=d, n_heads=4, n_layers=2, max_len=18)
    out = {"fsdp4": measured(build(20), init_device_mesh("cpu", (4,)))}
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    out["dp2tp2"] = measured(parallelize_module(build(36), mesh["tp"], tp_plan(2)), mesh["dp"])
    print(json.dumps(out))
""")


@pytest.fixture(scope="module")
def fake_measured():
    """FSDP2 and DTensor on rank 0 of a fake 4-rank group: the real wrappers allocate the
    real shards; the collectives move nothing (only the bytes held are used here)."""
    done = subprocess.run(
        [sys.executable, "-c", FAKE], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def rows(plan, measured):
    return [
        {"what": k, "predicted": getattr(plan, k), "measured": measured[k], "margin": 0.0}
        for k in ("params", "grads", "optimizer")
    ]


def test_fsdp_padded_shards_and_2d_mesh_are_exact(fake_measured):
    fsdp = planner.plan(config(20, 2, 18), planner.Layout(dp=4, zero=3), batch=4)
    hybrid = planner.plan(config(36, 2, 18), planner.Layout(dp=2, tp=2, zero=3), batch=4)
    assert (
        checks.check_predictions(
            rows(fsdp, fake_measured["fsdp4"]) + rows(hybrid, fake_measured["dp2tp2"])
        )
        == 0.0
    )


def test_the_unpadded_formula_fails_the_same_check(fake_measured):
    """18 positions on 4 ranks: FSDP2 pads to 20; Ψ/4 is short of what rank 0 holds."""
    cfg = config(20, 2, 18)
    unpadded = memory.zero_bytes_per_rank(planner.count_params(cfg), 4, 3)
    with pytest.raises(CheckFailed):
        checks.check_predictions(
            [
                {
                    "what": k,
                    "predicted": unpadded[k],
                    "measured": fake_measured["fsdp4"][k],
                    "margin": 0.0,
                }
                for k in unpadded
            ]
        )


def test_the_widget_renders_headless():
    panel, update = planner.widget(config(), batch=4)
    assert "per rank: parameters" in update()
    panel.children[0].children[0].value = 3  # dp = 3 does not split a batch of 4
    assert "not a valid layout" in update()


def test_gpt3_layout_fits_and_training_time():
    lay = planner.Layout(
        dp=8, tp=8, pp=16, zero=1, precision="bf16", recompute="full", microbatches=64
    )
    p = planner.plan(planner.GPT3, lay, batch=1536)
    assert 174e9 < p.n_params < 176e9 and p.total < 80e9
    assert planner.training_days(175e9, 300e9, 1024, 1e15, 0.5) == pytest.approx(
        6 * 175e9 * 300e9 / (1024 * 1e15 * 0.5) / 86400
    )
    with pytest.raises(ValueError):
        planner.plan(planner.GPT3, planner.Layout(tp=5), batch=8)
