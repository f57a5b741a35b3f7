"""A rank that stops answering (SIGSTOP) ends the run within ``train.dist_timeout_s``,
with one line naming it, and a line in the log while the others wait (issue 23, part 5).
End to end through ``torchrun`` on the CPU (gloo honours the process group's timeout),
with the helpers of ``test_resume_elastic.py``."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from detector.distributed import DistInfo, lost_rank_message
from test_resume_elastic import (  # noqa: F401 - data_root is a fixture
    K,
    TIMEOUT,
    data_root,
    start,
    torchrun,
    train_cmd,
    wait_for_iteration,
    worker_pid,
)

DIST_TIMEOUT_S = 8

GLOO_TIMEOUT = RuntimeError("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting "
                            "5000ms for recv operation to complete")


def _pid_gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def test_timeout_names_the_stopped_rank():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        os.kill(proc.pid, signal.SIGSTOP)
        time.sleep(0.2)
        host = socket.gethostname()
        info = DistInfo(rank=0, world_size=2, local_rank=0, device=torch.device("cpu"),
                        peers=((host, os.getpid()), (host, proc.pid)), timeout_s=5.0)
        message = lost_rank_message(GLOO_TIMEOUT, info, wait_s=0.5)
        assert message == (f"rank 1 (pid {proc.pid} on {host}: stopped) of 2 did not answer within "
                           "train.dist_timeout_s=5 s, so rank 0 stops too; resume with --resume, or launch with "
                           "torchrun --max-restarts=N ... --resume to restart automatically")
        remote = DistInfo(rank=0, world_size=2, local_rank=0, device=torch.device("cpu"),
                          peers=((host, os.getpid()), ("node-b", 7)), timeout_s=5.0)
        assert lost_rank_message(GLOO_TIMEOUT, remote, wait_s=0).startswith(
            "rank 1 of 2 on node-b did not answer within train.dist_timeout_s=5 s, so rank 0 stops too")
        assert lost_rank_message(RuntimeError("DataLoader timed out after 5 seconds"), info, wait_s=0) is None
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.slow
@pytest.mark.dist
def test_stopped_rank_ends_every_rank_within_the_timeout(data_root, tmp_path):  # noqa: F811
    out, logs = tmp_path / "run", tmp_path / "logs"
    cmd = train_cmd(data_root, out, "solver.max_iter=1000", f"train.dist_timeout_s={DIST_TIMEOUT_S}",
                    launcher=torchrun("--standalone", "--log-dir", str(logs), "--redirects=3"))
    agent = start(cmd, tmp_path / "log.txt")
    wait_for_iteration(out / "metrics.jsonl", K, agent)
    rank0, rank1 = worker_pid(agent.pid, rank=0), worker_pid(agent.pid, rank=1)
    os.kill(rank1, signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        while not _pid_gone(rank0) and time.monotonic() - t0 < TIMEOUT:
            time.sleep(0.1)
        rank0_s = time.monotonic() - t0
        status = agent.wait(TIMEOUT)
        all_s = time.monotonic() - t0
    finally:
        if not _pid_gone(rank1):
            os.kill(rank1, signal.SIGKILL)
        agent.kill()
    (stderr0,) = [p for p in logs.rglob("stderr.log") if p.parent.name == "0"]
    text = stderr0.read_text()
    context = "\n".join(f"--- {p}\n{p.read_text()[-2000:]}" for p in [tmp_path / "log.txt", *sorted(logs.rglob("*.log"))])
    assert status != 0
    assert "Traceback" not in text, context
    errors = [line for line in text.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, context
    assert f"rank 1 (pid {rank1} on {socket.gethostname()}: stopped) of 2 did not answer within " \
           f"train.dist_timeout_s={DIST_TIMEOUT_S} s" in errors[0], context
    (stdout0,) = [p for p in logs.rglob("stdout.log") if p.parent.name == "0"]
    assert f"rank 0: waiting for rank 1 (pid {rank1}" in stdout0.read_text(), context  # logged before the timeout
    (stderr1,) = [p for p in logs.rglob("stderr.log") if p.parent.name == "1"]
    text1 = stderr1.read_text()  # continued by rank 0 (SIGCONT), it finds rank 0 gone
    assert "Traceback" not in text1 and len([x for x in text1.splitlines() if x.startswith("error:")]) <= 1, context
    assert rank0_s < DIST_TIMEOUT_S + 30, context
    assert all_s < DIST_TIMEOUT_S + 30, context
    print(f"rank 0 ended {rank0_s:.1f} s and every rank {all_s:.1f} s after SIGSTOP")
