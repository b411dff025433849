"""Train a small classifier on Fashion-MNIST or CIFAR-10 in one process.

The serial baseline of Lab 2: train_ddp.py and train_horovod.py are this script
with the changes that make it data-parallel.

    python train_serial.py --dataset fashion-mnist --epochs 2

Events (rank 0 emits them; a notebook reads them with ``result.event(name)``):
    eval: step, seconds, val_acc (each evaluation, common.look)
    summary: script, world_size, steps, lr, global_batch, samples_per_s, train_loss,
        val_acc, train_seconds
"""

import time

import common
import torch
import torch.nn.functional as F

from lab_utils import data, metrics, models, optim, profile
from lab_utils.loader import TensorLoader


@torch.no_grad()
def evaluate(model: torch.nn.Module, loader: TensorLoader) -> torch.Tensor:
    """Sums over the test set: loss, correct predictions, images."""
    model.eval()
    sums = torch.zeros(3, dtype=torch.float64, device=loader.device)
    for x, y in loader:
        out = model(x)
        sums += torch.stack([F.cross_entropy(out, y, reduction="sum"),
                             (out.argmax(1) == y).sum(), torch.tensor(len(y), device=x.device)])
    model.train()
    return sums



def main() -> None:
    args = common.parse_args(common.parser(__doc__.splitlines()[0]))
    torch.manual_seed(args.seed)
    device = profile.device()

    ds = data.load(args.dataset).subset(args.n_train or None, args.n_test or None)
    train = TensorLoader.from_dataset(ds, "train", args.batch_size, seed=args.seed,
                                      augment=args.augment, device=device)
    test = TensorLoader.from_dataset(ds, "test", 512, device=device)

    model = common.build_model(args).to(device)
    lr = args.lr
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9,
                                weight_decay=args.weight_decay)
    total = common.total_steps(args, len(train))  # the rate follows a cosine down to 0
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, optim.lr_schedule(total, decay="cosine"))

    step, start, paused = 0, time.perf_counter(), 0.0  # paused: seconds spent evaluating
    for epoch in range(args.epochs):
        train.set_epoch(epoch)  # a new shuffle every epoch
        train_sums = torch.zeros(2, dtype=torch.float64, device=device)  # loss, steps
        for x, y in train:
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            schedule.step()
            step += 1
            train_sums += torch.stack([loss.detach().double(), torch.ones((), device=device)])
            if step == 1:
                start = time.perf_counter()  # time from the second step: the first warms up
            if args.eval_every and step % args.eval_every == 0:  # accuracy against time
                trained = time.perf_counter() - start - paused
                paused += common.look(evaluate, model, test, step, trained, True)
            if step == args.max_steps:
                break
        seconds = time.perf_counter() - start - paused  # training time: evaluations left out
        loss_sum, n_steps = train_sums.tolist()
        evaluated = time.perf_counter()
        test_loss, correct, n = evaluate(model, test).tolist()
        paused += time.perf_counter() - evaluated
        print(f"epoch {epoch + 1}: train_loss {loss_sum / n_steps:.4f}  "
              f"val_loss {test_loss / n:.4f}  val_acc {correct / n:.2%}", flush=True)
        if step == args.max_steps:
            break

    if args.checkpoint:
        models.save(args.checkpoint, model)
    global_batch = args.batch_size
    samples_per_s = (step - 1) * global_batch / max(seconds, 1e-9)
    summary = {"event": "summary", "script": "serial", "world_size": 1,
               "steps": step, "lr": lr, "global_batch": global_batch, "samples_per_s": samples_per_s,
               "train_loss": loss_sum / n_steps, "val_acc": correct / n, "train_seconds": seconds}
    metrics.emit(summary)
    print(f"{step} steps, {samples_per_s:.0f} samples/s, val_acc {correct / n:.2%}", flush=True)

if __name__ == "__main__":
    main()
