"""What travels to the GPU machine beside the working tree, and its unpacking there.

The GPU machines (DESIGN.md §17) have Python 3.12, PyTorch, numpy, matplotlib, tqdm,
psutil, pytest and mpi4py, and no network. The notebooks need more: nbformat, nbclient,
ipykernel (with IPython, pyzmq, tornado...), ipywidgets; the grader's GPU participation
check reads NVML through ``pynvml`` (``nvidia-ml-py``). ``make gpu-bundle`` (this module's
command line) downloads their wheels for the GPU machine's Python and copies
Fashion-MNIST's four official files into one ignored folder, ``.gpu_bundle/``:

    .gpu_bundle/manifest.json          Python version, wheels, sizes
    .gpu_bundle/wheels/*.whl
    .gpu_bundle/data/fashion-mnist/*.gz (LABS_DATA for the check's paths)

On the GPU machine the check unpacks the wheels the image lacks into a folder it puts
on ``PYTHONPATH`` (a wheel is a zip of its import tree; no pip, no network, nothing
installed into the image). Left out on purpose: debugpy and jedi (ipykernel and
IPython run without them: debugging and completion only), and what the image has.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_DIR = REPO_ROOT / ".gpu_bundle"
REQUIREMENTS = ("nbformat", "nbclient", "ipykernel", "ipywidgets", "nvidia-ml-py")
# The image has these (DESIGN.md §17); optional at run time: debugging and completion.
LEFT_OUT = {"torch", "numpy", "matplotlib", "tqdm", "psutil", "pytest", "mpi4py"}
OPTIONAL = {"debugpy", "jedi", "parso"}
FASHION_MNIST_FILES = (
    "train-images-idx3-ubyte.gz",
    "train-labels-idx1-ubyte.gz",
    "t10k-images-idx3-ubyte.gz",
    "t10k-labels-idx1-ubyte.gz",
)
LIMIT_BYTES = 64 * 2**20  # what may travel with the working tree, all together


def dist_name(wheel: Path) -> str:
    """The normalised distribution name of a wheel file (``pyzmq-27.3.0-cp312-...``)."""
    return wheel.name.split("-")[0].lower().replace("_", "-").replace(".", "-")


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def tree_bytes(repo: Path = REPO_ROOT) -> int:
    """Bytes of the files the device machine copies: tracked, and untracked not ignored."""
    names = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=repo,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    return sum(
        (repo / n.decode()).stat().st_size for n in names if n and (repo / n.decode()).is_file()
    )


def fashion_mnist_folder() -> Path | None:
    """A folder holding Fashion-MNIST's four files, where ``lab_utils.data`` looks."""
    import os

    from lab_utils import data, paths

    bases = [Path(os.environ["LABS_DATA"])] if os.environ.get("LABS_DATA") else []
    bases += [paths.cache_dir(), *map(Path, data.SYSTEM_DIRS)]
    for base in bases:
        for folder in (base, base / "fashion-mnist", base / "FashionMNIST" / "raw"):
            if all((folder / f).is_file() for f in FASHION_MNIST_FILES):
                return folder
    return None


def make(dest: Path, python_version: str = "3.12", with_data: bool = True) -> dict[str, Any]:
    """Download the wheels into ``dest/wheels`` and copy Fashion-MNIST; write the manifest."""
    wheels = dest / "wheels"
    if wheels.exists():
        shutil.rmtree(wheels)
    wheels.mkdir(parents=True)
    major, minor = python_version.split(".")[:2]
    platforms = ("manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_28_x86_64")
    cmd = [sys.executable, "-m", "pip", "download", "--only-binary=:all:", "--dest", str(wheels)]
    cmd += [
        "--python-version",
        python_version,
        "--implementation",
        "cp",
        "--abi",
        f"cp{major}{minor}",
    ]
    cmd += [a for p in platforms for a in ("--platform", p)] + ["--platform", "any", *REQUIREMENTS]
    subprocess.run(cmd, check=True)
    dropped = []
    for whl in sorted(wheels.glob("*.whl")):
        if dist_name(whl) in LEFT_OUT | OPTIONAL:
            dropped.append(whl.name)
            whl.unlink()
    data_note = "not copied"
    if with_data:
        found = fashion_mnist_folder()
        if found is None:
            data_note = "not found here: Fashion-MNIST paths will be skipped on the GPU machine"
        else:
            target = dest / "data" / "fashion-mnist"
            target.mkdir(parents=True, exist_ok=True)
            for f in FASHION_MNIST_FILES:
                shutil.copyfile(found / f, target / f)
            data_note = f"copied from {found}"
    manifest = {
        "python": f"{major}.{minor}",
        "wheels": sorted(p.name for p in wheels.glob("*.whl")),
        "left_out": dropped,
        "fashion_mnist": data_note,
    }
    (dest / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    manifest["bytes"] = folder_bytes(dest)
    return manifest


def installed(name: str) -> bool:
    try:
        importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def unpack_wheel(wheel: Path, site: Path) -> None:
    """Extract a wheel's import tree into ``site``: its ``*.data/purelib`` and ``platlib``
    join the top level; scripts and data files (kernelspecs, lab extensions) are not
    needed here, and the dist-info stays so ``importlib.metadata`` finds the version."""
    with zipfile.ZipFile(wheel) as z:
        for member in z.infolist():
            parts = member.filename.split("/")
            if parts[0].endswith(".data"):
                if len(parts) < 3 or parts[1] not in ("purelib", "platlib"):
                    continue
                parts = parts[2:]
            target = site.joinpath(*parts)
            if member.is_dir():
                target.mkdir(parents=True, exist_ok=True)
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            with z.open(member) as src, open(target, "wb") as dst:
                shutil.copyfileobj(src, dst)


def unpack(bundle: Path, site: Path) -> dict[str, Any]:
    """Unpack the bundle's wheels that this interpreter lacks into ``site``.

    Returns ``{"site", "unpacked", "kept_own", "problem"}``; ``problem`` is "" or why
    the notebooks cannot run from this bundle (none, or made for another Python).
    """
    manifest_path = bundle / "manifest.json"
    if not manifest_path.is_file():
        return {"problem": f"no bundle at {bundle} (make gpu-bundle, then carry .gpu_bundle)"}
    manifest = json.loads(manifest_path.read_text())
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    if manifest.get("python") != here:
        return {"problem": f"the bundle is for Python {manifest.get('python')}, this is {here}"}
    site.mkdir(parents=True, exist_ok=True)
    unpacked, kept = [], []
    for whl in sorted((bundle / "wheels").glob("*.whl")):
        if installed(dist_name(whl)):
            kept.append(dist_name(whl))  # the image's own copy wins: nothing shadowed
            continue
        unpack_wheel(whl, site)
        unpacked.append(dist_name(whl))
    return {"site": str(site), "unpacked": unpacked, "kept_own": kept, "problem": ""}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu_check.bundle",
        description="Make .gpu_bundle/: the wheels and data the GPU check needs on an offline GPU machine.",
    )
    p.add_argument("--dest", type=Path, default=DEFAULT_DIR)
    p.add_argument(
        "--python-version", default="3.12", help="the GPU machine's Python (default 3.12)"
    )
    p.add_argument("--no-data", action="store_true", help="leave Fashion-MNIST out")
    args = p.parse_args(argv)
    m = make(args.dest, args.python_version, with_data=not args.no_data)
    tree = tree_bytes()
    total = tree + m["bytes"]
    mib = 2**20
    print(
        f"{args.dest}: {len(m['wheels'])} wheels for Python {m['python']}, Fashion-MNIST {m['fashion_mnist']}"
    )
    print(f"left out (the image has them, or optional): {', '.join(m['left_out']) or 'none'}")
    print(
        f"travels: working tree {tree / mib:.1f} MiB + bundle {m['bytes'] / mib:.1f} MiB = "
        f"{total / mib:.1f} MiB of {LIMIT_BYTES / mib:.0f} MiB"
    )
    if total > LIMIT_BYTES:
        print("too big to travel with the working tree: use --no-data", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
