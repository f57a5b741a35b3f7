"""One-line messages from exceptions (bottom layer: imports nothing from ``detector``).

Every bad input and every fault path reports one line. Where that line comes from an
exception raised by a library (omegaconf, torch, PIL, ONNX Runtime, ...), it is the
exception's first non-blank line, which is where those libraries put the reason.
"""

from __future__ import annotations


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
