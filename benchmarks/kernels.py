"""Jupyter kernels that talk over Unix sockets in a folder of their own: no TCP port to lose.

jupyter_client's default transport is TCP on 127.0.0.1. It picks a kernel's five ports by
binding port 0 and letting the sockets go, writes them to the connection file, and the
kernel binds them when it has started, a second or more later
(jupyter_client 8.10, ``connect.py``, ``write_connection_file``). A port that any other
process takes in between, by binding port 0 or as the local end of a connection, ends the
kernel at start: ipykernel tries a given port once (ipykernel 7.4, ``kernelapp.py``,
``_bind_socket``: ``max_attempts = 1 if port else 100``) and the client reports
"Kernel died before replying to kernel_info". ``make test`` starts every notebook's kernel
beside torchrun, Gloo, Spark and Slurm, which open many local connections; CI lost
Lab 5's ``02_adam_on_server`` that way once. ``tests/test_notebook_kernels.py`` shows the
death (a kernel whose shell port is taken) and that these kernels have no port to take.

With the ``ipc`` transport the five channels are Unix sockets ``<folder>/ipc-N``, and the
folder is a new temporary one per kernel, so neither ports nor file names are shared
with anything. Used by nbval (the root ``conftest.py``) and by nbclient
(:func:`benchmarks.notebooks.execute`, the GPU check's notebooks), whose asyncio client
also needs :class:`SlicedPollChannel` (below). nbval's client blocks in zmq's own poll.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path
from queue import Empty
from typing import Any

from jupyter_client import AsyncKernelClient, AsyncKernelManager, KernelManager
from jupyter_client.channels import AsyncZMQSocketChannel
from traitlets import Type


class _PrivateUnixSockets:
    """Mixin for a jupyter_client kernel manager: the ``ipc`` transport, in a new folder."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.socket_folder = Path(tempfile.mkdtemp(prefix="kernel-"))
        self.transport = "ipc"
        self.ip = str(self.socket_folder / "ipc")  # the sockets are ip-1 ... ip-5

    async def _async_cleanup_resources(self, restart: bool = False) -> None:
        # Both managers' shutdown_kernel end here (jupyter_client 8.10, manager.py line 646).
        await super()._async_cleanup_resources(restart=restart)  # type: ignore[misc]
        if not restart:
            shutil.rmtree(self.socket_folder, ignore_errors=True)


class SlicedPollChannel(AsyncZMQSocketChannel):
    """jupyter_client's asyncio channel, waiting for a message in polls of at most a second.

    Seen here on a busy machine (three CPU burners on two cores; nbclient 0.11,
    jupyter_client 8.10, pyzmq 27.3): the kernel sent the execute_reply of Lab 1's explorer
    cell (ipywidgets' ``interactive``) 4.2 s into the cell, but the shell channel's
    ``await socket.poll(timeout)`` woke only when the timeout ran out, so nbclient sat out
    its whole cell timeout (the GPU check: 200-240 s, on an H200) and then went on as if
    nothing had happened. A poll that runs out still finds the waiting message, so polls
    of a second bound that loss to a second. nbclient issue #312 (open) reports cells with
    ipywidgets that "sometimes block".
    """

    slice_s = 1.0

    async def get_msg(self, timeout: float | None = None) -> dict[str, Any]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            wait = self.slice_s if left is None else min(left, self.slice_s)
            try:
                return await super().get_msg(timeout=wait)
            except Empty:
                if left is not None and left <= self.slice_s:
                    raise


class SlicedPollKernelClient(AsyncKernelClient):
    """jupyter_client's ``AsyncKernelClient`` with :class:`SlicedPollChannel` channels."""

    shell_channel_class = Type(SlicedPollChannel)  # type: ignore[assignment]
    iopub_channel_class = Type(SlicedPollChannel)  # type: ignore[assignment]
    stdin_channel_class = Type(SlicedPollChannel)  # type: ignore[assignment]
    control_channel_class = Type(SlicedPollChannel)  # type: ignore[assignment]


class UnixSocketKernelManager(_PrivateUnixSockets, KernelManager):
    """jupyter_client's blocking ``KernelManager`` (nbval's) on private Unix sockets."""


class AsyncUnixSocketKernelManager(_PrivateUnixSockets, AsyncKernelManager):
    """jupyter_client's ``AsyncKernelManager`` (nbclient's) on private Unix sockets, whose
    clients poll in slices (:class:`SlicedPollChannel`)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.client_factory = SlicedPollKernelClient
