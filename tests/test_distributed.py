"""detector.distributed: the one-line message for a collective that failed because a peer
process died (end to end in test_resume_elastic.py)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
import torch

from detector.distributed import DistInfo, lost_rank_message
from conftest import ROOT

GLOO_LOST = RuntimeError("[gloo/transport/tcp/pair.cc:561] Connection closed by peer [127.0.0.1]:19586. "
                         "This is typically caused by a remote worker crashing.")


def info(rank, peers):
    return DistInfo(rank=rank, world_size=len(peers), local_rank=rank, device=torch.device("cpu"), peers=tuple(peers))


def ended_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()  # reaped: the pid no longer exists
    return proc.pid


def test_names_the_rank_whose_process_ended():
    host = socket.gethostname()
    peers = [(host, os.getpid()), (host, os.getppid()), (host, ended_pid())]
    message = lost_rank_message(GLOO_LOST, info(0, peers), wait_s=0.5)
    assert message is not None and "\n" not in message
    assert message.startswith(f"lost rank 2 (pid {peers[2][1]} on {host}) of 3: its process ended, so rank 0 stops too")
    assert "--resume" in message and "--max-restarts" in message
    # tools/eval.py, which has no --resume, gives its own advice
    assert lost_rank_message(GLOO_LOST, info(0, peers), wait_s=0.5, advice="run it again").endswith(
        "so rank 0 stops too; run it again")


def test_the_only_rank_on_another_host_is_named():
    peers = [("other-node", 4242), (socket.gethostname(), os.getpid())]
    message = lost_rank_message(GLOO_LOST, info(1, peers), wait_s=0.2)
    assert message is not None and message.startswith("lost contact with rank 0 of 2 on other-node, so rank 1 stops")


def test_other_errors_are_left_alone():
    host = socket.gethostname()
    peers = [(host, os.getpid()), (host, ended_pid())]
    assert lost_rank_message(RuntimeError("CUDA out of memory"), info(0, peers), wait_s=0) is None
    assert lost_rank_message(ValueError("Connection closed by peer"), info(0, peers), wait_s=0) is None
    assert lost_rank_message(GLOO_LOST, None) is None
    assert lost_rank_message(GLOO_LOST, info(0, peers[:1])) is None  # one process: no peer to lose


def zombie_pid() -> subprocess.Popen:
    """A child that has ended but is not reaped yet (as a killed rank is until torchrun's agent polls)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)  # ended; left unreaped
    return proc


@pytest.mark.parametrize("peer", ["reaped", "zombie"])
def test_sigterm_after_a_local_peer_ended_names_it(peer, capsys):
    """torchrun's SIGTERM to a survivor (``Terminated``) after a rank of this host ended:
    the tools' one line names that rank, exit 1, and a further SIGTERM while it reports
    is ignored; with every peer alive it is no lost rank (the tool says ``stopped by SIGTERM``)."""
    import signal

    from detector.cli import Terminated
    from detector.distributed import report_lost_rank

    host = socket.gethostname()
    child = zombie_pid() if peer == "zombie" else None
    dead = child.pid if child else ended_pid()
    before = signal.getsignal(signal.SIGTERM)
    try:
        assert report_lost_rank(Terminated("SIGTERM"), info(1, [(host, os.getppid()), (host, os.getpid())])) is None
        assert report_lost_rank(Terminated("SIGTERM"), info(0, [(host, os.getpid()), (host, dead)])) == 1
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, before)
        if child:
            child.wait()
    err = capsys.readouterr().err
    assert err.startswith(f"error: lost rank 1 (pid {dead} on {host}) of 2: its process ended, so rank 0 stops too; ")
    assert err.count("\n") == 1


# --------------------------------------------------------------------------- the watchdog

WATCHED_TIMEOUT_S = 4
# One rank of two: rank 1 joins the process group, then never arrives at the collective;
# rank 0 runs it and, as tools/train.py and tools/eval.py do, turns the error into one line.
NEVER_ARRIVES = """
import logging, sys, time
import torch
from detector import distributed as d
logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stdout)
info = d.init_distributed("cpu", backend="gloo", timeout_s={timeout})
if info.rank == 1:
    time.sleep({timeout} + 30)
    sys.exit(0)
collective = {{
    "all_gather_object": lambda: d.all_gather_object({{"x": 1}}, info),
    "all_gather_padded": lambda: d.all_gather_padded(torch.ones(3, 2), info),
    "reduce_dict": lambda: d.reduce_dict({{"loss": torch.ones(())}}, info=info),
}}[sys.argv[1]]
t0 = time.monotonic()
try:
    collective()
except RuntimeError as exc:
    print(f"error: {{d.lost_rank_message(exc, info)}}", file=sys.stderr)
    print(f"ended after {{time.monotonic() - t0:.1f}} s")
    sys.exit(1)
print("the collective returned")
"""


@pytest.mark.dist
@pytest.mark.parametrize("collective", ["all_gather_object", "all_gather_padded", "reduce_dict"])
def test_a_rank_that_never_arrives_ends_the_other_within_the_timeout(collective, tmp_path):
    """Two gloo ranks, train.dist_timeout_s=4: rank 1 never calls the collective. Rank 0
    logs that it waits (watch, before the timeout), then ends with one line naming the
    timeout, within it (plus lost_rank_message's 3 s look for a stopped or ended peer)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = NEVER_ARRIVES.format(timeout=WATCHED_TIMEOUT_S)
    procs = []
    for rank in (0, 1):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                   PYTHONPATH=str(ROOT), NO_ALBUMENTATIONS_UPDATE="1")
        procs.append(subprocess.Popen([sys.executable, "-c", script, collective], env=env, cwd=tmp_path,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    try:
        out, err = procs[0].communicate(timeout=120)
    finally:
        procs[1].kill()
        procs[1].communicate()
    assert procs[0].returncode == 1, out + err
    errors = [line for line in err.splitlines() if line.strip()]
    assert errors == [f"error: another rank did not answer within train.dist_timeout_s={WATCHED_TIMEOUT_S} s "
                      "(frozen, stopped or on a lost host), so rank 0 stops too; resume with --resume, or launch "
                      "with torchrun --max-restarts=N ... --resume to restart automatically"], out + err
    assert f"rank 0: waiting for the other rank(s) for 1 s in {collective}; the run stops at " \
           f"train.dist_timeout_s={WATCHED_TIMEOUT_S} s" in out, out
    ended = float(out.split("ended after ")[1].split()[0])
    assert ended < WATCHED_TIMEOUT_S + 3 + 3, out
