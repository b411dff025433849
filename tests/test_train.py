import math

import pytest
import torch
from torch import nn

from lab_utils import metrics
from lab_utils.train import Callback, StepTimer, Trainer, evaluate


class ShuffledBatches:
    """A tiny deterministic loader: reshuffled per epoch like TensorLoader."""

    def __init__(self, x, y, batch_size, seed=0):
        self.x, self.y, self.batch_size, self.seed, self.epoch = x, y, batch_size, seed, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __len__(self):
        return math.ceil(len(self.x) / self.batch_size)

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed * 1000 + self.epoch)
        order = torch.randperm(len(self.x), generator=g)
        for i in range(0, len(order), self.batch_size):
            idx = order[i : i + self.batch_size]
            yield self.x[idx], self.y[idx]


def blobs(n=256, d=8, classes=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(classes, d, generator=g) * 3
    y = torch.randint(0, classes, (n,), generator=g)
    return centres[y] + torch.randn(n, d, generator=g), y


def make(seed=0, dropout=0.0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(dropout), nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return model, opt


def test_fit_learns_and_records_history(tmp_path):
    x, y = blobs()
    model, opt = make()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    path = tmp_path / "metrics.jsonl"
    trainer = Trainer(model, opt, scheduler=sched, progress=False, metrics_path=path)
    history = trainer.fit(ShuffledBatches(x, y, 32), epochs=3, val_loader=ShuffledBatches(x, y, 64))
    assert [r["epoch"] for r in history.epochs] == [1, 2, 3]
    assert len(history.steps) == trainer.step == 3 * 8
    assert history.steps[-1]["lr"] == pytest.approx(0.1 / (1 + 23))  # stepped per batch
    assert history.last["val_acc"] > 0.9
    assert history.column("train_loss")[0] > history.column("train_loss")[-1]
    assert [r["epoch"] for r in metrics.read(path)] == [1, 2, 3]


def test_evaluate_counts_exactly():
    x, y = blobs(n=101)
    model, _ = make()
    out = model(x)
    expected = (out.argmax(1) == y).sum().item() / 101
    res = evaluate(model, ShuffledBatches(x, y, 10))
    assert res["n"] == 101
    assert res["acc"] == pytest.approx(expected, abs=1e-12)
    assert res["loss"] == pytest.approx(nn.functional.cross_entropy(out, y).item(), rel=1e-5)


def test_resume_continues_exactly_where_it_stopped(tmp_path):
    x, y = blobs()
    model_a, opt_a = make(dropout=0.2)
    Trainer(model_a, opt_a, progress=False).fit(ShuffledBatches(x, y, 32), epochs=2)

    model_b, opt_b = make(dropout=0.2)
    first = Trainer(model_b, opt_b, progress=False, checkpoint_path=tmp_path / "ck.pt")
    first.fit(ShuffledBatches(x, y, 32), epochs=1)
    torch.manual_seed(1234)  # the RNG must come back from the checkpoint, not from here
    model_c, opt_c = make(seed=99, dropout=0.2)
    resumed = Trainer(model_c, opt_c, progress=False)
    resumed.load_checkpoint(tmp_path / "ck.pt")
    assert resumed.epoch == 1 and resumed.step == 8
    resumed.fit(ShuffledBatches(x, y, 32), epochs=2)
    for pa, pc in zip(model_a.parameters(), model_c.parameters()):
        torch.testing.assert_close(pa, pc, rtol=0, atol=1e-6)
    assert len(resumed.history.epochs) == 2


@pytest.mark.parametrize("n", [128, 120])  # 120: the last group has 3 micro-batches, not 4
def test_gradient_accumulation_equals_the_big_batch(n: int):
    x, y = blobs(n=n)
    big_model, big_opt = make()
    big_opt = torch.optim.SGD(big_model.parameters(), lr=0.1)
    Trainer(big_model, big_opt, progress=False).fit(
        [(x[i : i + 32], y[i : i + 32]) for i in range(0, n, 32)], epochs=1
    )
    acc_model, _ = make()
    acc_opt = torch.optim.SGD(acc_model.parameters(), lr=0.1)
    micro = [(x[i : i + 8], y[i : i + 8]) for i in range(0, n, 8)]
    trainer = Trainer(acc_model, acc_opt, progress=False, grad_accum_steps=4)
    trainer.fit(micro, epochs=1)
    assert trainer.step == 4
    for pb, pa in zip(big_model.parameters(), acc_model.parameters()):
        torch.testing.assert_close(pb, pa, rtol=0, atol=1e-6)


def test_time_budget_stops_cleanly():
    x, y = blobs(n=4096)
    model, opt = make()
    trainer = Trainer(model, opt, progress=False, max_seconds=0.0, sync_every=1)
    trainer.fit(ShuffledBatches(x, y, 8), epochs=50)
    assert trainer.stop_training and "time budget" in trainer.stop_reason
    assert trainer.step == 1 and trainer.epoch == 1


def test_callbacks_see_every_hook_and_can_stop():
    x, y = blobs()
    calls = []

    class Spy(Callback):
        def on_fit_start(self, t):
            calls.append("fit_start")

        def on_epoch_start(self, t, epoch):
            calls.append(f"epoch_start{epoch}")

        def on_batch_end(self, t, step, loss):
            assert loss.dim() == 0
            if step == 5:
                t.stop_training = True

        def on_epoch_end(self, t, epoch, logs):
            calls.append(f"epoch_end{epoch}")

        def on_fit_end(self, t):
            calls.append("fit_end")

    model, opt = make()
    trainer = Trainer(model, opt, progress=False, callbacks=[Spy()])
    trainer.fit(ShuffledBatches(x, y, 32), epochs=10)
    assert trainer.step == 5
    assert calls == ["fit_start", "epoch_start0", "epoch_end1", "fit_end"]


def test_divergence_is_reported_not_hidden():
    x, y = blobs()
    model, _ = make()
    opt = torch.optim.SGD(model.parameters(), lr=1e6)
    trainer = Trainer(model, opt, progress=False, sync_every=1)
    with pytest.raises(FloatingPointError, match="not finite"):
        trainer.fit(ShuffledBatches(x * 1e3, y, 32), epochs=5)


def test_bad_arguments():
    model, opt = make()
    with pytest.raises(ValueError):
        Trainer(model, opt, grad_accum_steps=0)
    with pytest.raises(ValueError, match="empty"):
        evaluate(model, [])


def test_progress_bar_total_follows_a_batch_that_grows(monkeypatch):
    import io

    import tqdm.auto

    bars = []

    class Recorded(tqdm.auto.tqdm):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, file=io.StringIO(), **kwargs)
            bars.append(self)

    class Doubling(Callback):
        def on_epoch_start(self, trainer, epoch):
            loader.batch_size = 16 * 2**epoch

    monkeypatch.setattr(tqdm.auto, "tqdm", Recorded)
    x, y = blobs(n=128)
    loader = ShuffledBatches(x, y, 16)
    model, opt = make()
    trainer = Trainer(model, opt, progress=True, callbacks=[Doubling()])
    trainer.fit(loader, epochs=3)
    assert trainer.step == 8 + 4 + 2
    assert bars[0].n == bars[0].total == trainer.step  # not 3 x 8 steps, as at the start


def test_step_timer_skips_each_epochs_first_step_and_stops_at_max_steps():
    x, y = blobs(n=128)
    model, opt = make()
    timer = StepTimer(max_steps=6)
    trainer = Trainer(model, opt, progress=False, callbacks=[timer], sync_every=1)
    trainer.fit(ShuffledBatches(x, y, 32), epochs=5)  # 4 steps an epoch
    assert trainer.step == 6 and trainer.stop_training
    assert timer.steps == 4  # steps 2-4 of epoch 1 and step 2 of epoch 2
    assert timer.seconds > 0
