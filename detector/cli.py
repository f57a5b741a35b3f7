"""The one way a tool turns a bad input into one line and an exit status (bottom layer:
imports only ``detector.messages``).

Every ``tools/*.py`` ends its ``main`` with ``return run_tool(lambda: body(args))``:

- an expected error (``EXPECTED_ERRORS``: the library's ``DetectorError`` subclasses, and
  the builtin errors a bad user input raises from other libraries: a missing or
  unwritable path, a bad value, a missing optional package) prints ``error: <its first
  line>`` on stderr and exits with status 1;
- running out of memory (torch's ``OutOfMemoryError`` on a GPU, a failed allocation on
  the CPU, a ``MemoryError`` of numpy, PIL or Python) prints ``error: out of memory: <how much> ...; use smaller batches or images``
  and exits with 1: the size of a batch or an image is an input like any other;
- Ctrl-C (``KeyboardInterrupt``) prints ``error: <interrupted>`` and exits with 130;
  SIGTERM prints ``error: stopped by SIGTERM ...`` and exits with 143 (``Terminated``);
- anything else is a bug: the traceback is printed as usual.

The traceback of an expected error goes to the ``detector`` logger at DEBUG level, which
``setup_logging`` writes to ``<run folder>/log.txt`` where a run folder exists, and which
the console does not show. Usage errors stay with argparse (status 2).
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import sys
import threading
from typing import Any, Callable, Optional

from detector.messages import DetectorError, first_line

EXPECTED_ERRORS = (DetectorError, OSError, ValueError, ImportError)

EXIT_ERROR = 1
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report Ctrl-C
EXIT_TERMINATED = 143  # 128 + SIGTERM

logger = logging.getLogger("detector.cli")


def user_path(text: str) -> str:
    """``argparse`` type of every path argument: a leading ``~`` or ``~user`` is that home
    folder, as a shell would make it. The shell does not expand ``--output-dir=~/runs``
    (the ``=`` form), nor a quoted ``"~/runs"``; config values get the same expansion
    (``detector.config``'s path keys)."""
    return os.path.expanduser(text)


def output_file(text: str) -> str:
    """``argparse`` type of a file a tool writes (``--json``, ``export.py --output``): as
    ``user_path``, refusing an empty name, one that ends with a path separator (a folder:
    ``pathlib`` drops the separator, and a file named as the folder was written) and an
    existing folder (found after the work otherwise)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("is empty: name the file to write")
    if text.endswith(tuple(sep for sep in ("/", os.sep, os.altsep) if sep)):
        raise argparse.ArgumentTypeError(f"{text!r} ends with {text[-1]!r}, so it names a folder: name the file to "
                                         f"write (e.g. {text}result.json)")
    path = user_path(text)
    if os.path.isdir(path):  # known before the work, not after it (a benchmark's minutes)
        raise argparse.ArgumentTypeError(f"{text!r} is a folder: name the file to write (e.g. "
                                         f"{os.path.join(text, 'result.json')})")
    return path


OUT_OF_MEMORY_ADVICE = "use smaller batches or images (solver.images_per_gpu, eval.images_per_gpu, the input.* sizes)"


def out_of_memory_line(exc: BaseException) -> Optional[str]:
    """The one line for ``exc`` when it says that memory ran out (torch's
    ``OutOfMemoryError``, whose class this bottom layer knows by name; the CPU
    allocator's "can't allocate memory"; a ``MemoryError`` of numpy, PIL or Python);
    None for any other exception."""
    text = first_line(exc)
    if isinstance(exc, MemoryError):
        return f"out of memory: {text.rstrip('. ') or 'MemoryError'}; {OUT_OF_MEMORY_ADVICE}"
    if type(exc).__name__ == "OutOfMemoryError" or "out of memory" in text.lower():
        return f"out of memory: {text.rstrip('. ')}; {OUT_OF_MEMORY_ADVICE}"
    cpu = re.search(r"can't allocate memory: you tried to allocate (\d+) bytes", text)
    if cpu is None:
        return None
    return f"out of memory: the CPU could not allocate {int(cpu.group(1)) / 2**30:.1f} GiB; {OUT_OF_MEMORY_ADVICE}"


def report_error(exc: BaseException, line: Optional[str] = None) -> int:
    """Log ``exc``'s traceback (DEBUG: log.txt only), print ``error: <line>`` (default:
    ``exc``'s first line) on stderr unless ``exc.report`` is False (another process
    reports it); return 1."""
    logger.debug("stopped with an error", exc_info=exc)
    if not isinstance(exc, DetectorError) or exc.report:
        print(f"error: {line or first_line(exc)}", file=sys.stderr)
    return EXIT_ERROR


class Terminated(BaseException):
    """SIGTERM reached a tool (raised by ``run_tool``'s handler). A ``BaseException``, as
    ``KeyboardInterrupt`` is, so that no ``except Exception`` swallows it and every
    ``finally`` runs: a file being written is left out, not half written."""


def run_tool(body: Callable[[], int], interrupted: str = "interrupted") -> int:
    """Run a tool's ``body`` and return its exit status: ``body()``'s own, 1 after an
    expected error (one line on stderr), 130 after Ctrl-C (``error: <interrupted>``),
    143 after SIGTERM (``error: stopped by SIGTERM ...``).

    SIGTERM (``kill``, ``timeout``, a scheduler's cancel) raises ``Terminated`` in the
    main thread while ``body`` runs, so the tool stops as after Ctrl-C: every file it
    finished stays, the one it was writing (``detector.files.atomic_write``) is not left
    half written. Training installs its own handler while it trains (a checkpoint, then
    a clean stop: ``SignalHook``). Once ``body`` has returned or raised, a SIGTERM is
    ignored (the tool is ending), and the previous handler is restored on the way out.

    Also in one of several ranks (torchrun, srun), where the launcher sends SIGTERM to
    the survivors of a lost rank: the tools that run there (train, eval) turn that
    ``Terminated``, like the collective's error, into the one line naming the lost rank
    (``detector.dist_faults.report_lost_rank``). With the default action instead, a
    survivor signalled between the failed collective and its line ended without a word.
    """
    armed = [True]

    def on_sigterm(signum: int, frame: Any) -> None:
        if armed[0]:
            raise Terminated(signal.Signals(signum).name)

    main_thread = threading.current_thread() is threading.main_thread()
    if main_thread and getattr(signal.getsignal(signal.SIGINT), "during_imports", False):
        signal.signal(signal.SIGINT, signal.default_int_handler)  # tools/_bootstrap.py's, while the tool imported
    if main_thread and getattr(signal.getsignal(signal.SIGTERM), "during_imports", False):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # likewise (several ranks keep the default while importing)
    previous = signal.signal(signal.SIGTERM, on_sigterm) if main_thread else None
    try:
        try:
            return body()
        finally:
            armed[0] = False
    except EXPECTED_ERRORS as exc:
        return report_error(exc)
    except (RuntimeError, MemoryError) as exc:
        line = out_of_memory_line(exc)
        if line is None:
            raise
        return report_error(exc, line)
    except KeyboardInterrupt:
        print(f"error: {interrupted}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Terminated:
        print("error: stopped by SIGTERM; the files already written are complete, none is left half written",
              file=sys.stderr)
        return EXIT_TERMINATED
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
