"""Show a script's code in a notebook, and import a script to call its functions.

A notebook shows the code the student is about to run: the whole file or one function or
class of it, found by name with :mod:`ast` (no string search, so an edit elsewhere in the
file cannot shift what is shown)."""

from __future__ import annotations

import ast
import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

LANGUAGES = {".py": "python", ".sh": "bash", ".sbatch": "bash"}
Definition = ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef


def _definitions(body: list[ast.stmt]) -> dict[str, Definition]:
    """The functions and classes defined directly in ``body``, by name."""
    return {
        node.name: node
        for node in body
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
    }


def _find(tree: ast.Module, function: str, path: Path) -> Definition:
    """The definition named ``function`` (``"Class.method"`` for a method) in ``tree``;
    a ``LookupError`` naming the definitions that exist when it is not there."""
    body, node = tree.body, None
    for i, part in enumerate(function.split(".")):
        found = _definitions(body)
        if part not in found:
            where = ".".join(function.split(".")[:i]) or path.name
            raise LookupError(
                f"{path} has no {part!r} in {where}; it defines: {', '.join(found) or 'nothing'}"
            )
        node = found[part]
        body = node.body
    return node


def source_of(path: str | Path, function: str | None = None) -> tuple[str, int, int]:
    """The source of ``path``, or of its function or class ``function`` (decorators
    included), with its first and last line numbers in the file."""
    path = Path(path)
    text = path.read_text()
    if function is None:
        return text.rstrip("\n") + "\n", 1, len(text.splitlines())
    node = _find(ast.parse(text, filename=str(path)), function, path)
    first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
    lines = text.splitlines()[first - 1 : node.end_lineno]
    return "\n".join(lines) + "\n", first, node.end_lineno


def _in_notebook() -> bool:
    """True inside an IPython kernel or shell (where rich display is rendered)."""
    ipython = sys.modules.get("IPython")
    return ipython is not None and ipython.get_ipython() is not None


def render(rich: str, plain: str, *, markdown: bool = False) -> None:
    """Display ``rich`` (HTML, or Markdown with ``markdown=True``) in a notebook; print
    ``plain`` anywhere else."""
    if not _in_notebook():
        print(plain)
        return
    from IPython.display import HTML, Markdown, display

    display(Markdown(rich) if markdown else HTML(rich))


def code_markdown(code: str, title: str, language: str = "python") -> str:
    """``code`` as a fenced block under ``title``: the notebook highlights it in its own
    theme. The fence is longer than any run of backticks in the code."""
    longest = max((len(run) for run in re.findall("`+", code)), default=0)
    fence = "`" * max(3, longest + 1)
    return f"`{title}`\n\n{fence}{language}\n{code}{fence}\n"


def show_source(path: str | Path | ModuleType, function: str | None = None) -> str:
    """Show the file ``path`` or the module's file (or its function or class ``function``;
    ``"Class.method"`` for a method) as highlighted code in a notebook, plain text
    elsewhere; return it."""
    name = path.__name__ if isinstance(path, ModuleType) else str(path)
    if isinstance(path, ModuleType):
        path = path.__file__
    code, first, last = source_of(path, function)
    title = name + (f" · {function}" if function else "") + f" (lines {first}–{last})"
    language = LANGUAGES.get(Path(path).suffix, "")
    render(code_markdown(code, title, language), f"# {title}\n{code}", markdown=True)
    return code


def load_script(path: str | Path, name: str | None = None) -> ModuleType:
    """A lab script (not a package module) imported from its file, to call its functions
    in the notebook; its folder goes on ``sys.path`` so that it can import its neighbours.
    The script's ``main`` does not run: the scripts guard it with ``__name__``."""
    path = Path(path).resolve()
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(name or f"script_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
