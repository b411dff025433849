"""The contract between notebooks and scripts, read from the source.

- Every event a lab script emits (``lab_utils.metrics.emit`` on rank 0) is listed in its
  docstring with its fields, and every event listed is emitted: a notebook reads them by
  name (``result.event(name)``, ``result.events(name)``), so the docstring is where a
  student and a maintainer find what comes back.
- No script or library module imports a lab's ``labN_solutions``, directly or through
  another module: what a script runs is library code; only the exercises' machinery
  (``lab_utils.exercises``, the self-checks, the solutions themselves) reads the
  references. A reference a script needs lives in the library and is re-exported by
  its solutions module, and stays an exercise (the notebook's hint still names it).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from conftest import REPO

from lab_utils import exercises

SCRIPTS = sorted((REPO / "labs").glob("*/scripts/*.py"))
LIBRARY = REPO / "lab_utils"


# ------------------------------------------------------------------ events in the source
@dataclass
class Record:
    """A record the source builds: its event's name (``None`` when the source does not
    say) and the fields it spells out (those of a ``**spread`` it cannot see are left out)."""

    name: str | None
    fields: set[str] = field(default_factory=set)


def _is_emit(call: ast.Call) -> bool:
    f = call.func
    return (isinstance(f, ast.Attribute) and f.attr == "emit") or (
        isinstance(f, ast.Name) and f.id == "emit"
    )


def _functions(tree: ast.AST) -> Iterator[ast.FunctionDef | ast.AsyncFunctionDef]:
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield node


def _scope_of(tree: ast.Module, target: ast.AST) -> ast.AST:
    """The innermost function (or the module) that holds ``target``."""
    holders = [f for f in _functions(tree) if any(n is target for n in ast.walk(f))]
    return min(holders, key=lambda f: f.end_lineno - f.lineno, default=tree)


def _added_fields(scope: ast.AST, name: str) -> set[str]:
    """Fields a function adds to the dict ``name``: ``name["k"] = ...``, ``name.update(k=...)``."""
    out = set()
    for node in ast.walk(scope):
        if isinstance(node, ast.Assign):
            for t in node.targets:
                if (
                    isinstance(t, ast.Subscript)
                    and isinstance(t.value, ast.Name)
                    and t.value.id == name
                    and isinstance(t.slice, ast.Constant)
                ):
                    out.add(str(t.slice.value))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "update"
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == name
        ):
            out |= {k.arg for k in node.keywords if k.arg}
    return out


def _records(tree: ast.Module, value: ast.AST, scope: ast.AST, depth: int = 0) -> list[Record]:
    """The records the expression ``value`` can be: a dict literal (its ``**spreads``
    followed), a name bound in the same function to one, or what a function of the same
    file returns."""
    if depth > 4:
        return [Record(None)]
    if isinstance(value, ast.Dict):
        own, fields, spread = None, set(), []
        for k, v in zip(value.keys, value.values):
            if k is None:
                spread += _records(tree, v, scope, depth + 1)
            elif isinstance(k, ast.Constant) and k.value == "event":
                own = v.value if isinstance(v, ast.Constant) and isinstance(v.value, str) else ""
            elif isinstance(k, ast.Constant):
                fields.add(str(k.value))
        fields |= {f for r in spread for f in r.fields}
        named = [r.name for r in spread if r.name]
        if own is not None:
            return [Record(own or None, fields)]
        return [Record(n, fields) for n in named] or [Record(None, fields)]
    if isinstance(value, ast.Name):
        found = []
        for node in ast.walk(scope):
            if isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(t, ast.Name) and t.id == value.id for t in targets):
                    found += _records(tree, node.value, scope, depth + 1)
        added = _added_fields(scope, value.id)
        return [Record(r.name, r.fields | added) for r in found] or [Record(None, added)]
    if isinstance(value, ast.Call) and isinstance(value.func, ast.Name):
        for fn in tree.body:
            if isinstance(fn, ast.FunctionDef) and fn.name == value.func.id:
                returned = [r.value for r in ast.walk(fn) if isinstance(r, ast.Return) and r.value]
                return [rec for v in returned for rec in _records(tree, v, fn, depth + 1)]
    return [Record(None)]


def emitted(path: Path) -> tuple[dict[str, set[str]], list[str]]:
    """The events ``path``'s own emit calls send, with their fields, and the calls whose
    event it cannot read (the name must be a literal the reader can follow)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    events: dict[str, set[str]] = {}
    unread = []
    for call in ast.walk(tree):
        if isinstance(call, ast.Call) and _is_emit(call) and call.args:
            for r in _records(tree, call.args[0], _scope_of(tree, call)):
                if r.name is None:
                    unread.append(f"{path.name}:{call.lineno}")
                else:
                    events.setdefault(r.name, set()).update(r.fields)
    return events, unread


def _emitters(path: Path) -> dict[str, dict[str, set[str]]]:
    """Per top-level function or class of the module ``path``: the events emitted in it."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out: dict[str, dict[str, set[str]]] = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            for call in ast.walk(node):
                if isinstance(call, ast.Call) and _is_emit(call) and call.args:
                    for r in _records(tree, call.args[0], _scope_of(tree, call)):
                        if r.name:
                            out.setdefault(node.name, {}).setdefault(r.name, set()).update(r.fields)
    return out


def _module_file(name: str, folder: Path) -> Path | None:
    """The file of module ``name``: a sibling of the script, or one of ``lab_utils``."""
    if (folder / f"{name}.py").is_file():
        return folder / f"{name}.py"
    parts = name.split(".")
    if re.fullmatch(r"lab\d+_\w+", name):  # a lab's own module, beside its notebooks
        found = sorted(REPO.glob(f"labs/{name.split('_')[0]}_*/{name}.py"))
        return found[0] if found else None
    if parts[0] == "lab_utils":
        base = REPO.joinpath(*parts)
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                return candidate
    return None


def events_of(script: Path) -> tuple[dict[str, set[str]], list[str]]:
    """What ``script`` emits: its own emit calls, and those inside the functions and
    classes it uses from its sibling modules (``common.look``) and from ``lab_utils``
    (``Trainer``)."""
    events, unread = emitted(script)
    tree = ast.parse(script.read_text(encoding="utf-8"))
    used: set[tuple[Path, str]] = set()
    modules: dict[str, Path] = {}  # a name in the script -> the module it is
    names: dict[str, tuple[Path, str]] = {}  # a name in the script -> (module, its name there)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if (f := _module_file(a.name, script.parent)) is not None:
                    modules[a.asname or a.name] = f
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for a in node.names:
                if (f := _module_file(f"{node.module}.{a.name}", script.parent)) is not None:
                    modules[a.asname or a.name] = f
                elif (f := _module_file(node.module, script.parent)) is not None:
                    names[a.asname or a.name] = (f, a.name)
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in modules
        ):
            used.add((modules[node.value.id], node.attr))
        elif isinstance(node, ast.Name) and node.id in names:
            used.add(names[node.id])
    for module, name in used:
        for event, fields in _emitters(module).get(name, {}).items():
            events.setdefault(event, set()).update(fields)
    return events, unread


def documented(script: Path) -> dict[str, set[str]]:
    """The events the script's docstring lists, with their fields. The list follows a line
    that starts with ``Events`` and ends with ``:``; each entry is ``    name: field,
    field (what it is), ...`` (four spaces), continued on lines of eight."""
    doc = ast.get_docstring(ast.parse(script.read_text(encoding="utf-8"))) or ""
    lines = doc.splitlines()
    start = next(
        (i for i, line in enumerate(lines) if line.startswith("Events") and line.endswith(":")),
        None,
    )
    if start is None:
        return {}
    entries: list[str] = []
    for line in lines[start + 1 :]:
        if re.match(r"    [a-z_]\w*: ", line):
            entries.append(line.strip())
        elif re.match(r"        \S", line) and entries:
            entries[-1] += " " + line.strip()
        else:
            break
    out = {}
    for entry in entries:
        name, _, text = entry.partition(": ")
        while re.search(r"\([^()]*\)", text):  # what a field is, in brackets, is no field
            text = re.sub(r"\([^()]*\)", "", text)
        out[name] = {m.group(1) for part in text.split(",") if (m := re.match(r"\s*(\w+)", part))}
    return out


LAUNCHED = [s for s in SCRIPTS if 'if __name__ == "__main__":' in s.read_text(encoding="utf-8")]


@pytest.mark.parametrize("script", LAUNCHED, ids=lambda p: f"{p.parent.parent.name}/{p.name}")
def test_every_event_a_script_emits_is_listed_in_its_docstring(script):
    events, unread = events_of(script)
    assert not unread, f"emit calls whose event's name the source does not spell out: {unread}"
    listed = documented(script)
    where = f"{script.relative_to(REPO)}'s docstring"
    assert set(events) <= set(listed), f"{where} does not list {sorted(set(events) - set(listed))}"
    assert set(listed) <= set(events), (
        f"{where} lists {sorted(set(listed) - set(events))}, never emitted"
    )
    for event, fields in events.items():
        missing = fields - listed[event]
        assert not missing, f"{where}: event {event!r} does not list its fields {sorted(missing)}"


def test_the_reader_finds_events_and_fields_it_must():
    """The reader itself: a record built in a variable, a spread, fields added later, a
    record a local function returns, a name it cannot read, and events from the
    functions a script uses (common.look's eval, Trainer's epoch)."""
    lab2 = REPO / "labs" / "lab2_data_parallel" / "scripts"
    assert events_of(lab2 / "train_serial.py")[0].keys() == {"summary", "eval"}
    lab3 = REPO / "labs" / "lab3_large_batch" / "scripts" / "train_large_batch.py"
    assert events_of(lab3)[0].keys() == {"summary", "epoch"}
    cp = REPO / "labs" / "lab4_model_parallel" / "scripts" / "context_parallel.py"
    assert {"ran", "error", "out_rel_err"} <= emitted(cp)[0]["torch_context_parallel"]
    hand = REPO / "labs" / "lab6_efficiency" / "scripts" / "ddp_by_hand.py"
    assert {"procs", "grad_rel_err"} <= emitted(hand)[0]["equivalence"]
    pb = REPO / "labs" / "lab6_efficiency" / "scripts" / "predicted_bytes.py"
    assert {"psi", "d_model"} <= emitted(pb)[0]["model"]


def test_an_unlisted_or_unreadable_event_fails(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(
        '"""A job.\n\nEvents it emits:\n    done: steps, acc (accuracy, 0..1)\n"""\n'
        "from lab_utils import metrics\n"
        "def main(kind):\n"
        "    metrics.emit({'event': 'done', 'steps': 1, 'acc': 0.5})\n"
        "    record = {'event': 'extra', 'x': 1}\n"
        "    record['late'] = 2\n"
        "    metrics.emit(record)\n"
        "    metrics.emit({'event': kind})\n"
    )
    events, unread = events_of(script)
    assert events == {"done": {"steps", "acc"}, "extra": {"x", "late"}}
    assert unread == ["job.py:12"]
    assert documented(script) == {"done": {"steps", "acc"}}


# ------------------------------------------------------- scripts never run the solutions


def _is_machinery(path: Path) -> bool:
    """The exercises' machinery may read the references: the solutions themselves,
    ``lab_utils.exercises`` and the self-checks (which compare a student's function with
    the reference), wherever a lab keeps them."""
    rel = path.relative_to(REPO).as_posix()
    return (
        rel == "lab_utils/exercises.py"
        or "checks" in path.stem
        or "solutions" in path.stem
        or "/checks/" in rel
    )


def _imported(path: Path) -> set[Path]:
    """The files of ``lab_utils`` (and the script's siblings) that ``path`` imports
    anywhere in it (a function's import runs when it is called), with the packages they
    sit in; a module name written as a string (``import_module("lab4_solutions")``)
    counts too."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = (
        ".".join(path.relative_to(REPO).with_suffix("").parts[:-1])
        if path.is_relative_to(LIBRARY)
        else ""
    )
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, *([base] if base else [])])
            names |= {base} | {f"{base}.{a.name}" for a in node.names}
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and re.fullmatch(r"lab\d+_solutions", node.value)
        ):
            names.add(node.value)
    files = set()
    for name in names:
        parts = name.split(".")
        for i in range(1, len(parts) + 1):  # importing a.b.c runs a and a.b too
            if (f := _module_file(".".join(parts[:i]), path.parent)) is not None and f != path:
                files.add(f)
    return files


def reaches_solutions(path: Path) -> list[Path] | None:
    """The chain of imports from ``path`` to a lab's ``labN_solutions``, or ``None``."""
    seen = {path}
    todo = [[path]]
    while todo:
        chain = todo.pop()
        for f in sorted(_imported(chain[-1])):
            # labN_solutions.py beside the lab's notebooks, or the machinery that loads them
            # by name (exercises.reference -> paths.lab_module, a string no reader sees)
            if f.stem.endswith("_solutions") or f == LIBRARY / "exercises.py":
                return [*chain, f]
            if f not in seen:
                seen.add(f)
                todo.append([*chain, f])
    return None


CHECKED = [
    p
    for p in [
        *sorted((REPO / "labs").glob("*/*.py")),
        *SCRIPTS,
        *sorted(LIBRARY.rglob("*.py")),
    ]
    if not _is_machinery(p)
]


def test_no_script_or_library_module_imports_the_solutions():
    chains = {p: c for p in CHECKED if (c := reaches_solutions(p))}
    shown = [" -> ".join(str(f.relative_to(REPO)) for f in c) for c in chains.values()]
    assert not chains, "a script or library module runs the reference solutions:\n" + "\n".join(
        shown
    )


def test_the_import_reader_sees_every_form(tmp_path):
    """What the reader must see: a plain, a from- and a function-local import, a name in a
    string, and the way through a library module that imports the solutions."""
    for i, line in enumerate(
        [
            "from lab4_solutions import top_k_route",
            "from lab6_solutions import make_buckets",
            "import lab4_solutions as reference",
            "def f():\n    import lab6_solutions",
            "import importlib\nimportlib.import_module('lab4_solutions')",
            "from lab_utils import exercises",  # its reference() imports them
        ]
    ):
        script = tmp_path / f"script{i}.py"
        script.write_text(line + "\n")
        assert reaches_solutions(script), line
    clean = tmp_path / "clean.py"
    clean.write_text("from lab_utils import moe, ring_attention, buckets\n")
    assert reaches_solutions(clean) is None


@pytest.mark.parametrize(
    "key, library",
    [
        ("lab4.top_k_route", "lab_utils.moe"),
        ("lab4.ring_attention", "lab_utils.ring_attention"),
        ("lab6.make_buckets", "lab_utils.buckets"),
    ],
)
def test_a_reference_a_script_runs_is_library_code_and_still_an_exercise(key, library, monkeypatch):
    """The reference is the library's function (the script runs exactly the answer the
    check compares with), and a student's never-run exercise cell is still named."""
    import importlib

    lab, _, name = key.partition(".")
    assert exercises.reference(key) is getattr(importlib.import_module(library), name)
    monkeypatch.delenv("LABS_SOLUTIONS", raising=False)
    hint = exercises.downstream_hint(NameError(f"name {name!r} is not defined", name=name))
    assert hint is not None and key in hint
