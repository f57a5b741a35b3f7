"""Size rules of the library (design.md, house rules), checked on every
file of ``detector/``: no module over 450 lines, no function over 60, no class over 250
(``end_lineno - lineno + 1`` of the ``ast`` node, decorators not counted). (No
``os.environ`` write at import: tests/test_no_network_at_import.py.)"""

from __future__ import annotations

import ast
from typing import List

from conftest import ROOT  # noqa: E402

MAX_MODULE_LINES = 450
MAX_FUNCTION_LINES = 60
MAX_CLASS_LINES = 250

LIBRARY_FILES = sorted((ROOT / "detector").rglob("*.py"))


def oversized(source: str, where: str) -> List[str]:
    """``"where:line name: N lines"`` for each function over MAX_FUNCTION_LINES and each
    class over MAX_CLASS_LINES in ``source`` (nested ones and methods included)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            limit, kind = MAX_FUNCTION_LINES, "function"
        elif isinstance(node, ast.ClassDef):
            limit, kind = MAX_CLASS_LINES, "class"
        else:
            continue
        length = node.end_lineno - node.lineno + 1
        if length > limit:
            found.append(f"{where}:{node.lineno} {kind} {node.name}: {length} lines (limit {limit})")
    return found


def test_no_module_over_450_lines():
    long = [f"{p.relative_to(ROOT)}: {n} lines" for p in LIBRARY_FILES
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES]
    assert not long, f"modules over {MAX_MODULE_LINES} lines:\n" + "\n".join(long)


def test_no_function_over_60_lines_and_no_class_over_250():
    found = [line for p in LIBRARY_FILES for line in oversized(p.read_text(), str(p.relative_to(ROOT)))]
    assert not found, "\n".join(found)


def test_size_check_sees_long_functions_and_classes():
    """The check above is able to fail: a 61-line function (a method here) and a 251-line
    class are flagged; a 60-line function is not."""
    body = "".join(f"        x{i} = {i}\n" for i in range(59))  # def line + 59 = 60 lines
    ok = f"class A:\n    def short(self):\n{body}"
    assert oversized(ok, "ok.py") == []
    too_long = ok.replace("def short(self):\n", "def long(self):\n        y = 0\n")
    assert oversized(too_long, "x.py") == ["x.py:2 function long: 61 lines (limit 60)"]
    big = "class B:\n" + "".join(f"    a{i} = {i}\n" for i in range(250))
    assert oversized(big, "b.py") == ["b.py:1 class B: 251 lines (limit 250)"]
