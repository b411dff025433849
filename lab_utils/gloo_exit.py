"""End a rank that used a Gloo process group without letting Python finalize under Gloo.

The problem (torch 2.13, CPU, Gloo). A Gloo work keeps the caller's thread-local state,
Python objects included; the C++ worker thread that finished it releases that state a
moment after ``wait()`` returned, and releasing it takes the GIL. torch cannot join
those threads while anything references the group: ``destroy_process_group()`` does
not, and DDP's reducer, FSDP's state, a DeviceMesh, an RPC agent or a script's own
variable keep the group alive. So a job that did all its work can still end badly:

* the last reference to a destroyed group goes while Python runs (DDP dropped at the
  end of ``main``): the group's destructor joins the workers while holding the GIL that
  one of them waits for, and the rank hangs;
* the interpreter is finalizing: CPython ends a thread that asks for the GIL with
  ``pthread_exit``, whose unwinding through a C++ destructor calls ``std::terminate``
  ("terminate called without an active exception", SIGABRT).

PyTorch's own attempt at a fix names the same cause: pull request #179291, "[c10d]
Register atexit handler to destroy process groups before interpreter finalization"
(https://github.com/pytorch/pytorch/pull/179291, April 2026): "Gloo's C++ worker
threads may still hold AsyncWork objects containing tensors with Python references.
During interpreter finalization, destroying these tensors triggers a GIL acquire that
crashes with SIGABRT". Its author closed it unmerged two weeks later ("Abandoning, this
requires discussion and it's much more complicated than I anticipated"), so the course
works around it here.

The workaround. :func:`arm` is called once, visibly, by each script that joins a group
(next to its ``init``); importing this module, or :mod:`lab_utils.dist`, changes
nothing. Once armed, every group destroyed in this process stays referenced until the
process ends, and the process ends without finalizing the interpreter: at exit, after
every other exit handler has run and the open files are flushed, ``os._exit`` with the
status Python would have given (0 when ``__main__`` ran to its end, 1 after an uncaught
exception, whose traceback is printed first, ``n`` for ``sys.exit(n)``). Where that
status is not known for certain (``raise SystemExit``, Ctrl-C, a failed flush), Python
exits as usual: a failure's status is never replaced. ``scripts/exit_soak.py`` measures
the result (no abnormal exit in many runs of every distributed script).

One way to lose it. ``sys.exit(main())`` with ``arm()`` inside ``main`` looks up
``sys.exit`` before ``main()`` runs (Python evaluates the function before its arguments:
the Python Language Reference, 6.3.4 "Calls" and 6.16 "Evaluation order"), so the exit it
calls is Python's own: the hook never reads the status, and the rank finalizes, where
Gloo can still abort it. That happened once to the course's own trainer in CI ("terminate
called without an active exception", rank 1 of ``mpirun -np 2``). ``raise SystemExit``,
``exit()`` and ``quit()`` are the same; so is a ``SystemExit`` that something keeps alive
past the end of ``__main__``. When a ``SystemExit`` whose status the hook could not read
ended ``__main__``, the hook says so on stderr (:data:`UNKNOWN_STATUS`), with the fix:
exit with ``sys.exit(...)``, and end the script with ``main()``, or ``status = main()``
then ``sys.exit(status)``.
"""

from __future__ import annotations

import atexit
import dis
import functools
import gc
import io
import os
import sys
import types
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

UPSTREAM = "https://github.com/pytorch/pytorch/pull/179291"

# What the hook prints when a SystemExit it cannot read ended __main__ (the module's docstring).
UNKNOWN_STATUS = (
    "gloo_exit: __main__ ended by a SystemExit whose status the hook could not read "
    "(`raise SystemExit`, `exit()`, `quit()`, or `sys.exit(main())`, which looked sys.exit "
    "up before main() armed the hook), so Python exits with that status the usual way, "
    "finalizing, where a Gloo thread can still abort this rank. Exit with `sys.exit(...)`, "
    "and end the script with `main()`, or `status = main()` then `sys.exit(status)` "
    "(lab_utils/gloo_exit.py says why)."
)

_kept_groups: list[Any] = []  # destroyed groups: deleted by no one, joined by no one

_RETURNS = {dis.opmap[name] for name in ("RETURN_VALUE", "RETURN_CONST") if name in dis.opmap}


@dataclass
class _ExitWatch:
    """What the exit hook needs to know: how ``__main__`` ended, and with which status."""

    main_frame: types.FrameType | None
    exit_ref: weakref.ref | None = None  # keeps the callback on the last sys.exit exception
    exited: tuple[Any] | None = None  # its status, once Python dropped it after __main__ ended


class _Once:
    """An exit handler registered after the hook: it runs before it, and not again when
    the hook runs the handlers registered before it. Equal to its function, so that
    ``atexit.unregister(func)`` still finds it."""

    def __init__(self, func: Callable[..., Any]) -> None:
        self.func, self.done = func, False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.done:
            self.done = True
            return self.func(*args, **kwargs)
        return None

    def __eq__(self, other: object) -> bool:
        return other is self or other == self.func

    def __hash__(self) -> int:
        return hash(self.func)


class _Exit(SystemExit):
    """``sys.exit``'s exception, weakly referable: the hook sees when Python drops it."""


_watch: _ExitWatch | None = None


def armed() -> bool:
    """Whether :func:`arm` ran in this process."""
    return _watch is not None


def _running(frame: types.FrameType | None) -> bool:
    """Whether ``frame`` is on the current call stack (still executing)."""
    f = sys._getframe()
    while f is not None and f is not frame:
        f = f.f_back
    return f is not None


def _main_frame() -> types.FrameType | None:
    """The frame running the ``__main__`` module's code (None under ``python -c``...)."""
    main = sys.modules.get("__main__")
    frame, found = sys._getframe(), None
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals is getattr(
            main, "__dict__", None
        ):
            found = frame
        frame = frame.f_back
    return found


def arm() -> None:
    """From now on, keep destroyed groups alive and end this process without finalizing
    the interpreter, with Python's own exit status (see the module's docstring).

    Call it once in a script that joins a process group (or an RPC agent, which holds
    one), before the group is destroyed; a second call does nothing. It replaces three
    functions for the rest of the process, and only these: ``sys.exit`` (the same
    ``SystemExit``, a subclass the hook can watch, so that it learns the status),
    ``atexit.register`` (a handler registered later still runs once, before the hook)
    and ``torch.distributed.destroy_process_group`` (the same call, which also keeps the
    destroyed groups referenced). Call it from the script, never from a library module
    or a test process: it is the script's decision how its process ends.
    """
    global _watch
    if _watch is not None:
        return
    _watch = _ExitWatch(_main_frame())
    real_register = atexit.register

    def exit_(status: Any = None) -> None:
        exc = _Exit(status)
        if _watch is not None:
            _watch.exited = None

            def dropped(_ref: weakref.ref) -> None:  # caught and dropped inside main: not the end
                if _watch is not None and not _running(_watch.main_frame):
                    _watch.exited = (status,)

            _watch.exit_ref = weakref.ref(exc, dropped)
        try:
            raise exc
        finally:
            del exc  # no cycle through this frame: Python frees it as soon as it is done

    def register(func: Callable[..., Any], *args: Any, **kwargs: Any) -> Callable[..., Any]:
        real_register(_Once(func), *args, **kwargs)
        return func

    real_destroy = c10d.destroy_process_group

    @functools.wraps(real_destroy)
    def destroy_process_group(group: Any = None) -> None:
        world = c10d._world.pg_map
        _kept_groups.extend(world if group in (None, dist.GroupMember.WORLD) else [group])
        real_destroy(group)

    sys.exit, atexit.register = exit_, register
    dist.destroy_process_group = c10d.destroy_process_group = destroy_process_group
    real_register(_exit_without_finalizing)


def _exit_status(watch: _ExitWatch) -> int | None:
    """The status Python would exit with, or None when it is not known for certain."""
    frame = watch.main_frame
    if frame is not None and frame.f_lasti >= 0 and frame.f_code.co_code[frame.f_lasti] in _RETURNS:
        return 0  # __main__ ran to its end
    raised = getattr(sys, "last_value", None)  # Python's record of an uncaught exception
    if raised is not None:
        return None if isinstance(raised, KeyboardInterrupt) else 1
    if watch.exited is None:
        return None  # a SystemExit that sys.exit did not raise, or one caught inside main
    status = watch.exited[0]
    if status is None:
        return 0
    return status & 0xFF if isinstance(status, int) else 1  # Python printed the message


def _flush_open_files() -> bool:
    """Flush every open Python file as finalization would; False if stdout or stderr fails."""
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):
            return False
    for obj in gc.get_objects():
        if issubclass(type(obj), io.IOBase):  # not isinstance: no proxy's __class__ is read
            try:
                if not obj.closed:
                    obj.flush()
            except (OSError, ValueError):
                pass  # finalization too would only report it; the status stays
    return True


def _exit_without_finalizing() -> None:
    """The exit hook: run the exit handlers registered before this one, then os._exit."""
    watch = _watch
    if watch is None:
        return
    status = _exit_status(watch)
    if status is None:
        if watch.main_frame is not None and getattr(sys, "last_value", None) is None:
            print(UNKNOWN_STATUS, file=sys.stderr, flush=True)  # not Ctrl-C: a SystemExit
        watch.main_frame = None  # finalization then clears __main__ as it would unhooked
        return
    atexit.unregister(_exit_without_finalizing)
    # The handlers registered before this one (logging, multiprocessing, weakref.finalize);
    # those registered after it have run, and are _Once.
    atexit._run_exitfuncs()
    if _flush_open_files():
        os._exit(status)
