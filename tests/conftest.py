"""Shared test fixtures: paths, the real-data folder, markers that skip, and the one
tiny-model test config (``tests/configs/tiny.yaml``) with its helpers."""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Callable, List, Optional, Sequence, Tuple, Union

import pytest
import torch

# Tests that import albumentations directly: no PyPI version check (detector.data sets the same).
os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")

from detector.config import Config, load_config  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
REAL_DATA = ROOT.parent / "shared" / "data" / "real"
TINY_CONFIG = ROOT / "tests" / "configs" / "tiny.yaml"

PathLike = Union[str, "os.PathLike[str]"]


@pytest.fixture(scope="session", autouse=True)
def _subprocess_temp_folder(tmp_path_factory):
    """``TMPDIR`` for every subprocess a test starts: a folder of this session's pytest
    temporary folder, which pytest removes in later sessions. torchrun's agents
    (``torchelastic_*``) and multiprocessing's killed workers (``pymp-*``) left a folder in
    ``/tmp`` for each multi-process test, hundreds a ``make test``."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TMPDIR", str(tmp_path_factory.mktemp("subprocess_tmp")))
        yield


@pytest.fixture(autouse=True)
def _detach_log_handlers():
    """After each test, the console and file handlers ``setup_logging`` attached (a tool
    run in-process calls it): the console one holds this test's captured stdout, which
    pytest closes, and a later test that logs without calling ``setup_logging`` again
    (``tools/infer.py``) would print a logging error into its own output."""
    yield
    for name in ("detector", "py.warnings"):
        log = logging.getLogger(name)
        for handler in list(log.handlers):
            if getattr(handler, "_detector_handler", False):
                log.removeHandler(handler)
                handler.close()


def load_tool(name: str) -> ModuleType:
    """``tools/<name>.py`` as a fresh module (the tools are scripts, not a package). As
    ``python tools/<name>.py`` does, ``tools/`` is on ``sys.path`` (each tool's first
    import is ``tools/_bootstrap.py``)."""
    if str(ROOT / "tools") not in sys.path:
        sys.path.insert(0, str(ROOT / "tools"))
    spec = importlib.util.spec_from_file_location(f"tool_{name}", ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tiny_overrides(data_root: PathLike, output_dir: Optional[PathLike] = None, *extra: str) -> List[str]:
    """Overrides for ``TINY_CONFIG``: the generated data under ``data_root`` (train and
    val), the run folder ``output_dir`` if given, then ``extra`` (``key=value``).

    For subprocesses: ``tools/train.py --config TINY_CONFIG *tiny_overrides(...)``."""
    out = [f"data.train.root={data_root}", f"data.val.root={data_root}"]
    if output_dir is not None:
        out.append(f"train.output_dir={output_dir}")
    return out + list(extra)


def tiny_config(data_root: PathLike, output_dir: Optional[PathLike] = None, *extra: str) -> Config:
    """``load_config(TINY_CONFIG, tiny_overrides(data_root, output_dir, *extra))``."""
    return load_config(TINY_CONFIG, tiny_overrides(data_root, output_dir, *extra))


def signal_train_run(data_root: PathLike, output_dir: PathLike, sig: int, wait_s: float = 120,
                     extra: Sequence[str] = (), group: bool = False) -> Tuple[subprocess.Popen, str, List[str]]:
    """``tools/train.py --config TINY_CONFIG`` (data under ``data_root``, run folder
    ``output_dir``, the ``extra`` overrides, ``solver.max_iter=1000``) in a subprocess, sent
    signal ``sig`` once ``metrics.jsonl`` holds two records (waiting at most ``wait_s``
    seconds). ``group``: the process runs in a session of its own and the signal goes to
    its whole process group, data loader workers included (as SLURM's ``scancel`` does).

    Returns ``(the ended process, its stdout and stderr, its argv)``; the last two argv
    items are ``solver.max_iter=1000 train.deterministic=false``."""
    args = [sys.executable, str(ROOT / "tools" / "train.py"), "--config", str(TINY_CONFIG),
            *tiny_overrides(data_root, output_dir), *extra, "solver.max_iter=1000", "train.deterministic=false"]
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=group)
    metrics = Path(output_dir) / "metrics.jsonl"
    deadline = time.time() + wait_s
    while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 2):
        time.sleep(0.2)
    if group:
        os.killpg(proc.pid, sig)
    else:
        proc.send_signal(sig)
    stdout, _ = proc.communicate(timeout=120)
    return proc, stdout, args


# --------------------------------------------------------------------------- processes of a launch


def descendants(pid: int) -> List[int]:
    """``pid``'s child processes, their children and so on (Linux ``/proc``), each before
    its own children. A thread or process that ends while it is read is passed over."""
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        try:
            for task in os.listdir(f"/proc/{parent}/task"):
                with contextlib.suppress(FileNotFoundError), open(f"/proc/{parent}/task/{task}/children") as f:
                    kids = [int(c) for c in f.read().split()]
                    found += kids
                    todo += kids
        except (FileNotFoundError, ProcessLookupError):
            continue
    return found


def worker_pid(agent: int, rank: int) -> int:
    """PID of the process with ``RANK=rank`` among the descendants of ``agent`` (the
    rank's own process comes before its loader workers, which inherit ``RANK``)."""
    for pid in descendants(agent):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if f"RANK={rank}".encode() in f.read().split(b"\0"):
                    return pid
        except (FileNotFoundError, ProcessLookupError):
            continue
    raise AssertionError(f"no process with RANK={rank} under {agent}")


def wait_for_text(path: Path, text: str, proc: subprocess.Popen, timeout_s: float = 300) -> None:
    """Return once the file ``path`` contains ``text``."""
    deadline = time.time() + timeout_s
    while time.time() < deadline and proc.poll() is None:
        if path.exists() and text in path.read_text(errors="replace"):
            return
        time.sleep(0.02)
    raise AssertionError(f"{text!r} never appeared in {path} (exit status {proc.poll()})")


def lose_rank_1_while_rank_0_is_stopped(agent: subprocess.Popen, agent_log: Path) -> None:
    """Under torchrun (``agent``, its output in ``agent_log``): stop rank 0 (SIGSTOP),
    kill rank 1 (SIGKILL), and let rank 0 go on (SIGCONT) once the agent has sent it
    SIGTERM, so that the SIGTERM reaches it wherever it was stopped, before any
    collective has failed."""
    import signal

    rank0 = worker_pid(agent.pid, rank=0)
    os.kill(rank0, signal.SIGSTOP)
    try:
        os.kill(worker_pid(agent.pid, rank=1), signal.SIGKILL)
        wait_for_text(agent_log, f"Sending process {rank0} closing signal SIGTERM", agent)
    finally:
        os.kill(rank0, signal.SIGCONT)


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs CUDA")
    skip_real = pytest.mark.skip(reason=f"real data folder absent: {REAL_DATA}")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
        if "realdata" in item.keywords and not REAL_DATA.is_dir():
            item.add_marker(skip_real)


def pytest_runtest_logreport(report):
    """With ``PYTEST_FAILURE_LOG`` set (``make gpu-check`` sets it), each failure's report
    is appended to that file as it happens: a session cut by a time limit, which never
    prints its summary, still leaves why its tests failed. Under xdist the worker writes
    (the controller's copy of a worker's report carries ``node``)."""
    path = os.environ.get("PYTEST_FAILURE_LOG")
    if path and report.failed and getattr(report, "node", None) is None:
        with open(path, "a") as out:
            out.write(f"FAILED {report.nodeid} ({report.when})\n{report.longreprtext}\n\n")


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return ROOT


@pytest.fixture(scope="session")
def real_data() -> Path:
    if not REAL_DATA.is_dir():
        pytest.skip(f"real data folder absent: {REAL_DATA}")
    return REAL_DATA


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> Path:
    """A shared folder for the tiny config's generated shapes (made on first use)."""
    return tmp_path_factory.mktemp("tiny_shapes") / "data"


@pytest.fixture
def tiny_cfg(tiny_data, tmp_path) -> Callable[..., Config]:
    """``tiny_cfg(*overrides) -> Config``: the tiny test model on the shared generated
    data, with its run folder in this test's ``tmp_path / "run"``."""

    def make(*overrides: str) -> Config:
        return tiny_config(tiny_data, tmp_path / "run", *overrides)

    return make
