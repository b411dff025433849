"""The Gloo exit workaround (lab_utils.gloo_exit): nothing at import, one visible call.

Importing the library in a launched rank changes nothing in Python; a script that joins
a group arms the hook itself with ``gloo_exit.arm()``, next to its ``init`` and under a
comment that says what it replaces; once armed, a rank ends with Python's own status
without finalizing the interpreter. Whether that keeps every distributed job clean is
measured by the soak (``scripts/exit_soak.py``) and its CI tripwire, tests/test_clean_exit.py.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

from lab_utils import gloo_exit

# What a rank's environment looks like under each launcher (the old import armed on these).
LAUNCHED = {
    "torchrun": {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"},
    "mpirun": {
        "OMPI_COMM_WORLD_RANK": "1",
        "OMPI_COMM_WORLD_SIZE": "2",
        "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
    },
}

UNTOUCHED = """
import atexit, sys
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
before = (sys.exit, atexit.register, dist.destroy_process_group, c10d.destroy_process_group)
import lab_utils, lab_utils.dist, lab_utils.gloo_exit, lab_utils.parallel, lab_utils.train
after = (sys.exit, atexit.register, dist.destroy_process_group, c10d.destroy_process_group)
changed = [b.__name__ for b, a in zip(before, after) if a is not b]
assert not changed, f"importing the library replaced {changed}"
assert type(sys.exit).__name__ == "builtin_function_or_method", sys.exit
assert not lab_utils.gloo_exit.armed()
print("untouched")
"""


def python(code: str, env: dict[str, str] | None = None, cwd: Path = REPO):
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return subprocess.run(
        [sys.executable, "-c", code],
        env={**base, **(env or {})},
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize("launcher", LAUNCHED)
def test_importing_the_library_in_a_launched_rank_changes_nothing(launcher):
    done = python(UNTOUCHED, LAUNCHED[launcher])
    assert done.returncode == 0 and "untouched" in done.stdout, done.stderr[-2000:]


ARMED = """
import atexit, sys
import torch.distributed as dist
from lab_utils import gloo_exit
builtin_exit = sys.exit
gloo_exit.arm()
assert gloo_exit.armed() and sys.exit is not builtin_exit
assert atexit.register.__module__ == "lab_utils.gloo_exit"
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
dist.destroy_process_group()
assert len(gloo_exit._kept_groups) == 1  # the destroyed group, still referenced
sys.exit(7)
"""


def test_arm_replaces_the_three_functions_it_names_and_keeps_the_status():
    done = python(ARMED, {"GLOO_SOCKET_IFNAME": "lo"})
    assert done.returncode == 7, done.stderr[-2000:]


# ---------------------------------------------------------------- how an armed rank ends
# One process, armed, no group: how it ends, and whether it skipped finalization (only
# where Python's status is known for certain).
ENDINGS = {
    "runs to its end": ("print('done')", 0, True),
    "raises": ("def main():\n    raise RuntimeError('boom')\nmain()", 1, True),
    "sys.exit(3) in main": ("def main():\n    sys.exit(3)\nmain()", 3, True),
    "sys.exit with a message": ("sys.exit('bad input')", 1, True),
    "raise SystemExit(5)": ("raise SystemExit(5)", 5, False),
    "sys.exit(0) caught, then SystemExit(4)": (
        "def main():\n    try:\n        sys.exit(0)\n    except SystemExit:\n        pass\n"
        "    raise SystemExit(4)\nmain()",
        4,
        False,
    ),
    "sys.exit(2) caught, then main returns": (
        "def main():\n    try:\n        sys.exit(2)\n    except SystemExit:\n        pass\nmain()",
        0,
        True,
    ),
    "Ctrl-C": ("raise KeyboardInterrupt", -2, False),  # Python ends itself with SIGINT
}
# An object alive at exit: finalization calls its __del__, os._exit does not.
FINALIZED = "class Last:\n    def __del__(self):\n        print('finalized', file=sys.stderr)\nlast = Last()\n"


def run_alone(tmp_path: Path, code: str, armed: bool = True) -> subprocess.CompletedProcess:
    """``code`` as a script's ``__main__``, with one exit handler registered before the
    hook and one after it; armed by the one call a script makes, or not at all."""
    script = tmp_path / "job.py"
    script.write_text(
        "import atexit, sys\n"
        "atexit.register(print, 'handler before', file=sys.stderr)\n"
        "from lab_utils import gloo_exit\n"
        + ("gloo_exit.arm()\n" if armed else "")
        + "atexit.register(print, 'handler after', file=sys.stderr)\n"
        + FINALIZED
        + code
        + "\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    return subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize(("code", "status", "fast"), ENDINGS.values(), ids=ENDINGS.keys())
def test_an_armed_rank_exits_with_pythons_own_status(tmp_path, code, status, fast):
    done = run_alone(tmp_path, code)
    assert done.returncode == status, done.stderr
    assert ("finalized" not in done.stderr) == fast, done.stderr
    # every other exit handler runs once, those registered before the hook too
    assert done.stderr.count("handler before") == done.stderr.count("handler after") == 1
    # a SystemExit the hook could not read is named, with its fix; Ctrl-C is not one
    unread = not fast and "KeyboardInterrupt" not in code
    assert (gloo_exit.UNKNOWN_STATUS in done.stderr) == unread, done.stderr
    if "RuntimeError" in code:
        assert "Traceback" in done.stderr and "RuntimeError: boom" in done.stderr
    if "KeyboardInterrupt" in code:
        assert "Traceback" in done.stderr and "KeyboardInterrupt" in done.stderr


# main() arms the hook itself, as a script does: how __main__ ends decides whether the
# hook learns the status. `sys.exit(main())` calls the sys.exit Python looked up before
# main() ran, Python's own (the course's trainer did so, and aborted once in CI).
MAIN_ARMS = "def main():\n    gloo_exit.arm()\n    return 3\n"
LAST_LINES = {
    "sys.exit(main())": ("sys.exit(main())", False),
    "status = main(); sys.exit(status)": ("status = main()\nsys.exit(status)", True),
}


@pytest.mark.parametrize(("last", "fast"), LAST_LINES.values(), ids=LAST_LINES.keys())
def test_a_main_that_arms_keeps_its_status_only_through_the_armed_exit(tmp_path, last, fast):
    done = run_alone(tmp_path, MAIN_ARMS + last, armed=False)
    assert done.returncode == 3, done.stderr
    assert ("finalized" not in done.stderr) == fast, done.stderr
    assert (gloo_exit.UNKNOWN_STATUS in done.stderr) != fast, done.stderr


def test_an_armed_rank_flushes_the_files_it_left_open(tmp_path):
    code = "f = open(sys.argv[0] + '.out', 'w')\nf.write('kept')"
    for armed in (True, False):
        done = run_alone(tmp_path, code, armed=armed)
        assert done.returncode == 0
        assert ("finalized" in done.stderr) is not armed  # unarmed: Python finalizes as usual
        assert (tmp_path / "job.py.out").read_text() == "kept"  # never closed, still written
        (tmp_path / "job.py.out").unlink()


# ---------------------------------------------------------------- where it is armed
PROGRAMS = sorted(
    [
        *REPO.glob("labs/*/scripts/*.py"),
        *REPO.glob("benchmarks/jobs/*.py"),
        *REPO.glob("assessment/solutions/*.py"),
    ]
)
JOINS = ("init", "init_process_group", "init_rpc")  # labdist.init, torch's, RPC's


def _call_name(node: ast.Call) -> str:
    f = node.func
    return f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")


def _is_arm(node: ast.Call) -> bool:
    f = node.func
    return (
        isinstance(f, ast.Attribute)
        and f.attr == "arm"
        and getattr(f.value, "id", "") == "gloo_exit"
    )


def _is_join(node: ast.Call) -> bool:
    f = node.func
    horovod = isinstance(f, ast.Attribute) and getattr(f.value, "id", "") == "hvd"
    return _call_name(node) in JOINS and not horovod  # Horovod joins no torch group


def _is_leave(node: ast.Call) -> bool:
    return _call_name(node) in ("shutdown", "destroy_process_group")


def arming(source: str) -> tuple[list[int], list[int], list[int]]:
    """Lines of ``gloo_exit.arm()`` calls, of calls that leave the group (``shutdown``,
    ``destroy_process_group``) before an arm call in the same function, and of arm calls
    with no comment right above them (the student reads why where the hook is armed)."""
    tree, lines = ast.parse(source), source.splitlines()
    arms: list[tuple[int, ast.AST]] = []
    leaves: list[tuple[int, ast.AST]] = []

    def visit(node: ast.AST, scope: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            inner = child if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else scope
            if isinstance(child, ast.Call) and _is_arm(child):
                arms.append((child.lineno, scope))
            elif isinstance(child, ast.Call) and _is_leave(child):
                leaves.append((child.lineno, scope))
            visit(child, inner)

    visit(tree, tree)
    early = [n for n, s in leaves if any(s is a_s and n < a for a, a_s in arms)]
    bare = [n for n, _ in arms if not lines[n - 2].lstrip().startswith("#")]
    return sorted(n for n, _ in arms), sorted(early), bare


def unread_exits(source: str) -> list[int]:
    """Lines that end a program by a ``SystemExit`` the armed ``sys.exit`` does not raise:
    ``raise SystemExit``, the ``exit``/``quit`` builtins, and at module level
    ``sys.exit(main())``, whose ``sys.exit`` Python looks up before ``main()`` arms the hook
    (a call anywhere in its argument). A ``sys.exit(main())`` inside another function is not
    seen; the course's programs have none."""
    tree, found = ast.parse(source), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Raise) and node.exc is not None:
            called = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            if getattr(called, "id", "") == "SystemExit":
                found.append(node.lineno)
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") in ("exit", "quit"):
            found.append(node.lineno)
    functions = [
        n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
    ]
    inside = {id(c) for f in functions for c in ast.walk(f)}
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and id(node) not in inside
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "exit"
            and any(isinstance(n, ast.Call) for a in node.args for n in ast.walk(a))
        ):
            found.append(node.lineno)
    return sorted(found)


def joins_a_group(source: str) -> bool:
    return any(isinstance(n, ast.Call) and _is_join(n) for n in ast.walk(ast.parse(source)))


@pytest.mark.parametrize("path", PROGRAMS, ids=lambda p: str(p.relative_to(REPO)))
def test_a_script_that_joins_a_group_arms_the_hook_once_visibly(path: Path):
    source = path.read_text()
    arms, early, bare = arming(source)
    if not joins_a_group(source):
        assert not arms, f"{path.name} joins no group but arms the Gloo exit hook"
        return
    assert len(arms) == 1, f"{path.name} joins a group: arm the Gloo exit hook once ({arms})"
    assert not early, f"{path.name}: the group is left at line {early[0]}, before gloo_exit.arm()"
    assert not bare, f"{path.name}: say why above gloo_exit.arm() (line {bare[0]})"
    unread = unread_exits(source)
    assert not unread, f"{path.name}: line {unread[0]} ends by a SystemExit the hook cannot read"


def test_no_library_module_arms_the_hook():
    """A notebook imports the library: only a program (a script, the trainer's main when
    it joined a group) decides how its process ends."""
    for path in REPO.glob("lab_utils/**/*.py"):
        if path.name in ("gloo_exit.py", "cli.py"):
            continue
        arms, _, _ = arming(path.read_text())
        assert not arms, f"{path.relative_to(REPO)} arms the Gloo exit hook"
    arms, _, bare = arming((REPO / "lab_utils" / "cli.py").read_text())
    assert len(arms) == 1 and not bare  # lab-train: once, when it joined a group


def test_the_arming_check_catches_what_it_names():
    forgot = "def main():\n    info = labdist.init()\n    labdist.shutdown()\n"
    assert arming(forgot) == ([], [], []) and joins_a_group(forgot)
    late = "def main():\n    # why\n    dist.destroy_process_group()\n    gloo_exit.arm()\n"
    assert arming(late) == ([4], [3], [4])  # and no comment right above the arm call
    silent = "def main():\n    x = 1\n    gloo_exit.arm()\n    rpc.init_rpc('a')\n"
    assert arming(silent) == ([3], [], [3])
    # left in a helper defined above main, armed in main before calling it: fine
    helper = (
        "def finish():\n    dist.destroy_process_group()\n"
        "def main():\n    # why\n    gloo_exit.arm()\n    finish()\n"
    )
    assert arming(helper) == ([5], [], [])
    assert not joins_a_group("hvd.init()\n")
    ends = (
        "def main():\n    raise SystemExit('x')\nif __name__ == '__main__':\n    sys.exit(main())\n"
    )
    assert unread_exits(ends) == [2, 4]
    assert unread_exits("sys.exit(main() or 0)\ndef main():\n    exit(2)\n") == [1, 3]
    assert unread_exits("def main():\n    sys.exit(str(1))\nmain()\nsys.exit(f'{1}')\n") == []


def test_the_module_names_its_upstream_source():
    """The workaround carries the link to PyTorch's abandoned fix of the same cause."""
    assert gloo_exit.UPSTREAM == "https://github.com/pytorch/pytorch/pull/179291"
    assert gloo_exit.UPSTREAM in gloo_exit.__doc__


def test_the_soak_runs_every_script_that_joins_a_group():
    """``scripts/exit_soak.py`` measures the guarantee: it must run each script that arms."""
    from lab_utils.source import load_script

    soaked = {
        job.script.resolve() for job in load_script(REPO / "scripts" / "exit_soak.py").JOBS.values()
    }
    missing = [
        str(p.relative_to(REPO))
        for p in PROGRAMS
        if joins_a_group(p.read_text()) and p.resolve() not in soaked
    ]
    assert not missing, f"scripts/exit_soak.py runs none of {missing}"
