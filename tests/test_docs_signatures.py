"""docs/ARCHITECTURE.md is a contract: every signature it documents must match the code.

Under each ``### `lab_utils.<module>` `` heading, every inline code span that looks
like a call, ``name(arg, kw=default, *, other=...) -> ...``, is resolved to a function
or class of that module (or a method of one of its classes) and its parameter names
are compared, in order, with ``inspect.signature``. A name that resolves to nothing
fails too: the page must not document what the code does not have.
"""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parent.parent / "docs" / "ARCHITECTURE.md"
SECTION = re.compile(r"^### `(lab_utils\.\w+)`", re.M)
CALL = re.compile(r"`(?:([\w.]+)\.)?(\w+)\(([^`]*?)\)(?:\s*->[^`]*)?`", re.S)


def _split_args(text: str) -> list[str]:
    """Top-level comma-separated parts of an argument list (brackets respected)."""
    parts, depth, cur = [], 0, ""
    for ch in text:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    return [p.strip() for p in parts if p.strip()]


def documented_params(args: str) -> list[str]:
    """Parameter names of a documented argument list: ``x, y=1, *, z`` → [x, y, z];
    ``**kw`` and ``*args`` keep their stars; a bare ``*`` or ``...`` is dropped."""
    names = []
    for part in _split_args(" ".join(args.split())):
        if part in ("*", "...", "/"):
            continue
        name = re.split(r"[=:]", part, maxsplit=1)[0].strip()
        names.append(name)
    return names


def code_params(obj) -> list[str]:
    sig = inspect.signature(obj)
    out = []
    for p in sig.parameters.values():
        if p.name in ("self", "cls"):
            continue
        star = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}
        out.append(star.get(p.kind, "") + p.name)
    return out


def _resolve(module, name: str, owner: str | None = None):
    """``owner.name`` where ``owner`` is a class of the module (``Trainer.fit``), else
    the module's function/class ``name``, or the one method of that name among its
    classes."""
    if owner is not None:
        return getattr(getattr(module, owner), name, None)
    obj = getattr(module, name, None)
    if obj is not None and callable(obj):
        return obj
    methods = {
        id(m): m
        for cls in vars(module).values()
        if inspect.isclass(cls) and cls.__module__ == module.__name__
        for m in [getattr(cls, name, None)]
        if m is not None and callable(m)
    }
    return next(iter(methods.values())) if len(methods) == 1 else None


def documented_signatures() -> list[tuple[str, str, list[str]]]:
    """(module, name, documented parameter names) for every call-like span; ``name`` is
    ``Class.method`` for a method. Spans on other objects (``torch.load(...)``) are
    not the module's and are left out."""
    text = DOC.read_text(encoding="utf-8")
    heads = list(SECTION.finditer(text))
    out = []
    for i, head in enumerate(heads):
        end = heads[i + 1].start() if i + 1 < len(heads) else text.find("\n## ", head.end())
        body = text[head.end() : end if end > 0 else len(text)]
        module = importlib.import_module(head.group(1))
        for call in CALL.finditer(body):
            owner, name, args = call.groups()
            if owner is not None and not inspect.isclass(getattr(module, owner, None)):
                continue
            full = f"{owner}.{name}" if owner else name
            out.append((head.group(1), full, documented_params(args)))
    return out


SIGNATURES = documented_signatures()


def test_the_page_documents_signatures():
    assert len(SIGNATURES) >= 30
    assert {m for m, _, _ in SIGNATURES} >= {
        "lab_utils.train",
        "lab_utils.launch",
        "lab_utils.regression",
        "lab_utils.optim",
    }


@pytest.mark.parametrize(
    ("module", "name", "params"), SIGNATURES, ids=[f"{m}.{n}" for m, n, _ in SIGNATURES]
)
def test_documented_signature_matches_the_code(module, name, params):
    mod = importlib.import_module(module)
    owner, _, short = name.rpartition(".")
    obj = _resolve(mod, short, owner or None)
    assert obj is not None, f"{module} documents {name}(), which it does not have"
    actual = code_params(obj)
    assert params == actual, (
        f"docs/ARCHITECTURE.md: {module}.{name}({', '.join(params)}) "
        f"but the code has ({', '.join(actual)})"
    )


def test_a_wrong_signature_is_caught():
    from lab_utils import train

    assert documented_params("model, optimizer, *, loss_fn=None, **kw") == [
        "model",
        "optimizer",
        "loss_fn",
        "**kw",
    ]
    assert documented_params("a, b=(1, 2), *, c: int = 3") == ["a", "b", "c"]
    assert documented_params("model, loader") != code_params(train.evaluate)
