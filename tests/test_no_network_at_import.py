"""No network call and no environment change at import.

albumentations (imported with ``detector.data``) asks PyPI for a newer version at import
unless ``NO_ALBUMENTATIONS_UPDATE=1``. The library sets no process-wide state when
imported; each tool sets the opt-out when it starts, before it imports ``detector``
(as ``conftest.py`` does for the tests)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys

# Runs in a fresh interpreter before the import under test: every DNS lookup or socket
# connect prints a marker and fails, as on a machine with no network.
NETWORK_PROBE = """
import socket, sys
def refuse(*args, **kwargs):
    print("NETWORK ATTEMPT", args[:2], file=sys.stderr, flush=True)
    raise OSError("network unreachable (test)")
socket.getaddrinfo = refuse
socket.create_connection = refuse
socket.socket.connect = refuse
socket.socket.connect_ex = refuse
"""

# Libraries that themselves write os.environ at import (cv2: LD_LIBRARY_PATH;
# torchvision: TORCHINDUCTOR_CACHE_DIR), imported before the snapshot.
THIRD_PARTY = ("numpy", "torch", "torchvision", "cv2", "PIL.Image", "albumentations", "pycocotools.coco")


def run_import(repo_root, statement: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "NO_ALBUMENTATIONS_UPDATE"}
    env["PYTHONPATH"] = str(repo_root)
    # Every warning shown, except ResourceWarning: torch 2.6's torch.distributed.nn.jit
    # makes a module-level TemporaryDirectory (imported by torchvision through
    # torch._dynamo) and warns at interpreter exit when it is cleaned up.
    env["PYTHONWARNINGS"] = "always,ignore::ResourceWarning"
    # Should anything bypass the socket patch, the proxy is a closed local port.
    env["HTTP_PROXY"] = env["HTTPS_PROXY"] = "http://127.0.0.1:9"
    env.pop("NO_PROXY", None)
    env.pop("no_proxy", None)
    return subprocess.run([sys.executable, "-c", NETWORK_PROBE + statement], cwd=repo_root, env=env,
                          capture_output=True, text=True, timeout=300)


def test_a_tool_start_makes_no_network_call(repo_root):
    """``tools/train.py`` loaded as a module (its imports run, not its ``main``), then the
    data package: the tool's start set the opt-out, so albumentations stays offline."""
    out = run_import(repo_root, "import os, runpy, sys; sys.path.insert(0, 'tools'); "  # as `python tools/x.py`
                                "runpy.run_path('tools/train.py', run_name='tool'); "
                                "import detector.data, albumentations; "
                                "print('opt-out', os.environ['NO_ALBUMENTATIONS_UPDATE'])")
    assert out.returncode == 0, out.stderr
    assert "opt-out 1" in out.stdout
    assert "NETWORK ATTEMPT" not in out.stderr
    assert "Error fetching version info" not in out.stderr
    assert "Warning" not in out.stderr, out.stderr


def first_project_import(path) -> tuple:
    """``(line, module)`` of the first module-level import in ``path`` of ``_bootstrap``, torch,
    ``detector`` or ``benchmarks`` (read from the source); ``(None, None)`` if none."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            for n in names:
                if n.split(".")[0] in ("_bootstrap", "detector", "benchmarks", "torch"):
                    return node.lineno, n
    return None, None


def test_every_tool_sets_the_opt_out_before_importing_detector(repo_root):
    """``tools/_bootstrap.py`` calls ``os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")``
    at module level and imports nothing of the project; each other ``tools/*.py`` imports
    ``_bootstrap`` before its first ``detector``, ``benchmarks`` or torch import (read from the source)."""
    bootstrap = repo_root / "tools" / "_bootstrap.py"
    sets = [ast.unparse(node) for node in ast.parse(bootstrap.read_text()).body
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)
            and "NO_ALBUMENTATIONS_UPDATE" in ast.unparse(node)]
    assert sets == ["os.environ.setdefault('NO_ALBUMENTATIONS_UPDATE', '1')"], sets
    assert first_project_import(bootstrap) == (None, None)
    tools = sorted(p for p in (repo_root / "tools").glob("*.py") if p != bootstrap)
    assert len(tools) >= 8
    late = [f"{p.name}: first project import {module} at line {line}"
            for p in tools for line, module in [first_project_import(p)] if module != "_bootstrap"]
    assert not late, late


def test_importing_detector_writes_no_environment_variable(repo_root):
    """Importing every module of ``detector`` leaves ``os.environ`` as it was (after the
    third-party libraries' own writes, and with the albumentations opt-out unset)."""
    out = run_import(repo_root, f"import importlib, os, pkgutil; import {', '.join(THIRD_PARTY)}; "
                                "before = dict(os.environ); import detector; "
                                "names = [m.name for m in pkgutil.walk_packages(detector.__path__, 'detector.')]; "
                                "[importlib.import_module(n) for n in names]; "
                                "changed = sorted(k for k in set(before) | set(os.environ) "
                                "if before.get(k) != os.environ.get(k)); "
                                "print(len(names), 'modules; changed:', changed)")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("modules; changed: []"), out.stdout
    assert int(out.stdout.split()[0]) > 50, out.stdout  # every module was imported


def test_probe_sees_albumentations_version_check(repo_root):
    """The probe above is able to fail: plain ``import albumentations`` with the opt-out
    unset tries the network (albumentations >= 1.4.18 checks for updates at import)."""
    out = run_import(repo_root, "import albumentations")
    assert out.returncode == 0, out.stderr
    assert "NETWORK ATTEMPT" in out.stderr or "Error fetching version info" in out.stderr, out.stderr
