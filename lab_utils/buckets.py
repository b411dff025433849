"""DDP's gradient buckets: which parameters' gradients travel together in one all-reduce.

:func:`make_buckets` assigns them as PyTorch's reducer does, so a data-parallel step
written by hand (Lab 6's ``scripts/ddp_by_hand.py``) buckets exactly as
``DistributedDataParallel`` would. It is also the reference of Lab 6's exercise
``make_buckets`` (``lab6_solutions`` re-exports it).
"""

from __future__ import annotations


def make_buckets(nbytes: list[int], ready: list[int], cap: int, first_cap: int) -> list[list[int]]:
    """Parameter indices per gradient bucket, as DDP's reducer assigns them
    (``torch.distributed._compute_bucket_assignment_by_size``; DDP rebuilds its buckets
    with it at the start of the next forward, in the order the first backward's gradients
    became ready).

    ``nbytes[i]`` is parameter i's gradient bytes, ``ready`` the parameter indices in the
    order their gradients became ready. Walk ``ready``, add each parameter to the open
    bucket, and close the bucket as soon as its bytes have reached its limit (``>=``):
    ``first_cap`` for the first bucket, ``cap`` for every later one. A bucket therefore
    passes its limit by up to its last parameter; what is left at the end is the last
    bucket."""
    buckets: list[list[int]] = []
    open_bucket: list[int] = []
    size = 0
    for i in ready:
        open_bucket.append(i)
        size += nbytes[i]
        if size >= (cap if buckets else first_cap):
            buckets.append(open_bucket)
            open_bucket, size = [], 0
    if open_bucket:
        buckets.append(open_bucket)
    return buckets
