"""One-line messages from exceptions (bottom layer: imports nothing from ``detector``).

Every bad input and every fault path reports one line. The library's own expected errors
(bad config, data, weights, checkpoint, run folder, ...) subclass ``DetectorError``, so a
tool catches them all with one ``except`` (``detector/cli.py``). Where the line comes from
an exception raised by a library (omegaconf, torch, PIL, ONNX Runtime, ...), it is the
exception's first non-blank line, which is where those libraries put the reason.
"""

from __future__ import annotations


class DetectorError(Exception):
    """An expected error: bad user input (a config key, a data file, a weights file, a run
    folder...) or a run stopped for a reason the user can act on. Its message is one line
    naming the file, field or key. Subclasses keep a builtin base too (``ValueError``,
    ``RuntimeError``) for code that catches those.

    ``report`` is False on a process that stops because another process reports the same
    problem (one line in all from a distributed launch).
    """

    report: bool = True


def first_line(exc: BaseException) -> str:
    """The first non-blank line of ``str(exc)``, stripped; the exception's type name
    when the message is empty."""
    for line in str(exc).splitlines():
        if line.strip():
            return line.strip()
    return type(exc).__name__


def typed_first_line(exc: BaseException) -> str:
    """``"Type: first line"``, or ``"Type"`` when the message is empty."""
    line = first_line(exc)
    name = type(exc).__name__
    return name if not str(exc).strip() else f"{name}: {line}"
