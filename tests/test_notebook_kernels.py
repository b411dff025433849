"""The notebooks' kernels under test talk over Unix sockets of their own (``benchmarks/kernels.py``).

Why: a kernel on jupyter_client's default TCP transport dies at start when another process
takes one of its ports between jupyter_client choosing it and the kernel binding it; CI
lost a notebook that way ("Kernel died before replying to kernel_info"). The first test
shows that death with jupyter_client and ipykernel themselves; the next two, that the two
ways the suite starts kernels (nbval, through the root ``conftest.py``, and nbclient,
through :func:`benchmarks.notebooks.execute`) use private Unix sockets instead. The last
ones: nbclient's channels wait in polls of a second, so a poll that misses its wake-up
costs a second, not the cell's whole timeout.
"""

from __future__ import annotations

import asyncio
import os
import socket
import stat
from queue import Empty

import nbformat
import pytest
from jupyter_client import KernelManager
from jupyter_client.channels import AsyncZMQSocketChannel

from benchmarks import kernels, notebooks
from benchmarks.kernels import (
    AsyncUnixSocketKernelManager,
    SlicedPollChannel,
    SlicedPollKernelClient,
    UnixSocketKernelManager,
)


class _ShellPortTaken(KernelManager):
    """jupyter_client's own manager, with its shell port taken the moment it is chosen
    (what another process of the suite can do by chance)."""

    def write_connection_file(self, **kwargs) -> None:
        super().write_connection_file(**kwargs)
        self.squatter = socket.socket()
        self.squatter.bind((self.ip, self.shell_port))
        self.squatter.listen()


@pytest.mark.slow
def test_a_kernel_whose_tcp_port_is_taken_dies_at_start() -> None:
    import nbval.kernel

    km = _ShellPortTaken(kernel_name="python3")
    km.start_kernel()
    kc = km.client()
    kc.start_channels()
    try:
        with pytest.raises(RuntimeError, match="Kernel died before replying to kernel_info"):
            kc.wait_for_ready(timeout=60)
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
        km.squatter.close()
    # ... and nbval starts its kernels through the manager this suite gives it.
    assert nbval.kernel.KernelManager is UnixSocketKernelManager


@pytest.mark.slow
def test_nbval_kernels_listen_on_private_unix_sockets() -> None:
    import nbval.kernel

    kernel = nbval.kernel.RunningKernel("python3")  # as nbval's plugin starts one
    km = kernel.km
    try:
        assert km.transport == "ipc"
        folder = km.socket_folder
        sockets = sorted(p.name for p in folder.iterdir() if stat.S_ISSOCK(p.stat().st_mode))
        assert sockets == [f"ipc-{n}" for n in range(1, 6)], sockets
        msg_id = kernel.execute_cell_input("print(6 * 7)", allow_stdin=False)
        kernel.await_idle(msg_id, timeout=30)
    finally:
        kernel.stop()
    assert not folder.exists(), "the kernel's socket folder outlived it"


@pytest.mark.slow
def test_nbclient_kernels_listen_on_private_unix_sockets(tmp_path) -> None:
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell(
            "from ipykernel.connect import get_connection_info\n"
            "info = get_connection_info(unpack=True)\n"
            "assert info['transport'] == 'ipc', info\n"
            "assert info['ip'].endswith('/ipc') and '/kernel-' in info['ip'], info"
        )
    ]
    path = tmp_path / "transport.ipynb"
    nbformat.write(nb, path)
    notebooks.execute(path, env=dict(os.environ))  # a failed assert fails the cell, and this call


def test_a_missed_wake_up_costs_one_slice_not_the_whole_timeout(monkeypatch) -> None:
    clock = [0.0]  # a poll that runs out takes its whole timeout, on this clock
    monkeypatch.setattr(kernels.time, "monotonic", lambda: clock[0])
    polls: list[float | None] = []

    async def misses_twice(self, timeout=None):  # jupyter_client's get_msg, whose poll
        polls.append(timeout)  # ran out twice with the reply already waiting
        if len(polls) < 3:
            clock[0] += timeout
            raise Empty
        return {"msg_type": "execute_reply"}

    monkeypatch.setattr(AsyncZMQSocketChannel, "get_msg", misses_twice)
    channel = object.__new__(SlicedPollChannel)  # no socket: the parent's poll is the fake
    assert asyncio.run(channel.get_msg(timeout=240))["msg_type"] == "execute_reply"
    assert polls == [1.0, 1.0, 1.0]  # not one poll of 240 s
    polls.clear()
    assert asyncio.run(channel.get_msg(timeout=None))["msg_type"] == "execute_reply"
    assert polls == [1.0, 1.0, 1.0]

    async def never(self, timeout=None):
        polls.append(timeout)
        clock[0] += timeout
        raise Empty

    monkeypatch.setattr(AsyncZMQSocketChannel, "get_msg", never)
    polls.clear()
    with pytest.raises(Empty):  # a timeout still runs out, in slices that add up to it
        asyncio.run(channel.get_msg(timeout=2.5))
    assert polls == [1.0, 1.0, 0.5]


def test_nbclients_kernel_manager_hands_out_the_sliced_client() -> None:
    km = AsyncUnixSocketKernelManager(kernel_name="python3")
    client = km.client()
    assert isinstance(client, SlicedPollKernelClient)
    assert client.shell_channel_class is SlicedPollChannel
    assert client.iopub_channel_class is SlicedPollChannel
    asyncio.run(km._async_cleanup_resources())  # what shutdown_kernel ends with
    assert not km.socket_folder.exists()
