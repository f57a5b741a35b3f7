"""Exact resume, elastic restart, a lost rank and two nodes, end to end through
``tools/train.py`` command lines (CPU, gloo, deterministic, random flips and sizes).

- SIGTERM, then ``--resume``, ends bit-identical to a straight run: one process with
  ``data.num_workers`` 0 or 2, and ``torchrun --nproc_per_node=2``;
- ``torchrun --max-restarts=2 ... --resume``: rank 0 killed with SIGKILL mid-run is
  restarted, resumes from the newest checkpoint, and ends with the straight run's weights;
- without restarts, the surviving rank exits with one line naming the lost rank, also
  when torchrun's SIGTERM reaches it outside the training loop;
- two ``torchrun`` agents (``--nnodes 2``, c10d rendezvous on 127.0.0.1) train to the end.

The signal is sent once ``metrics.jsonl`` shows iteration ``K``: where the run really
stops then depends on timing, and the final weights must not.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

import pytest
import torch

from conftest import (TINY_CONFIG, lose_rank_1_while_rank_0_is_stopped, tiny_config, tiny_overrides, wait_for_text,
                      worker_pid)
from detector.data.shapes import ensure_shapes

from conftest import ROOT  # noqa: E402
TRAIN = str(ROOT / "tools" / "train.py")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
MAX_ITER = 6
K = 3  # signal once metrics.jsonl shows this iteration
TIMEOUT = 300

pytestmark = [pytest.mark.slow, pytest.mark.dist]


# The shared tiny model, with what these tests are about: random flips and sizes, and a
# periodic checkpoint for the elastic restart to resume from.
RUN_OVERRIDES = ["input.min_size_train=[56,64,72]", "input.hflip_prob=0.5", f"solver.max_iter={MAX_ITER}",
                 "train.checkpoint_period=2"]


@pytest.fixture(scope="module")
def data_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("shapes") / "data"
    s = tiny_config(root).data.shapes
    ensure_shapes(root, s.num_train, s.num_val, s.seed, s.min_side, s.max_side)  # once, before any process starts
    return root


def env() -> Dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), NO_ALBUMENTATIONS_UPDATE="1")


def train_cmd(data_root: Path, out: Path, *extra: str, launcher: Optional[List[str]] = None) -> List[str]:
    """``[launcher] tools/train.py --config tiny ... --output-dir out`` (``--resume`` goes last)."""
    head = launcher if launcher is not None else [sys.executable]
    return [*head, TRAIN, "--config", str(TINY_CONFIG), "--output-dir", str(out),
            *tiny_overrides(data_root, None, *RUN_OVERRIDES, *extra)]


def torchrun(*args: str) -> List[str]:
    return [*TORCHRUN, "--nproc_per_node=2", "--monitor-interval=0.2", *args]


def run(cmd: List[str], **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=TIMEOUT, **kw)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def start(cmd: List[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=ROOT, env=env(), stdout=log.open("w"), stderr=subprocess.STDOUT, text=True)


def wait_for_iteration(metrics: Path, k: int, proc: subprocess.Popen) -> None:
    """Return once ``metrics.jsonl`` has a record of iteration ``k``."""
    deadline = time.time() + TIMEOUT
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and any(json.loads(line).get("iteration") == k
                                    for line in metrics.read_text().splitlines() if line.strip()):
            return
        time.sleep(0.05)
    raise AssertionError(f"iteration {k} never reached (exit status {proc.poll()})")


def model_of(out: Path) -> Dict[str, torch.Tensor]:
    state = torch.load(out / "checkpoints" / "last.pth", map_location="cpu", weights_only=True)
    assert state["iteration"] == MAX_ITER
    return state["model"]


def assert_same_weights(a: Dict[str, torch.Tensor], b: Dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys() and len(a) > 50
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, f"{len(differ)} of {len(a)} tensors differ, e.g. {differ[:3]}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def straight(data_root, tmp_path_factory) -> Dict[str, Dict[str, torch.Tensor]]:
    """Final weights of straight runs, by world size (run on first use)."""
    cache: Dict[str, Dict[str, torch.Tensor]] = {}

    def get(world: int) -> Dict[str, torch.Tensor]:
        if world not in cache:
            out = tmp_path_factory.mktemp(f"straight{world}")
            run(train_cmd(data_root, out, launcher=torchrun("--standalone") if world == 2 else None))
            cache[world] = model_of(out)
        return cache[world]

    return get


@pytest.mark.parametrize("workers", [0, 2])
def test_sigterm_then_resume_is_exact(data_root, straight, tmp_path, workers):
    out = tmp_path / "run"
    cmd = train_cmd(data_root, out, f"data.num_workers={workers}", "data.persistent_workers=true")
    proc = start(cmd, tmp_path / "log.txt")
    wait_for_iteration(out / "metrics.jsonl", K, proc)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(TIMEOUT) == 128 + signal.SIGTERM, (tmp_path / "log.txt").read_text()[-3000:]
    stopped = torch.load(out / "checkpoints" / "last.pth", weights_only=True)["iteration"]
    assert K <= stopped < MAX_ITER
    run(cmd + ["--resume"])
    assert_same_weights(model_of(out), straight(1))


def test_torchrun_sigterm_then_resume_is_exact(data_root, straight, tmp_path):
    out = tmp_path / "run"
    cmd = train_cmd(data_root, out, launcher=torchrun("--standalone"))
    agent = start(cmd, tmp_path / "log.txt")
    wait_for_iteration(out / "metrics.jsonl", K, agent)
    agent.send_signal(signal.SIGTERM)  # the agent forwards it to both ranks
    agent.wait(TIMEOUT)
    stopped = torch.load(out / "checkpoints" / "last.pth", weights_only=True)["iteration"]
    assert K <= stopped < MAX_ITER, (tmp_path / "log.txt").read_text()[-3000:]
    run(cmd + ["--resume"])
    assert_same_weights(model_of(out), straight(2))


def test_elastic_restart_after_sigkill_ends_like_a_straight_run(data_root, straight, tmp_path):
    out = tmp_path / "run"
    log = tmp_path / "log.txt"
    cmd = train_cmd(data_root, out, "--resume", launcher=torchrun("--standalone", "--max-restarts=2"))
    agent = start(cmd, log)
    wait_for_iteration(out / "metrics.jsonl", K + 1, agent)
    os.kill(worker_pid(agent.pid, rank=0), signal.SIGKILL)
    # Exit status 0 after a worker died: the agent restarted the workers and they finished.
    assert agent.wait(TIMEOUT) == 0, log.read_text()[-3000:]
    assert "exitcode: -9" in log.read_text()
    assert_same_weights(model_of(out), straight(2))
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records if r.get("type") == "train"] == list(range(1, MAX_ITER + 1))


def start_two_ranks(data_root: Path, tmp_path: Path) -> subprocess.Popen:
    """torchrun with two ranks, each rank's output in its own file under ``tmp_path/logs``,
    the agent's in ``tmp_path/log.txt``, the run in ``tmp_path/run``."""
    cmd = train_cmd(data_root, tmp_path / "run", "solver.max_iter=1000",
                    launcher=torchrun("--standalone", "--log-dir", str(tmp_path / "logs"), "--redirects=3"))
    return start(cmd, tmp_path / "log.txt")


def rank0_error_lines(tmp_path: Path) -> List[str]:
    """The ``error:`` lines of rank 0's stderr, once no traceback is in it; the assertion
    messages carry every log."""
    logs = tmp_path / "logs"
    (stderr,) = [p for p in logs.rglob("stderr.log") if p.parent.name == "0"]
    text = stderr.read_text()
    context = "\n".join(f"--- {p}\n{p.read_text()[-2000:]}" for p in [tmp_path / "log.txt", *sorted(logs.rglob("*.log"))])
    assert "Traceback" not in text, context
    errors = [line for line in text.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, context
    return errors


def test_lost_rank_is_one_line(data_root, tmp_path):
    agent = start_two_ranks(data_root, tmp_path)
    wait_for_iteration(tmp_path / "run" / "metrics.jsonl", K, agent)
    os.kill(worker_pid(agent.pid, rank=1), signal.SIGKILL)
    assert agent.wait(TIMEOUT) != 0
    assert "rank 1" in rank0_error_lines(tmp_path)[0]


def test_lost_rank_while_setting_up_is_one_line(data_root, tmp_path):
    """torchrun's SIGTERM to the survivor of a lost rank, reaching it outside the training
    loop (here while it builds the model, data and optimizer; likewise while it unwinds
    a failed collective): the survivor used to end without a word (-15, SIGTERM's default
    action in one of several ranks). Rank 0 is stopped (SIGSTOP) once it has set up
    its process group, rank 1 is killed, and rank 0 continues once the agent has sent it
    SIGTERM: its one line names rank 1."""
    agent = start_two_ranks(data_root, tmp_path)
    wait_for_text(tmp_path / "run" / "log.txt", "process: ", agent)  # rank 0's log: the process group is up
    lose_rank_1_while_rank_0_is_stopped(agent, tmp_path / "log.txt")
    assert agent.wait(TIMEOUT) != 0
    assert rank0_error_lines(tmp_path)[0].startswith("error: lost rank 1 (pid ")
    assert "exitcode  : 1 " in (tmp_path / "log.txt").read_text()  # its own status, not -15 (SIGTERM)


def test_two_nodes_train_to_the_end(data_root, straight, tmp_path):
    out = tmp_path / "run"
    port = free_port()
    agents = [
        start(train_cmd(data_root, out, launcher=[
            *TORCHRUN, "--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d",  # no --node-rank: c10d orders
            f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=two-nodes-test"]), tmp_path / f"node{node}.txt")
        for node in (0, 1)
    ]
    for node, agent in enumerate(agents):
        assert agent.wait(TIMEOUT) == 0, (tmp_path / f"node{node}.txt").read_text()[-3000:]
        assert "node_rank is only used" not in (tmp_path / f"node{node}.txt").read_text()  # the README's loop
    assert_same_weights(model_of(out), straight(2))
