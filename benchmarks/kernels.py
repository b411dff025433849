"""Jupyter kernels that talk over Unix sockets in a folder of their own: no TCP port to lose.

jupyter_client's default transport is TCP on 127.0.0.1. It picks a kernel's five ports by
binding port 0 and letting the sockets go, writes them to the connection file, and the
kernel binds them when it has started, a second or more later
(jupyter_client 8.10, ``connect.py``, ``write_connection_file``). A port that any other
process takes in between, by binding port 0 or as the local end of a connection, ends the
kernel at start: ipykernel tries a given port once (ipykernel 7.4, ``kernelapp.py``,
``_bind_socket``: ``max_attempts = 1 if port else 100``) and the client reports
"Kernel died before replying to kernel_info". ``make test`` starts every notebook's kernel
beside torchrun, Gloo, Spark and Slurm, which open thousands of local connections; CI lost
Lab 5's ``02_adam_on_server`` that way once. ``tests/test_notebook_kernels.py`` shows the
death (a kernel whose shell port is taken) and that these kernels have no port to take.

With the ``ipc`` transport the five channels are Unix sockets ``<folder>/ipc-N``, and the
folder is a new temporary one per kernel, so neither ports nor file names are shared
with anything. Used by nbval (the root ``conftest.py``) and by nbclient
(:func:`benchmarks.notebooks.execute`, the GPU check's notebooks).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

from jupyter_client import AsyncKernelManager, KernelManager


class _PrivateUnixSockets:
    """Mixin for a jupyter_client kernel manager: the ``ipc`` transport, in a new folder."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.socket_folder = Path(tempfile.mkdtemp(prefix="kernel-"))
        self.transport = "ipc"
        self.ip = str(self.socket_folder / "ipc")  # the sockets are ip-1 ... ip-5

    async def _async_cleanup_resources(self, restart: bool = False) -> None:
        # Both managers' shutdown_kernel end here (jupyter_client 8.10, manager.py).
        await super()._async_cleanup_resources(restart=restart)  # type: ignore[misc]
        if not restart:
            shutil.rmtree(self.socket_folder, ignore_errors=True)


class UnixSocketKernelManager(_PrivateUnixSockets, KernelManager):
    """jupyter_client's blocking ``KernelManager`` (nbval's) on private Unix sockets."""


class AsyncUnixSocketKernelManager(_PrivateUnixSockets, AsyncKernelManager):
    """jupyter_client's ``AsyncKernelManager`` (nbclient's) on private Unix sockets."""
