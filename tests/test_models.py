"""Model registry, builds, forward shapes and checkpoints."""

import pickle
from pathlib import Path

import pytest
import torch
from torch import nn

from lab_utils import models
from lab_utils.models import CheckpointError

SMALL = {"fmnist_cnn": {"width": 4}, "resnet_cifar": {"width": 4}, "mlp": {"hidden": (16,)}}
# The library's own models (other code may register more in the same session).
BUILT_IN = sorted(n for n, f in models._REGISTRY.items() if f.__module__ == models.__name__)
# Models over character ids, not images (tested in tests/test_lab4.py).
TEXT_MODELS = {"char_transformer"}


def small(arch: str, **kwargs) -> nn.Module:
    return models.build(arch, **{**SMALL.get(arch, {}), **kwargs})


def test_the_documented_models_are_registered():
    assert {"linear", "mlp", "fmnist_cnn", "resnet_cifar"} <= set(BUILT_IN) <= set(models.names())


@pytest.mark.parametrize("arch", [a for a in BUILT_IN if a not in TEXT_MODELS])
@pytest.mark.parametrize("channels, size, classes", [(1, 28, 10), (3, 32, 7)])
def test_every_model_runs_forward_on_its_input_shape(arch, channels, size, classes):
    kwargs = {"in_channels": channels, "num_classes": classes}
    if "image_size" in small(arch).arch_spec["kwargs"]:
        kwargs["image_size"] = size
    model = small(arch, **kwargs)
    out = model(torch.randn(2, channels, size, size))
    assert out.shape == (2, classes) and out.dtype == torch.float32
    out.sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_arch_spec_records_every_argument_with_defaults():
    model = models.build("fmnist_cnn", width=8)
    assert model.arch_spec == {
        "arch": "fmnist_cnn",
        "kwargs": {
            "in_channels": 1,
            "image_size": 28,
            "num_classes": 10,
            "width": 8,
            "batch_norm": True,
        },
    }


def test_batch_norm_switch():
    with_bn = small("fmnist_cnn")
    without = small("fmnist_cnn", batch_norm=False)
    assert any(isinstance(m, nn.BatchNorm2d) for m in with_bn.modules())
    assert not any(isinstance(m, nn.BatchNorm2d) for m in without.modules())
    assert not any(
        isinstance(m, nn.BatchNorm2d) for m in small("resnet_cifar", batch_norm=False).modules()
    )


def test_wrong_input_shape_says_what_was_expected():
    with pytest.raises(ValueError, match=r"expects images \(N, 1, 28, 28\)"):
        small("mlp")(torch.randn(2, 3, 32, 32))


def test_build_errors_are_clear():
    with pytest.raises(ValueError, match="unknown model 'nope'.*linear"):
        models.build("nope")
    with pytest.raises(TypeError, match="fmnist_cnn.*depth"):
        models.build("fmnist_cnn", depth=3)


def test_register_refuses_a_different_model_under_a_taken_name():
    with pytest.raises(ValueError, match="already registered"):
        models.register("linear")(nn.Identity)


def test_checkpoint_round_trip_gives_equal_outputs(tmp_path):
    torch.manual_seed(0)
    model = small("resnet_cifar", in_channels=1)
    model(torch.randn(4, 1, 28, 28))  # move the BatchNorm running statistics off their init
    model.eval()
    path = models.save(tmp_path / "sub" / "model.pt", model, epoch=3, note="ok")
    loaded = models.load(path)
    assert type(loaded) is type(model) and not loaded.training
    assert loaded.arch_spec == model.arch_spec
    x = torch.randn(3, 1, 28, 28)
    torch.testing.assert_close(loaded(x), model(x), rtol=0, atol=0)
    ckpt = models.read_checkpoint(path)
    assert ckpt["epoch"] == 3 and ckpt["note"] == "ok"
    assert list(tmp_path.joinpath("sub").iterdir()) == [path]  # no temporary file left


def test_checkpoint_unwraps_and_copies_to_cpu():
    model = small("mlp")
    wrapped = nn.DataParallel(model)
    ckpt = models.checkpoint(wrapped)
    assert set(ckpt["state_dict"]) == set(model.state_dict())  # no "module." prefix
    before = ckpt["state_dict"]["net.0.weight"].clone()
    with torch.no_grad():
        model.net[0].weight.add_(1)
    assert torch.equal(ckpt["state_dict"]["net.0.weight"], before)


def test_checkpoint_refuses_unbuilt_models_and_unsafe_kwargs():
    with pytest.raises(ValueError, match="not made by"):
        models.checkpoint(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="may not be named"):
        models.checkpoint(small("linear"), state_dict={})
    model = small("linear")
    model.arch_spec["kwargs"]["activation"] = nn.ReLU()
    with pytest.raises(ValueError, match="cannot be stored"):
        models.checkpoint(model)


def save_raw(path: Path, obj) -> Path:
    torch.save(obj, path)
    return path


def test_load_errors_are_clear(tmp_path):
    model = small("mlp")
    good = models.checkpoint(model)
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        models.load(tmp_path / "missing.pt")
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="not a readable PyTorch checkpoint"):
        models.load(tmp_path / "junk.pt")
    with pytest.raises(CheckpointError, match="expected a dict"):
        models.load(save_raw(tmp_path / "list.pt", [1, 2]))
    with pytest.raises(CheckpointError, match="bare model.state_dict"):
        models.load(save_raw(tmp_path / "bare.pt", model.state_dict()))
    with pytest.raises(CheckpointError, match="unknown architecture 'gone'"):
        models.load(save_raw(tmp_path / "arch.pt", {**good, "arch": "gone"}))
    with pytest.raises(CheckpointError, match="cannot build mlp"):
        models.load(save_raw(tmp_path / "kw.pt", {**good, "kwargs": {"depth": 2}}))
    other = models.checkpoint(small("mlp", hidden=(8,)))
    with pytest.raises(CheckpointError, match=r"(?s)weights do not fit mlp.*size mismatch"):
        models.load(save_raw(tmp_path / "shape.pt", {**good, "state_dict": other["state_dict"]}))
    partial = {k: v for k, v in good["state_dict"].items() if not k.endswith("bias")}
    with pytest.raises(CheckpointError, match="Missing key"):
        models.load(save_raw(tmp_path / "partial.pt", {**good, "state_dict": partial}))


class _Payload:
    """Unpickling this object creates a file: the proof that code ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_a_malicious_pickle_is_refused_not_run(tmp_path):
    marker = tmp_path / "code-ran"
    path = save_raw(
        tmp_path / "evil.pt", {**models.checkpoint(small("linear")), "extra": _Payload(marker)}
    )
    with pytest.raises(CheckpointError, match="refused to load.*Unsupported global"):
        models.load(path)
    assert not marker.exists()
    # The payload is real: an unsafe load runs it.
    torch.load(path, weights_only=False)
    assert marker.exists()


def test_a_plain_pickle_file_is_not_a_checkpoint(tmp_path):
    path = tmp_path / "plain.pkl"
    path.write_bytes(pickle.dumps({"arch": "linear"}, protocol=2))
    with pytest.raises(CheckpointError, match="not a readable PyTorch checkpoint"):
        models.load(path)
