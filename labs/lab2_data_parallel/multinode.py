"""Simulate a multi-node ``torchrun`` job on one machine.

On a real cluster you start ``torchrun`` once per node, each with the same
``--nnodes``, ``--rdzv-backend c10d`` and ``--rdzv-endpoint <host of node 0>:<port>``
and its own ``--node-rank``. :func:`run_nodes` does exactly that with one
``lab_utils.launch.run`` per "node", all started at once and pointed at 127.0.0.1,
so the rendezvous, the global ranks and the cross-node all-reduce all happen for
real (over loopback).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping, Sequence

from lab_utils import launch
from lab_utils.net import free_port


def node_args(
    nnodes: int,
    nproc_per_node: int,
    endpoint: str,
    script: str | os.PathLike,
    args: Sequence[str] = (),
    run_id: str = "lab2",
) -> list[str]:
    """The arguments of ``torchrun`` (``python -m torch.distributed.run``) on every node.

    They are the same on all nodes: with the ``c10d`` rendezvous the nodes number
    themselves in order of arrival (``--node-rank`` is only for the ``static`` one).
    """
    return [
        f"--nnodes={nnodes}",
        f"--nproc-per-node={nproc_per_node}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={endpoint}",
        f"--rdzv-id={run_id}",
        "--tee=3",
        str(script),
        *map(str, args),
    ]


def run_nodes(
    script: str | os.PathLike,
    args: Sequence[str] = (),
    *,
    nnodes: int = 2,
    nproc_per_node: int = 1,
    timeout: float = 120,
    echo: bool = True,
    env: Mapping[str, str] | None = None,
) -> list[launch.LaunchResult]:
    """Start ``nnodes`` torchrun invocations of ``script`` at once and wait for all.

    Returns one :class:`~lab_utils.launch.LaunchResult` per node, in node order;
    each has its own timeout and leaves no process behind. Node 0 also hosts the
    rendezvous (``--rdzv-endpoint 127.0.0.1:<free port>``).
    """
    if nnodes < 1 or nproc_per_node < 1:
        raise ValueError("need at least one node and one process per node")
    endpoint = f"127.0.0.1:{free_port()}"
    # Two "nodes" on one host: Gloo must use loopback (a real cluster sets its NIC here).
    job_env = {"GLOO_SOCKET_IFNAME": "lo", **(env or {})}
    results: list[launch.LaunchResult | None] = [None] * nnodes
    errors: list[BaseException | None] = [None] * nnodes

    def node(k: int) -> None:
        try:
            results[k] = launch.run(
                "torch.distributed.run",
                node_args(
                    nnodes,
                    nproc_per_node,
                    endpoint,
                    script,
                    args,
                    run_id=f"lab2-{endpoint.rsplit(':', 1)[1]}",
                ),
                module=True,
                nprocs=1,
                launcher="python",
                timeout=timeout,
                echo=echo,
                env=job_env,
            )
        except BaseException as exc:  # re-raised in the caller's thread
            errors[k] = exc

    threads = [threading.Thread(target=node, args=(k,), daemon=True) for k in range(nnodes)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for exc in errors:
        if exc is not None:
            raise exc
    return [r for r in results if r is not None]
