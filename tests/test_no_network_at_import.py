"""Importing the data package (which imports albumentations) makes no network call:
albumentations' PyPI version check is switched off before albumentations is imported."""

from __future__ import annotations

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


def run_import(repo_root, statement: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "NO_ALBUMENTATIONS_UPDATE"}
    env["PYTHONPATH"] = str(repo_root)
    env["PYTHONWARNINGS"] = "always"
    # Should anything bypass the socket patch, the proxy is a closed local port.
    env["HTTP_PROXY"] = env["HTTPS_PROXY"] = "http://127.0.0.1:9"
    env.pop("NO_PROXY", None)
    env.pop("no_proxy", None)
    return subprocess.run([sys.executable, "-c", NETWORK_PROBE + statement], cwd=repo_root, env=env,
                          capture_output=True, text=True, timeout=120)


def test_importing_the_data_package_makes_no_network_call(repo_root):
    out = run_import(repo_root, "import detector.data, albumentations, os; "
                                "print('opt-out', os.environ['NO_ALBUMENTATIONS_UPDATE'])")
    assert out.returncode == 0, out.stderr
    assert "opt-out 1" in out.stdout
    assert "NETWORK ATTEMPT" not in out.stderr
    assert "Error fetching version info" not in out.stderr
    assert "Warning" not in out.stderr, out.stderr


def test_probe_sees_albumentations_version_check(repo_root):
    """The probe above is able to fail: plain ``import albumentations`` with the opt-out
    unset tries the network (albumentations >= 1.4.18 checks for updates at import)."""
    out = run_import(repo_root, "import albumentations")
    assert out.returncode == 0, out.stderr
    assert "NETWORK ATTEMPT" in out.stderr or "Error fetching version info" in out.stderr, out.stderr
