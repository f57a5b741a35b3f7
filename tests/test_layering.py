"""The layering of the library: modeling, data and evaluation never import the engine
or the benchmark (a fresh interpreter, so nothing imported by other tests counts)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_lower_layers_do_not_import_engine_or_benchmark():
    code = (
        "import sys, detector.modeling, detector.data, detector.evaluation, detector.distributed, detector.config; "
        "print(sorted(m for m in sys.modules if m.startswith(('detector.engine', 'detector.benchmark', 'tools'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"lower layers pulled in: {out.stdout.strip()}"


def test_engine_does_not_import_benchmark_and_nothing_imports_tools():
    code = "import sys, detector.engine.trainer; print(sorted(m for m in sys.modules if m.startswith('detector.benchmark')))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"the engine pulled in: {out.stdout.strip()}"
    # Statically too, including imports inside functions: no module of a lower layer
    # names a higher one.
    higher = {  # layer -> the packages above it
        "modeling": ("detector.engine", "detector.benchmark", "detector.evaluation", "tools"),
        "data": ("detector.engine", "detector.benchmark", "detector.evaluation", "tools"),
        "evaluation": ("detector.engine", "detector.benchmark", "tools"),
        "engine": ("detector.benchmark", "tools"),
    }
    bad = []
    for layer, forbidden in higher.items():
        for path in sorted((ROOT / "detector" / layer).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                names = []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom):
                    base = node.module or ""
                    if node.level:  # relative: resolve against the package
                        pkg = path.relative_to(ROOT).with_suffix("").parts[: -node.level]
                        base = ".".join(pkg + ((base,) if base else ()))
                    names = [base]
                bad += [f"{path.relative_to(ROOT)}: {n}" for n in names if n.startswith(forbidden)]
    assert not bad, bad
