"""The notebooks' kernels under test talk over Unix sockets of their own (``benchmarks/kernels.py``).

Why: a kernel on jupyter_client's default TCP transport dies at start when another process
takes one of its ports between jupyter_client choosing it and the kernel binding it; CI
lost a notebook that way ("Kernel died before replying to kernel_info"). The first test
shows that death with jupyter_client and ipykernel themselves; the others, that the two
ways the suite starts kernels (nbval, through the root ``conftest.py``, and nbclient,
through :func:`benchmarks.notebooks.execute`) use private Unix sockets instead.
"""

from __future__ import annotations

import os
import socket
import stat

import nbformat
import pytest
from jupyter_client import KernelManager

from benchmarks import notebooks
from benchmarks.kernels import UnixSocketKernelManager

pytestmark = pytest.mark.slow


class _ShellPortTaken(KernelManager):
    """jupyter_client's own manager, with its shell port taken the moment it is chosen
    (what another process of the suite can do by chance)."""

    def write_connection_file(self, **kwargs) -> None:
        super().write_connection_file(**kwargs)
        self.squatter = socket.socket()
        self.squatter.bind((self.ip, self.shell_port))
        self.squatter.listen()


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
