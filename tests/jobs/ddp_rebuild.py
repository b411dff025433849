"""When DDP rebuilds its buckets, under each option (tests/test_lab6_ddp.py).

One process, Gloo: a model whose layers are used in reverse registration order, so
gradients arrive in registration order and buckets built in that order differ from
DDP's initial reversed-registration ones. Prints, per option, the bucket sizes (in
elements) before the first iteration and after each of four, as JSON.
"""

import json
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from lab_utils import gloo_exit


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        rows = [64, 8, 64, 8, 32, 4]
        self.layers = nn.ModuleList(nn.Linear(8, r, bias=False) for r in rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(layer(x).sum() for layer in reversed(self.layers))


def bucket_sizes(ddp: DDP) -> list[int]:
    return [b.buffer().numel() for b in ddp.reducer._get_zeros_like_grad_buckets()]


def main() -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    # Gloo's threads can abort a rank at exit (lab_utils/gloo_exit.py): end by os._exit
    gloo_exit.arm()
    seen = {}
    for name, options in {
        "default": {},
        "static_graph": {"static_graph": True},
        "find_unused_parameters": {"find_unused_parameters": True},
    }.items():
        torch.manual_seed(0)
        ddp = DDP(Net(), bucket_cap_mb=200 * 4 / 2**20, **options)  # 200 fp32 values
        sizes = [bucket_sizes(ddp)]
        for _ in range(4):
            ddp(torch.randn(2, 8)).backward()
            sizes.append(bucket_sizes(ddp))
        seen[name] = sizes
    print(json.dumps(seen), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
