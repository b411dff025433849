"""Train the Lab 2 Horovod model inside a Spark cluster with horovod.spark.run.

Spark prepares the data (a DataFrame written as Parquet); horovod.spark.run starts one
Horovod rank in each of --num-proc Spark tasks, and each rank trains exactly as
train_horovod.py does. By default a standalone cluster (a master and two workers on
127.0.0.1) is started for the run and stopped afterwards, also on Ctrl-C or an error.

    python train_horovod_spark.py                             # its own local cluster
    python train_horovod_spark.py --master spark://host:7077  # an existing cluster

Events (rank 0 emits them; a notebook reads them with ``result.event(name)``):
    epoch: epoch, step, train_loss, train_acc, lr, val_loss, val_acc, time
        (lab_utils.train.Trainer, after each epoch)
    summary: script, world_size, launcher, steps, lr, train_loss, val_acc, elapsed,
        ranks (each rank's result), tasks (the Spark tasks), class_counts
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import common

from lab_utils import data, metrics, profile, spark_cluster


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    D = common.defaults()  # the same defaults as train_horovod.py
    p = profile.script_parser(__doc__.splitlines()[0])
    p.add_argument(
        "--master",
        default=None,
        help="spark://host:7077 of a running cluster (default: start a local one)",
    )
    p.add_argument("--num-proc", type=int, default=2, help="Horovod ranks = Spark tasks")
    p.add_argument("--dataset", choices=("fashion-mnist",), default="fashion-mnist")
    p.add_argument("--epochs", type=int, default=D["epochs"])
    p.add_argument(
        "--batch-size", type=int, default=D["batch_size"], help="samples per step and process"
    )
    p.add_argument(
        "--lr",
        type=float,
        default=D["lr"],
        help="peak learning rate of one process; N processes use N × lr, warmed up",
    )
    p.add_argument(
        "--warmup-epochs",
        type=float,
        default=common.WARMUP_EPOCHS,
        help="epochs over which the learning rate rises to its scaled value",
    )
    p.add_argument("--weight-decay", type=float, default=5e-4)
    p.add_argument(
        "--n-train", type=int, default=D["n_train"], help="training images to use (0: all)"
    )
    p.add_argument("--n-test", type=int, default=D["n_test"], help="test images to use (0: all)")
    p.add_argument("--width", type=int, default=D["width"], help="channels of the first layer")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--store",
        default=None,
        help="folder for the Parquet data, shared by all machines (default: a temp dir)",
    )
    p.add_argument(
        "--timeout", type=float, default=300, help="seconds for the Horovod job to start"
    )
    args = p.parse_args(argv)
    if args.num_proc < 1:
        p.error("--num-proc must be >= 1")
    return args


# ----------------------------------------------------------------------------- Spark side
def prepare(spark: Any, ds: data.Dataset, store: Path) -> dict[str, int]:
    """The images as a Spark DataFrame (id, split, label, image bytes), written as Parquet.

    Returns the training images per class, counted by Spark."""
    from pyspark.sql import functions as F

    rows = [
        (i, split, int(label), bytearray(image.numpy().tobytes()))
        for split, x, y in (("train", ds.x_train, ds.y_train), ("test", ds.x_test, ds.y_test))
        for i, (image, label) in enumerate(zip(x, y))
    ]
    df = spark.createDataFrame(rows, schema="id long, split string, label int, image binary")
    df = df.filter(F.length("image") == 28 * 28)  # a malformed row never reaches training
    df.repartition(2).write.mode("overwrite").partitionBy("split").parquet(str(store))
    counts = (
        spark.read.parquet(str(store))
        .where(F.col("split") == "train")
        .groupBy("label")
        .count()
        .orderBy("label")
        .collect()
    )
    return {int(r["label"]): int(r["count"]) for r in counts}


# ----------------------------------------------------------------------------- each rank
def read_split(store: str, split: str) -> tuple:
    """One split of the Parquet files Spark wrote, as (images, labels) tensors."""
    import numpy as np
    import pyarrow.parquet as pq
    import torch

    t = pq.read_table(store, filters=[("split", "=", split)]).sort_by("id")
    images = np.frombuffer(b"".join(t.column("image").to_pylist()), dtype=np.uint8)
    x = torch.from_numpy(images.copy()).reshape(-1, 1, 28, 28)
    return x, torch.tensor(t.column("label").to_numpy(), dtype=torch.int64)


def shard_loaders(
    args: dict[str, Any], store: str, mean: tuple, std: tuple, rank: int, world_size: int
) -> tuple:
    """This rank's shard of the training images (shuffled) and of the test images."""
    from lab_utils.loader import TensorLoader

    x_train, y_train = read_split(store, "train")
    x_test, y_test = read_split(store, "test")
    shard = {"mean": mean, "std": std, "rank": rank, "world_size": world_size}
    train = TensorLoader(x_train, y_train, args["batch_size"], seed=args["seed"], **shard)
    test = TensorLoader(x_test, y_test, 512, shuffle=False, even_shards=False, **shard)
    return train, test


def fit(model, optimizer, lr: float, args: dict[str, Any], train, test) -> dict[str, Any]:
    """train_horovod.py's schedule (a gradual warm-up to N × lr, then a cosine to 0, as
    in Lab 3) and training loop: steps, seconds, the last loss and accuracy."""
    import torch

    from lab_utils import optim
    from lab_utils.train import StepTimer, Trainer

    timer = StepTimer(0)
    start = time.perf_counter()
    total = args["epochs"] * len(train)
    warm = min(total, round(args["warmup_epochs"] * len(train)))
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        optim.lr_schedule(total, warmup_steps=warm, warmup_start=args["lr"] / lr, decay="cosine"),
    )
    trainer = Trainer(model, optimizer, scheduler=schedule, callbacks=[timer], progress=False)
    history = trainer.fit(train, args["epochs"], val_loader=test)
    return {
        "steps": trainer.step,
        "seconds": time.perf_counter() - start,
        "train_loss": history.last["train_loss"],
        "val_acc": history.last["val_acc"],
    }


def where_this_rank_ran() -> dict[str, Any]:
    """Host, process and Spark executor of this rank: an executor's working folder is
    <work dir>/<app>/<executor id>."""
    import socket

    cwd = os.getcwd()
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "executor_id": os.path.basename(cwd),
        "cwd": cwd,
    }


def train_fn(args: dict[str, Any], store: str, mean: tuple, std: tuple) -> dict[str, Any]:
    """One Horovod rank, run by horovod.spark.run inside a Spark task: the training of
    train_horovod.py, with the images read from the Parquet files Spark wrote."""
    import horovod.torch as hvd
    import torch

    from lab_utils import models, optim

    hvd.init()
    torch.manual_seed(args["seed"])
    train, test = shard_loaders(args, store, mean, std, hvd.rank(), hvd.size())
    model = models.build("fmnist_cnn", width=args["width"], batch_norm=False)
    torch.manual_seed(args["seed"] + hvd.rank())
    # train_horovod.py's rule: N × lr, reached by a gradual warm-up (in fit)
    lr = optim.scale_lr(args["lr"], args["batch_size"], args["batch_size"] * hvd.size(), "linear")
    optimizer = torch.optim.SGD(
        model.parameters(), lr=lr, momentum=0.9, weight_decay=args["weight_decay"]
    )
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    run = fit(model, optimizer, lr, args, train, test)
    return {"rank": hvd.rank(), "size": hvd.size(), **where_this_rank_ran(), "lr": lr, **run}


# ----------------------------------------------------------------------------- driver
def _api(spark: Any) -> str:
    sc = spark.sparkContext
    return f"{sc.uiWebUrl}/api/v1/applications/{sc.applicationId}"


def stage_ids(spark: Any) -> set[int]:
    return {s["stageId"] for s in spark_cluster.get_json(f"{_api(spark)}/stages")}


def where_tasks_ran(spark: Any, before: set[int]) -> list[dict[str, Any]]:
    """The Spark UI's record (its REST API) of the stages run since ``before``: each
    task's executor and host."""
    api = _api(spark)
    executors = {e["id"]: e["hostPort"] for e in spark_cluster.get_json(f"{api}/executors")}
    rows = []
    for stage in spark_cluster.get_json(f"{api}/stages"):
        if stage["stageId"] in before:
            continue
        url = f"{api}/stages/{stage['stageId']}/{stage['attemptId']}/taskList?length=100"
        for t in spark_cluster.get_json(url):
            rows.append(
                {
                    "stage": stage["stageId"],
                    "stage_name": stage["name"].split(" at ")[0],
                    "task": t["index"],
                    "executor_id": t["executorId"],
                    "executor": executors.get(t["executorId"], "?"),
                    "seconds": t.get("duration", 0) / 1000,
                }
            )
    return rows


def session(master: str, num_proc: int) -> Any:
    from pyspark.sql import SparkSession

    python = sys.executable
    os.environ.setdefault("SPARK_LOCAL_IP", spark_cluster.HOST)  # the driver's JVM too
    os.environ.setdefault("PYSPARK_PYTHON", python)  # executors run this environment's Python
    builder = SparkSession.builder.master(master).appName("lab2-horovod-spark")
    for key, value in spark_cluster.session_options().items():  # JVMs that start cheaply
        builder = builder.config(key, value)
    return (
        builder.config("spark.driver.host", spark_cluster.HOST)
        .config("spark.driver.bindAddress", spark_cluster.HOST)
        .config("spark.ui.port", str(spark_cluster.free_port()))
        .config("spark.cores.max", str(num_proc))  # one task slot per Horovod rank
        .config("spark.executor.cores", "1")
        .config("spark.executor.memory", "512m")
        .config("spark.task.cpus", "1")
        .config("spark.task.maxFailures", "1")  # a failed rank fails the job at once
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.executorEnv.PYSPARK_PYTHON", python)
        .config("spark.pyspark.python", python)
        .config("spark.pyspark.driver.python", python)
        .config("spark.executorEnv.PYTHONPATH", os.environ.get("PYTHONPATH", ""))
        .config("spark.sql.execution.arrow.pyspark.enabled", "true")
        .config("spark.sql.shuffle.partitions", "2")
        .getOrCreate()
    )


def run(args: argparse.Namespace, master: str) -> dict[str, Any]:
    import horovod.spark

    ds = data.load(args.dataset).subset(args.n_train or None, args.n_test or None)
    spark = session(master, args.num_proc)
    spark.sparkContext.setLogLevel("ERROR")
    try:
        with contextlib.ExitStack() as stack:
            store = (
                Path(args.store)
                if args.store
                else Path(
                    stack.enter_context(tempfile.TemporaryDirectory(prefix="labs-spark-store-"))
                )
            )
            counts = prepare(spark, ds, store / "fashion_mnist.parquet")
            print(
                f"Spark prepared {sum(counts.values())} training images, per class: {counts}",
                flush=True,
            )
            hparams = {
                k: getattr(args, k)
                for k in (
                    "epochs",
                    "batch_size",
                    "lr",
                    "warmup_epochs",
                    "weight_decay",
                    "width",
                    "seed",
                )
            }
            before = stage_ids(spark)
            start = time.perf_counter()
            # One Spark job of num_proc tasks; each task starts one Horovod rank (Gloo).
            results = horovod.spark.run(
                train_fn,
                args=(hparams, str(store / "fashion_mnist.parquet"), ds.mean, ds.std),
                num_proc=args.num_proc,
                use_gloo=True,
                start_timeout=int(args.timeout),
                env=dict(os.environ),
                verbose=1,
                stdout=sys.stdout,
                stderr=sys.stderr,
            )  # ranks' output, tagged [rank]<stdout>:
            elapsed = time.perf_counter() - start
            tasks = where_tasks_ran(spark, before)
    finally:
        spark.stop()
    return {"results": results, "tasks": tasks, "elapsed": elapsed, "counts": counts}


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    # A SIGTERM (the launcher's stop, a closed terminal) unwinds like Ctrl-C: the
    # cluster's context manager then stops every JVM and Python worker it started.
    signal.signal(signal.SIGTERM, _interrupt)
    if args.master:
        out = run(args, args.master)
    else:
        with spark_cluster.local_cluster(workers=2, cores=1) as cluster:
            workers = [
                f"{w['id']} ({w['host']}, {w['cores']} core)" for w in cluster.alive_workers()
            ]
            print(f"cluster {cluster.url}: workers {', '.join(workers)}", flush=True)
            out = run(args, cluster.url)
        print("cluster stopped", flush=True)
    results = sorted(out["results"], key=lambda r: r["rank"])
    for r in results:
        print(
            f"rank {r['rank']}: executor {r['executor_id']} on {r['host']} (pid {r['pid']}), "
            f"{r['steps']} steps in {r['seconds']:.1f}s, val_acc {r['val_acc']:.2%}",
            flush=True,
        )
    for t in out["tasks"]:
        print(
            f"spark stage {t['stage']} ({t['stage_name']}) task {t['task']}: "
            f"executor {t['executor_id']} at {t['executor']}, {t['seconds']:.1f}s",
            flush=True,
        )
    r0 = results[0]
    metrics.emit(
        {
            "event": "summary",
            "script": "horovod_spark",
            "world_size": r0["size"],
            "launcher": "horovod.spark",
            "steps": r0["steps"],
            "lr": r0["lr"],
            "train_loss": r0["train_loss"],
            "val_acc": r0["val_acc"],
            "elapsed": out["elapsed"],
            "ranks": results,
            "tasks": out["tasks"],
            "class_counts": out["counts"],
        }
    )
    print(f"{r0['steps']} steps, val_acc {r0['val_acc']:.2%}", flush=True)


if __name__ == "__main__":
    main()
