"""Git's clean filter for the course's notebooks: notebook on stdin, stored form on stdout.

`make setup` registers it (``git config filter.labs-notebook.clean``; ``.gitattributes``
applies it to ``*.ipynb``), so ``git diff``, ``git add`` and ``git pull --autostash`` see
a notebook as it is stored: without outputs, execution counts, widget state or what
JupyterLab adds when it runs one (the kernel's full ``language_info``, cell timings,
collapsed outputs). A notebook a student only ran is then unchanged to git; what the
student wrote still shows as a change.

The text is what nbformat (and so JupyterLab) writes. Plain ``json``, no third-party
import: git starts this once per notebook it looks at. Input that is not a notebook (a
file in the middle of a merge conflict) passes through unchanged.
"""

from __future__ import annotations

import json
import sys
from typing import Any

# The kernel the course's notebooks name; JupyterLab rewrites its display name to the
# running kernel's ("Python 3 (ipykernel)") when it opens one.
KERNELSPEC = {"display_name": "Python 3", "language": "python", "name": "python3"}
# Metadata JupyterLab writes while a notebook is used (not by the course's authors), and
# what nbformat never stores.
RUN_CELL_METADATA = ("collapsed", "scrolled", "execution", "ExecuteTime", "jupyter", "trusted")
RUN_NOTEBOOK_METADATA = ("widgets", "orig_nbformat", "orig_nbformat_minor", "signature")
# Attachment types nbformat stores as lists of lines, besides text/*.
LINE_SPLIT_MIMES = ("application/javascript", "image/svg+xml")


def lines(value: str | list[str]) -> list[str]:
    """Multi-line text as nbformat stores it: one string per line, newlines kept."""
    return ("".join(value) if isinstance(value, list) else value).splitlines(True)


def clean_cell(cell: dict[str, Any]) -> None:
    metadata = cell.setdefault("metadata", {})
    for key in RUN_CELL_METADATA:
        metadata.pop(key, None)
    if "source" in cell:
        cell["source"] = lines(cell["source"])
    for bundle in cell.get("attachments", {}).values():
        for mime, value in bundle.items():
            if mime.startswith("text/") or mime in LINE_SPLIT_MIMES:
                bundle[mime] = lines(value)
    if cell.get("cell_type") == "code":
        cell["outputs"] = []
        cell["execution_count"] = None


def clean(nb: dict[str, Any]) -> dict[str, Any]:
    """``nb`` (a notebook's JSON) as the repository stores it; changed in place."""
    metadata = nb.setdefault("metadata", {})
    for key in RUN_NOTEBOOK_METADATA:
        metadata.pop(key, None)
    if metadata.get("kernelspec", {}).get("name") == KERNELSPEC["name"]:
        metadata["kernelspec"] = dict(KERNELSPEC)
    if "language_info" in metadata:  # the running kernel adds its version, lexer, ...
        metadata["language_info"] = {"name": metadata["language_info"].get("name", "python")}
    for cell in nb["cells"]:
        clean_cell(cell)
    return nb


def stored_form(text: str) -> str:
    """The text git stores for a notebook whose file holds ``text``."""
    try:
        nb = json.loads(text)
    except ValueError:  # conflict markers, a half-written file: not ours to change
        return text
    if not isinstance(nb, dict) or not isinstance(nb.get("cells"), list):
        return text
    return (
        json.dumps(clean(nb), indent=1, sort_keys=True, separators=(",", ": "), ensure_ascii=False)
        + "\n"
    )


def main() -> int:
    text = sys.stdin.buffer.read().decode("utf-8")
    sys.stdout.buffer.write(stored_form(text).encode("utf-8"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
