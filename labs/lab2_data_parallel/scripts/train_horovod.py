"""Train a small classifier on Fashion-MNIST or CIFAR-10 with Horovod.

train_serial.py made data-parallel with Horovod; each change is marked [1]..[7].

    horovodrun -np 2 -H localhost:2 --gloo python train_horovod.py
    mpirun -np 2 python train_horovod.py

Events (rank 0 emits them; a notebook reads them with ``result.event(name)``):
    eval: step, seconds, val_acc (each evaluation, common.look)
    summary: script, world_size, launcher, steps, lr, global_batch, samples_per_s,
        train_loss, val_acc, train_seconds
"""

import os  # [2]
import time

import common
import horovod.torch as hvd  # [1]
import torch
import torch.nn.functional as F

from lab_utils import data, metrics, models, optim  # [5]
from lab_utils.dist import detect  # [6]
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
    return hvd.allreduce(sums, op=hvd.Sum, name="eval")  # [7] add up every rank's part



def main() -> None:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--lr-scaling", choices=optim.SCALING_RULES, default="linear",  # [5]
                   help="N processes use N × lr (linear), √N × lr (sqrt) or lr (none)")
    p.add_argument("--warmup-epochs", type=float, default=common.WARMUP_EPOCHS,  # [5]
                   help="epochs over which the learning rate rises from lr to its scaled value")
    args = common.parse_args(p)
    hvd.init()  # [1] Horovod's own communication (MPI or Gloo): no torch process group
    torch.manual_seed(args.seed)
    if torch.cuda.is_available():  # [2] one GPU per process
        device = torch.device("cuda", hvd.local_rank())
        torch.cuda.set_device(device)
    else:  # [2] or a fair share of the CPU cores
        device = torch.device("cpu")
        torch.set_num_threads(max(1, os.cpu_count() // hvd.local_size()))

    ds = data.load(args.dataset).subset(args.n_train or None, args.n_test or None)
    train = TensorLoader.from_dataset(ds, "train", args.batch_size, seed=args.seed,
                                      augment=args.augment, device=device,
                                      rank=hvd.rank(), world_size=hvd.size())  # [3] my shard
    test = TensorLoader.from_dataset(ds, "test", 512, device=device,
                                     rank=hvd.rank(), world_size=hvd.size())  # [3] my part

    model = common.build_model(args).to(device)
    torch.manual_seed(args.seed + hvd.rank())  # [2] different augmentations on each rank
    # [5] N× the batch per step: N× the learning rate, warmed up (see train_ddp.py)
    lr = optim.scale_lr(args.lr, args.batch_size, args.batch_size * hvd.size(), args.lr_scaling)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9,
                                weight_decay=args.weight_decay)
    # [4] average gradients with all-reduce during backward; start every rank from rank 0's state
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)  # [4]
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)  # [4]
    total = common.total_steps(args, len(train))  # the rate follows a cosine down to 0
    warm = min(total, round(args.warmup_epochs * len(train)))  # [5]
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, optim.lr_schedule(
        total, warmup_steps=warm, warmup_start=args.lr / lr, decay="cosine"))  # [5]

    step, start, paused = 0, time.perf_counter(), 0.0  # paused: seconds spent evaluating
    for epoch in range(args.epochs):
        train.set_epoch(epoch)  # a new shuffle every epoch
        train_sums = torch.zeros(2, dtype=torch.float64, device=device)  # loss, steps
        for x, y in train:
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            schedule.step()  # [5]
            step += 1
            train_sums += torch.stack([loss.detach().double(), torch.ones((), device=device)])
            if step == 1:
                start = time.perf_counter()  # time from the second step: the first warms up
            if args.eval_every and step % args.eval_every == 0:  # accuracy against time
                trained = time.perf_counter() - start - paused
                paused += common.look(evaluate, model, test, step, trained, hvd.rank() == 0)  # [6]
            if step == args.max_steps:
                break
        seconds = time.perf_counter() - start - paused  # training time: evaluations left out
        train_sums = hvd.allreduce(train_sums, op=hvd.Sum, name="train_loss")  # [7]
        loss_sum, n_steps = train_sums.tolist()
        evaluated = time.perf_counter()
        test_loss, correct, n = evaluate(model, test).tolist()
        paused += time.perf_counter() - evaluated
        if hvd.rank() == 0:  # [6] one rank reports
            print(f"epoch {epoch + 1}: train_loss {loss_sum / n_steps:.4f}  "
                  f"val_loss {test_loss / n:.4f}  val_acc {correct / n:.2%}", flush=True)
        if step == args.max_steps:
            break

    if args.checkpoint and hvd.rank() == 0:  # [6] one rank saves
        models.save(args.checkpoint, model)
    global_batch = args.batch_size * hvd.size()  # [7] samples per step, all ranks together
    samples_per_s = (step - 1) * global_batch / max(seconds, 1e-9)
    summary = {"event": "summary", "script": "horovod", "world_size": hvd.size(), "launcher": detect().launcher,
               "steps": step, "lr": lr, "global_batch": global_batch, "samples_per_s": samples_per_s,
               "train_loss": loss_sum / n_steps, "val_acc": correct / n, "train_seconds": seconds}
    if hvd.rank() == 0:  # [6] one rank writes and prints
        metrics.emit(summary)
        print(f"{step} steps, {samples_per_s:.0f} samples/s, val_acc {correct / n:.2%}",
              flush=True)

if __name__ == "__main__":
    main()
