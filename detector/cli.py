"""The one way a tool turns a bad input into one line and an exit status (bottom layer:
imports only ``detector.messages``).

Every ``tools/*.py`` ends its ``main`` with ``return run_tool(lambda: body(args))``:

- an expected error (``EXPECTED_ERRORS``: the library's ``DetectorError`` subclasses, and
  the builtin errors a bad user input raises from other libraries: a missing or
  unwritable path, a bad value, a missing optional package) prints ``error: <its first
  line>`` on stderr and exits with status 1;
- Ctrl-C (``KeyboardInterrupt``) prints ``error: <interrupted>`` and exits with 130;
- anything else is a bug: the traceback is printed as usual.

The traceback of an expected error goes to the ``detector`` logger at DEBUG level, which
``setup_logging`` writes to ``<run folder>/log.txt`` where a run folder exists, and which
the console does not show. Usage errors stay with argparse (status 2).
"""

from __future__ import annotations

import logging
import sys
from typing import Callable, Optional

from detector.messages import DetectorError, first_line

EXPECTED_ERRORS = (DetectorError, OSError, ValueError, ImportError)

EXIT_ERROR = 1
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report Ctrl-C

logger = logging.getLogger("detector.cli")


def report_error(exc: BaseException, line: Optional[str] = None) -> int:
    """Log ``exc``'s traceback (DEBUG: log.txt only), print ``error: <line>`` (default:
    ``exc``'s first line) on stderr unless ``exc.report`` is False (another process
    reports it); return 1."""
    logger.debug("stopped with an error", exc_info=exc)
    if not isinstance(exc, DetectorError) or exc.report:
        print(f"error: {line or first_line(exc)}", file=sys.stderr)
    return EXIT_ERROR


def run_tool(body: Callable[[], int], interrupted: str = "interrupted") -> int:
    """Run a tool's ``body`` and return its exit status: ``body()``'s own, 1 after an
    expected error (one line on stderr), 130 after Ctrl-C (``error: <interrupted>``)."""
    try:
        return body()
    except EXPECTED_ERRORS as exc:
        return report_error(exc)
    except KeyboardInterrupt:
        print(f"error: {interrupted}", file=sys.stderr)
        return EXIT_INTERRUPTED
