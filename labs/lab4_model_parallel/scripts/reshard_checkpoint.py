"""Distributed checkpoints that outlive the layout: save on N processes, load on M.

--save DIR: train the character transformer with FSDP2 (fully_shard) on N processes
for --steps Adam steps and write model and optimizer with torch.distributed.checkpoint:
each rank writes only its own shards; rank 0 (the coordinator) writes DIR/.metadata
last, once every rank has reported its files. Rank 0 also keeps, for comparison, the
full state as it was in memory (--reference) and the whole model (--checkpoint).

--load DIR: build the same FSDP2 model on M processes (any M), read DIR into it (each
rank reads the pieces of the file shards that overlap its new shard: the script records
which, from DCP's own read plan) and compare the full model and optimizer state with
--reference.

--die-before-metadata: rank 0 stops dead after every rank wrote its data and before
.metadata exists: what a crash in the middle of a save leaves behind.

    torchrun --standalone --nproc-per-node 4 reshard_checkpoint.py --save ckpt --reference ref.pt
    torchrun --standalone --nproc-per-node 2 reshard_checkpoint.py --load ckpt --reference ref.pt

Events (rank 0 emits them; a notebook reads them with ``result.event(name)``):
    saved: procs, files, state_bytes (with --save)
    loaded: procs, saved_procs, errors, tensors, rank0_model_bytes, reads, rows,
        state_dict, optim_types (with --load)
"""

import argparse
import os
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import LoadItemType
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

from lab_utils import dist as labdist
from lab_utils import gloo_exit, metrics, models, parallel, profile

warnings.filterwarnings("ignore", message="FSDP2-wrapped module")  # no in-place ops on outputs
FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def parse_args(argv=None) -> argparse.Namespace:
    p = profile.script_parser(__doc__.splitlines()[0])
    parallel.add_model_args(p)
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--save", metavar="DIR", help="train, then save a sharded checkpoint here")
    mode.add_argument("--load", metavar="DIR", help="load the sharded checkpoint in DIR")
    p.add_argument(
        "--reference",
        required=True,
        help="file of the full state in memory at save time (written by --save, read by --load)",
    )
    p.add_argument(
        "--die-before-metadata",
        action="store_true",
        help="rank 0 exits after the data files are written, before .metadata",
    )
    return p.parse_args(argv)


class DieBeforeMetadata(dcp.FileSystemWriter):
    """A writer whose coordinator exits where ``finish`` would write ``.metadata``."""

    def finish(self, metadata, results) -> None:
        print("rank 0: every rank's data is written; exiting before .metadata", flush=True)
        os._exit(3)


class RecordingPlanner(DefaultLoadPlanner):
    """DCP's default load planner that keeps what this rank will read: per tensor (of one
    dimension or more), ``[saving rank, first row in its saved shard, first row in this
    rank's shard, rows]`` for each piece, the saving rank taken from the file
    (``__{rank}_0.distcp``) that ``.metadata`` names for the piece."""

    def create_local_plan(self):
        plan = super().create_local_plan()
        self.reads: dict[str, list[list[int]]] = {}
        for item in plan.items:
            if item.type != LoadItemType.TENSOR or not item.lengths:
                continue
            path = self.metadata.storage_data[item.storage_index].relative_path
            saver = int(path.removeprefix("__").split("_")[0])
            self.reads.setdefault(item.dest_index.fqn, []).append(
                [saver, item.storage_offsets[0], item.dest_offsets[0], item.lengths[0]]
            )
        return plan


def sharded(
    args: argparse.Namespace, device: torch.device
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The char transformer, each block and the whole model sharded over all ranks."""
    model = parallel.build_model(args).to(device)
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.Adam(model.parameters(), lr=args.lr)


def train(
    model, opt, args: argparse.Namespace, rank: int, world_size: int, device: torch.device
) -> None:
    data = parallel.corpus(args)
    mine = slice(rank * args.batch_size // world_size, (rank + 1) * args.batch_size // world_size)
    for step in range(args.steps):
        x, y = (t.to(device) for t in data.batch(args.batch_size, args.seq_len, step, args.seed))
        opt.zero_grad()
        loss = parallel.lm_loss(model(x[mine]), y[mine])
        loss.backward()
        opt.step()
        labdist.print0(f"step {step}: loss {loss.item():.3f}")


def flat(state: dict, prefix: str = "") -> dict[str, torch.Tensor]:
    """``{dotted.name: tensor}`` of every tensor in a nested state dict."""
    out: dict[str, torch.Tensor] = {}
    for k, v in state.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flat(v, f"{name}."))
        elif isinstance(v, list):
            out.update(flat(dict(enumerate(v)), f"{name}."))
        elif torch.is_tensor(v):
            out[name] = v.detach().float().cpu()
    return out


def save(args: argparse.Namespace, rank: int, world_size: int, device: torch.device) -> None:
    model, opt = sharded(args, device)
    train(model, opt, args, rank, world_size, device)
    msd, osd = get_state_dict(model, opt)  # sharded: each rank its own pieces
    writer = (DieBeforeMetadata if args.die_before_metadata else dcp.FileSystemWriter)(args.save)
    full_model, full_optim = get_state_dict(model, opt, options=FULL)  # a collective: all ranks
    if rank == 0:
        torch.save({"model": full_model, "optim": full_optim}, args.reference)
    dcp.save({"model": msd, "optim": osd}, storage_writer=writer)
    files = {p.name: p.stat().st_size for p in sorted(Path(args.save).iterdir())}
    if rank == 0:
        metrics.emit(
            {
                "event": "saved",
                "procs": world_size,
                "files": files,
                "state_bytes": sum(
                    t.numel() * t.element_size()
                    for t in flat({"model": full_model, "optim": full_optim}).values()
                ),
            }
        )
        print(f"saved {args.save} from {world_size} ranks: {files}", flush=True)
        if args.checkpoint:
            plain = parallel.build_model(args)
            plain.load_state_dict(full_model)
            models.save(args.checkpoint, plain, steps=args.steps, procs=world_size)
            print(f"saved {args.checkpoint}", flush=True)


def load(args: argparse.Namespace, rank: int, world_size: int, device: torch.device) -> None:
    model, opt = sharded(args, device)
    msd, osd = get_state_dict(model, opt)  # the shapes and shards this layout wants
    state = {"model": msd, "optim": osd}
    planner = RecordingPlanner()
    dcp.load(state, checkpoint_id=args.load, planner=planner)
    every = [None] * world_size
    dist.all_gather_object(every, planner.reads)
    metadata = dcp.FileSystemReader(args.load).read_metadata()
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    full_model, full_optim = get_state_dict(model, opt, options=FULL)
    # what FSDP2's own state_dict() holds (4.9 says: sharded DTensors, nothing gathered)
    own = {
        k: [
            type(v).__name__,
            list(v.shape),
            list((v.to_local() if hasattr(v, "to_local") else v).shape),
        ]
        for k, v in model.state_dict().items()
    }
    if rank == 0:
        ref = torch.load(args.reference, weights_only=True)
        errors = {
            "model": parallel.relative_error(flat(full_model), flat(ref["model"])),
            "optim": parallel.relative_error(flat(full_optim), flat(ref["optim"])),
        }
        local = sum(t.numel() * t.element_size() for t in flat(msd).values())
        metrics.emit(
            {
                "event": "loaded",
                "procs": world_size,
                "errors": errors,
                "tensors": len(flat(full_optim)),
                "rank0_model_bytes": local,
                # what each rank read (DCP's read plan), and each tensor's rows
                "reads": dict(enumerate(every)),
                "rows": {
                    f: metadata.state_dict_metadata[f].size[0] for reads in every for f in reads
                },
                "saved_procs": len({p.relative_path for p in metadata.storage_data.values()}),
                "state_dict": own,  # name: [type, global shape, this rank's shape]
                "optim_types": sorted(
                    {
                        f"{k}:{type(v).__name__}"
                        for st in osd["state"].values()
                        for k, v in st.items()
                    }
                ),
            }
        )
        print(
            f"loaded {args.load} into {world_size} ranks: model vs the saved run's memory {errors['model']:.1e}, "
            f"optimizer {errors['optim']:.1e}",
            flush=True,
        )


def main() -> None:
    args = parse_args()
    world_size = parallel.require_batch_split(args.batch_size)
    # torch 2.13's Gloo threads can abort or hang a rank at Python's exit: from here on it
    # ends by os._exit with Python's own status (sys.exit, atexit.register and
    # destroy_process_group are wrapped for it; lab_utils/gloo_exit.py says why)
    gloo_exit.arm()
    info = labdist.init(group_if_alone=True)
    (save if args.save else load)(args, info.rank, world_size, info.device)
    labdist.shutdown()


if __name__ == "__main__":
    main()
