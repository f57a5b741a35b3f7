"""detector.distributed: the one-line message for a collective that failed because a peer
process died (end to end in test_resume_elastic.py)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import torch

from detector.distributed import DistInfo, lost_rank_message

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
