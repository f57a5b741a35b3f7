"""Size and side-effect rules of the library (design.md, house rules), checked on every
file of ``detector/``: no module over 450 lines, no function over 60, no class over 250
(``end_lineno - lineno + 1`` of the ``ast`` node, decorators not counted), and no
``os.environ`` write when a module is imported."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import List

from conftest import ROOT  # noqa: E402

MAX_MODULE_LINES = 450
MAX_FUNCTION_LINES = 60
MAX_CLASS_LINES = 250

LIBRARY_FILES = sorted((ROOT / "detector").rglob("*.py"))


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


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


# Run in a fresh interpreter with a bare environment (so that ``os.environ.setdefault`` of
# a variable the caller happens to have set still shows): import the third-party packages the library uses (their own
# import-time settings are not ours), then each detector module in turn, and report every
# environment variable that an import added, changed or removed, with the module whose
# import did it (the first one that imported the writer).
ENV_PROBE = """
import importlib, json, os, sys
for lib in ("numpy", "cv2", "torch", "torchvision", "PIL", "omegaconf", "yaml", "pycocotools", "matplotlib"):
    try:
        importlib.import_module(lib)
    except ImportError:
        pass
changes = []
for name in json.loads(sys.argv[1]):
    before = dict(os.environ)
    importlib.import_module(name)
    after = dict(os.environ)
    keys = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
    if keys:
        changes.append([name, keys])
print(json.dumps(changes))
"""


def bare_environ(**extra: str) -> dict:
    """PATH, HOME, TMPDIR and LANG of this process (what an interpreter needs), plus ``extra``."""
    return {**{k: os.environ[k] for k in ("PATH", "HOME", "TMPDIR", "LANG") if k in os.environ}, **extra}


def environ_writes_at_import(modules: List[str], cwd: Path = ROOT, **extra_env: str) -> list:
    """``[[module, [variable, ...]], ...]``: the variables each import of ``modules`` (in
    order, in one fresh interpreter started in ``cwd``) set, changed or removed."""
    out = subprocess.run([sys.executable, "-c", ENV_PROBE, json.dumps(modules)], cwd=cwd,
                         env=bare_environ(**extra_env), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_no_environ_writes_at_import():
    modules = [module_name(p) for p in LIBRARY_FILES if p.name != "__main__.py"]
    changes = environ_writes_at_import(modules)
    assert not changes, f"os.environ written at import (module, variables): {changes}"


def test_environ_probe_sees_writes(tmp_path):
    """The probe above is able to fail: a module that sets a variable at import is named,
    ``setdefault`` included."""
    (tmp_path / "writes_env_probe.py").write_text("import os\nos.environ.setdefault('OMP_WAIT_POLICY', 'PASSIVE')\n")
    changes = environ_writes_at_import(["json", "writes_env_probe"], cwd=tmp_path, PYTHONPATH=str(tmp_path))
    assert changes == [["writes_env_probe", ["OMP_WAIT_POLICY"]]]
