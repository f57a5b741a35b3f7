"""Ranks that stop answering: one line for the error a collective raises, and a line in
the log while a collective is slow (bottom layer, beside ``detector.distributed``).

- ``lost_rank_message``: a collective that fails because another rank's process ended
  (killed, crashed), or timed out after ``train.dist_timeout_s`` because a rank is
  frozen, stopped (SIGSTOP) or on a lost host, becomes one line naming that rank;
- ``report_lost_rank``: a tool's handler for that error, and for the SIGTERM that a
  launcher sends the survivors once a rank's process ended (``detector.cli.Terminated``);
- ``watch``: a context manager around a collective (or a step holding one) that logs
  ``waiting for rank(s) ... for N s`` once it has run past a threshold, naming the local
  ranks whose process is stopped or gone.

``info`` is a ``detector.distributed.DistInfo`` (rank, world size, ``peers``: each
rank's host and pid, ``timeout_s``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import threading
import time
from typing import Any, Iterator, List, Optional, Tuple

import torch.distributed as dist

from detector.cli import Terminated, report_error
from detector.messages import DetectorError, first_line

logger = logging.getLogger(__name__)

# What a collective raises when a peer process went away (gloo; NCCL with async error handling).
_LOST_PEER_SIGNS = ("connection closed by peer", "connection reset by peer", "broken pipe",
                    "remote process exited", "ncclremoteerror")
# What it raises when the process group's timeout passed (gloo; NCCL's watchdog).
_TIMEOUT_SIGNS = ("timed out waiting", "application timeout", "collective operation timeout", "wait timeout")
# A slow collective is logged after this fraction of train.dist_timeout_s, at most SLOW_MAX_S.
SLOW_FRACTION, SLOW_MAX_S = 0.2, 60.0

# What a lost-rank line advises by default (training); tools/eval.py passes its own.
RESUME_ADVICE = "resume with --resume, or launch with torchrun --max-restarts=N ... --resume to restart automatically"


def _process_state(pid: int) -> Optional[str]:
    """``"ended"`` (gone, or a zombie), ``"stopped"`` (SIGSTOP, a debugger), or None
    (running, or unknown) for process ``pid`` on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return "ended"
    except PermissionError:
        return None
    try:
        with open(f"/proc/{pid}/stat") as f:
            code = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None
    return {"Z": "ended", "X": "ended", "T": "stopped", "t": "stopped"}.get(code)


def _process_ended(pid: int) -> bool:
    """True when process ``pid`` (on this host) no longer runs: gone, or a zombie."""
    return _process_state(pid) == "ended"


def _local_peers(info: Any) -> List[int]:
    host = socket.gethostname()
    return [r for r, (h, _) in enumerate(info.peers) if h == host and r != info.rank]


def _stuck_peers(info: Any) -> List[Tuple[int, str]]:
    """``(rank, state)`` of the other ranks on this host whose process is stopped or ended."""
    if info is None or len(getattr(info, "peers", ())) != getattr(info, "world_size", 0):
        return []
    states = [(r, _process_state(info.peers[r][1])) for r in _local_peers(info)]
    return [(r, s) for r, s in states if s is not None]


def _describe(info: Any, stuck: List[Tuple[int, str]]) -> str:
    host = socket.gethostname()
    return ", ".join(f"rank {r} (pid {info.peers[r][1]} on {host}: {state})" for r, state in stuck)


def lost_rank_message(exc: BaseException, info: Any, wait_s: float = 3.0,
                      advice: str = RESUME_ADVICE) -> Optional[str]:
    """One line for ``exc`` when it is a collective failing because another rank's process
    ended, or did not answer within the process group's timeout; None for any other error.

    The lost rank is found among the ranks on this host (a process that ended, waiting up
    to ``wait_s`` seconds for it to finish exiting, or one that is stopped); when none is
    and exactly one other rank runs on another host, that rank is named. The line ends
    with ``advice`` (default: how to resume a training run).
    """
    if info is None or info.world_size < 2 or len(info.peers) != info.world_size:
        return None
    text = str(exc).lower()
    timed_out = any(s in text for s in _TIMEOUT_SIGNS)
    if not isinstance(exc, RuntimeError) or not (timed_out or any(s in text for s in _LOST_PEER_SIGNS)):
        return None
    host = socket.gethostname()
    remote = [r for r, (h, _) in enumerate(info.peers) if h != host]
    deadline = time.monotonic() + wait_s
    while True:
        stuck = _stuck_peers(info)
        ended = [(r, s) for r, s in stuck if s == "ended"]
        if ended or (timed_out and stuck) or time.monotonic() >= deadline:
            break
        time.sleep(0.1)
    timeout = f"within train.dist_timeout_s={info.timeout_s:g} s"
    if ended:
        return _ended_line(info, [r for r, _ in ended], advice)
    if timed_out and stuck:
        return (f"{_describe(info, stuck)} of {info.world_size} did not answer {timeout}, so rank {info.rank} "
                f"stops too; {advice}")
    if len(remote) == 1:
        r = remote[0]
        if timed_out:
            return (f"rank {r} of {info.world_size} on {info.peers[r][0]} did not answer {timeout}, so rank "
                    f"{info.rank} stops too; {advice}")
        return (f"lost contact with rank {r} of {info.world_size} on {info.peers[r][0]}, so rank {info.rank} "
                f"stops too; {advice}")
    if timed_out:
        return (f"another rank did not answer {timeout} (frozen, stopped or on a lost host), so rank {info.rank} "
                f"stops too; {advice}")
    return f"lost contact with another rank ({first_line(exc)}), so rank {info.rank} stops too; {advice}"


def _ended_line(info: Any, ranks: List[int], advice: str) -> str:
    host = socket.gethostname()
    who = ", ".join(f"rank {r} (pid {info.peers[r][1]} on {host})" for r in ranks)
    return f"lost {who} of {info.world_size}: its process ended, so rank {info.rank} stops too; {advice}"


def ended_peer_message(info: Any, advice: str = RESUME_ADVICE) -> Optional[str]:
    """The lost-rank line when another rank's process on this host has ended (gone, or a
    zombie) at this moment, without waiting; None when none has (or for one process).
    For a SIGTERM: torchrun's agent stops the survivors once it saw a worker end."""
    if info is None or info.world_size < 2 or len(info.peers) != info.world_size:
        return None
    ended = [r for r, state in _stuck_peers(info) if state == "ended"]
    return _ended_line(info, ended, advice) if ended else None


def slow_after_s(timeout_s: float) -> float:
    """Seconds after which ``watch`` logs a collective as slow: a fifth of the timeout,
    at most ``SLOW_MAX_S``."""
    return min(SLOW_MAX_S, SLOW_FRACTION * timeout_s)


@contextlib.contextmanager
def watch(what: str, info: Any = None, after_s: Optional[float] = None) -> Iterator[None]:
    """Log one warning if the block (a collective, or a step that holds one) runs past
    ``after_s`` seconds (default ``slow_after_s(info.timeout_s)``, or ``SLOW_MAX_S``
    without ``info``), naming the local ranks whose process is stopped or gone. Does
    nothing without a process group of more than one rank."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        yield
        return
    timeout = getattr(info, "timeout_s", None)
    after = after_s if after_s is not None else slow_after_s(timeout) if timeout else SLOW_MAX_S
    rank = dist.get_rank()

    def report() -> None:
        stuck = _stuck_peers(info)
        whom = _describe(info, stuck) if stuck else "the other rank(s)"
        limit = f"; the run stops at train.dist_timeout_s={timeout:g} s" if timeout else ""
        logger.warning("rank %d: waiting for %s for %.0f s in %s%s", rank, whom, after, what, limit)

    timer = threading.Timer(after, report)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def wake_stopped_peers(info: Any) -> List[int]:
    """Send SIGCONT to the other ranks on this host whose process is stopped (SIGSTOP),
    once this rank stops because they did not answer: a stopped process cannot act on
    the launcher's SIGTERM, so without this it stays stopped until torchrun SIGKILLs it
    (after 30 s) or, launched otherwise, for ever. Continued, it finds this rank gone and
    ends with its own one line. Returns the ranks woken."""
    woken = []
    for r, state in _stuck_peers(info):
        if state == "stopped":
            try:
                os.kill(info.peers[r][1], signal.SIGCONT)
                woken.append(r)
            except OSError:
                pass
    if woken:
        logger.warning("rank %d: sent SIGCONT to the stopped rank(s) %s so that they end too", info.rank,
                       ", ".join(map(str, woken)))
    return woken


def report_lost_rank(exc: BaseException, info: Any, advice: str = RESUME_ADVICE) -> Optional[int]:
    """A tool's ``except (RuntimeError, Terminated)`` in a process that may be one of
    several ranks. When ``exc`` is a collective failing because another rank ended or did
    not answer (``lost_rank_message``), or a SIGTERM (``Terminated``) that came once
    another rank's process on this host had ended (``ended_peer_message``: torchrun's
    agent stops the survivors so), print that one line, wake the stopped peers
    (``wake_stopped_peers``) and return exit status 1; None for any other error, which
    the tool re-raises (a SIGTERM without a lost peer: ``error: stopped by SIGTERM``).

    In one of several ranks the process from here on only reports and ends (whatever
    this returns), so a SIGTERM is ignored: the launcher's, which can come while the
    failed collective is unwound and reported, used to end the survivor without its
    line. The launcher's SIGKILL after its grace period (torchrun: 30 s) still ends a
    process that hangs."""
    several = info is not None and info.world_size > 1
    if several and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if isinstance(exc, Terminated):
        message = ended_peer_message(info, advice)
    elif isinstance(exc, DetectorError):
        message = None
    else:
        message = lost_rank_message(exc, info, advice=advice)
    if message is None:
        return None
    status = report_error(exc, line=message)
    wake_stopped_peers(info)  # a stopped rank cannot end otherwise
    return status
