"""pytest's set-up for the whole repository (``tests/`` and the notebooks under ``labs/``).

nbval starts every notebook's kernel with jupyter_client's ``KernelManager``
(nbval 0.11, ``kernel.py``, ``start_new_kernel``). Here that manager talks over Unix
sockets in a folder of its own instead of TCP ports that another process of the suite can
take first (``benchmarks/kernels.py`` says how that kills a kernel, and CI saw it).
"""

from __future__ import annotations

import importlib.util

if importlib.util.find_spec("nbval") is not None:
    import nbval.kernel

    from benchmarks.kernels import UnixSocketKernelManager

    nbval.kernel.KernelManager = UnixSocketKernelManager
