"""One-line messages from exceptions (bottom layer: imports nothing from ``detector``).

Every bad input and every fault path reports one line. The library's own expected errors
(bad config, data, weights, checkpoint, run folder, ...) subclass ``DetectorError``, so a
tool catches them all with one ``except`` (``detector/cli.py``). Where the line comes from
an exception raised by a library (omegaconf, torch, PIL, ONNX Runtime, ...), it is the
exception's first non-blank line, which is where those libraries put the reason.
"""

from __future__ import annotations

import difflib
import unicodedata
from typing import Iterable

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


def shown_path(path: object) -> str:
    """``path`` for a one-line message: as it is, or as Python writes it in quotes
    (``'a\\x00b.jpg'``) where it holds a character a terminal would not show as itself
    (a NUL, a newline, a control code), which would break or hide the line."""
    text = str(path)
    return text if text.isprintable() else repr(text)


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` naming the choice closest to ``name``, or ``""``. A
    choice that differs from ``name`` only in its Unicode normalisation (``café`` as
    one code point or as ``e`` plus an accent, NFC against NFD) looks the same in the
    message: that is said."""
    choices = list(choices)
    same = [c for c in choices if c != name and unicodedata.normalize("NFC", c) == unicodedata.normalize("NFC", name)]
    if same:
        return (f" ({same[0]!r} looks the same but is written with other Unicode code points: one is NFC, the other "
                "NFD normalised; write both alike)")
    near = difflib.get_close_matches(name, choices, n=1)
    return f" (did you mean {near[0]!r}?)" if near else ""
