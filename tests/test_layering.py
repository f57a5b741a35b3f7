"""The layering of the library: ops under modeling, data and evaluation, which never
import the engine; nothing in ``detector`` imports the ``benchmarks`` package or
``tools`` (a fresh interpreter, so nothing imported by other tests counts)."""

from __future__ import annotations

import ast
import subprocess
import sys

from conftest import ROOT  # noqa: E402


def test_lower_layers_do_not_import_engine_or_benchmarks():
    code = (
        "import sys, detector.ops, detector.modeling, detector.data, detector.evaluation, detector.distributed, "
        "detector.config; "
        "print(sorted(m for m in sys.modules if m.startswith(('detector.engine', 'benchmarks', 'tools'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"lower layers pulled in: {out.stdout.strip()}"


def test_detector_does_not_import_benchmarks_and_nothing_imports_tools():
    # Nor matplotlib: detector.evaluation.mpl imports it at the first drawing, so that a
    # process that draws nothing (a training run without evaluation, a rank) saves its
    # 0.5-0.7 s of imports.
    code = ("import sys, pkgutil, importlib, detector; "
            "[importlib.import_module(m.name) for m in pkgutil.walk_packages(detector.__path__, 'detector.')]; "
            "print(sorted(m for m in sys.modules if m.startswith(('benchmarks', 'tools', 'matplotlib'))))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"detector pulled in: {out.stdout.strip()}"
    # Statically too, including imports inside functions: no module of a lower layer
    # names a higher one.
    above_engine = ("benchmarks", "tools")
    higher = {  # layer -> the packages above it; "" is every module of detector/
        "ops": ("detector.modeling", "detector.data", "detector.engine", "detector.evaluation") + above_engine,
        "modeling": ("detector.engine", "detector.evaluation") + above_engine,
        "data": ("detector.engine", "detector.evaluation") + above_engine,
        "evaluation": ("detector.engine",) + above_engine,
        "": above_engine,
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


def imported_names(source: str, package: tuple = ()) -> list:
    """Every module name that ``source`` imports, at any depth (inside functions too),
    relative imports resolved against ``package`` (the module's dotted path, as parts)."""
    names = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package[: -node.level]
                base = ".".join(parts + ((base,) if base else ()))
            names.append(base)
    return names


def imports_of_top_packages(source: str, package: tuple, top=("benchmarks", "tools")) -> list:
    """The imports in ``source`` of the packages ``top`` or their submodules."""
    return [n for n in imported_names(source, package) if n in top or n.startswith(tuple(t + "." for t in top))]


def test_library_never_imports_benchmarks_or_tools():
    """No file of ``detector/`` imports the top-level ``benchmarks`` or ``tools`` packages
    (statically, so an import inside a function counts too)."""
    bad = [f"{path.relative_to(ROOT)}: {name}"
           for path in sorted((ROOT / "detector").rglob("*.py"))
           for name in imports_of_top_packages(path.read_text(), path.relative_to(ROOT).with_suffix("").parts)]
    assert not bad, bad


def test_import_scan_sees_imports():
    """The scan above is able to fail: plain, from- and in-function imports are found,
    and names that only start alike (``toolz``, ``detector.benchmarks_x``) are not."""
    source = ("import benchmarks.timing\nfrom tools import train\nimport toolz\n"
              "from .benchmarks_x import y\n\ndef f():\n    import tools.eval\n")
    found = imports_of_top_packages(source, ("detector", "engine", "trainer"))
    assert found == ["benchmarks.timing", "tools", "tools.eval"]
