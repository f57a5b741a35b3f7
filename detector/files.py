"""Writing output files: the one way every tool and the library write a result file
(bottom layer: imports nothing from ``detector`` but ``messages``).

``atomic_write(path, writer)`` writes into a temporary file in the same folder, flushes
and fsyncs it, then renames it over ``path``. A failure at any point (a full disk, a
quota, a folder in the way, a writer that raises) removes the temporary file, leaves
``path`` as it was (absent, or the previous complete file) and raises ``OutputError``:
one line naming the path. So no tool leaves a ``.tmp`` file or a partial output behind.

``output_folder(path, what)`` makes sure a folder can take outputs before work starts;
``check_writes_apart(writes, reads)`` that no file a tool writes is one of its inputs.
"""

from __future__ import annotations

import errno
import math
import os
from pathlib import Path
from typing import IO, Any, Callable, Mapping, Optional

from detector.messages import DetectorError, first_line


class OutputError(DetectorError, OSError):
    """An output file or folder cannot be written: one line naming the path (an
    ``OSError`` too, for code that catches those)."""


def write_reason(exc: BaseException) -> str:
    """Why a write failed, in words: "no space left on the device", the OS's words, or
    the exception's first line."""
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        return "no space left on the device"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return first_line(exc)


def json_safe(value: Any) -> Any:
    """``value`` with every non-finite float (NaN, Inf) as None: strict JSON (``null``)
    has no NaN, and ``JSON.parse`` or a strict reader refuses the file otherwise."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def write_error(path: "str | os.PathLike", exc: BaseException) -> OutputError:
    """``OutputError("cannot write <path>: <reason>")`` for a failed write to ``path``
    ("no space left on the device", the OS's words, or the exception's first line)."""
    return OutputError(f"cannot write {path}: {write_reason(exc)}")


def missing_file_state(path: "str | os.PathLike") -> str:
    """Why ``path`` is no file to read, in words for a message: ``"not found"``, ``"is a
    folder, not a file"``, ``"is a link to nothing (or a loop of links)"`` or ``"is not
    a regular file"`` (a device, a pipe)."""
    path = Path(path)
    if path.is_dir():
        return "is a folder, not a file"
    if path.is_symlink() and not path.exists():
        return "is a link to nothing (or a loop of links)"
    return "is not a regular file" if path.exists() else "not found"


def same_file(a: "str | os.PathLike", b: "str | os.PathLike") -> bool:
    """Whether ``a`` and ``b`` name one file (by any path: a link, ``./``, ``..``); for a
    path that does not exist yet, whether they resolve alike."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)


def check_writes_apart(writes: Mapping[str, "str | os.PathLike"],
                       reads: Mapping[str, "Optional[str | os.PathLike]"]) -> None:
    """Refuse, before any work, a file a tool would write (``writes``: what names it ->
    path) that is one of its inputs (``reads``: argument -> path, None where not given):
    writing it would destroy the input (``export.py --output`` its own ``--weights``,
    ``eval.py --output-dir`` that holds the ``--predictions`` file ``detections.json``).

    Raises:
        OutputError: ``<what> <path> is the <argument> file <path>: ...``.
    """
    for what, out in writes.items():
        for argument, source in reads.items():
            if source is not None and os.path.isfile(source) and same_file(out, source):
                raise OutputError(f"{what} {out} is the {argument} file {source}: writing it would destroy that "
                                  "input; choose another path")


def no_file_message(what: str, path: "str | os.PathLike") -> str:
    """The message for ``path``, a ``what`` to read that is no file: ``"<what> not found:
    <path>"``, or ``"<what> <path> is a folder, not a file"`` (``missing_file_state``)."""
    state = missing_file_state(path)
    return f"{what} not found: {path}" if state == "not found" else f"{what} {path} {state}"


def output_folder(path: "str | os.PathLike", what: str = "output folder") -> Path:
    """Create ``path`` (and its parents) if needed and check it is a writable folder.

    Raises:
        OutputError: ``path`` (or a parent) is a file, or it cannot be created or written.
    """
    path = Path(path)
    if not str(path).strip():
        raise OutputError(f"{what} is empty: name a folder")
    if path.exists() and not path.is_dir():
        raise OutputError(f"{what} {path} is a file, not a folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputError(f"cannot create {what} {path}: {write_reason(exc)}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise OutputError(f"{what} {path} is not writable")
    return path


def atomic_write(path: "str | os.PathLike", writer: Callable[[IO[Any]], Any], mode: str = "wb") -> Path:
    """Write ``path`` through ``writer(f)``, atomically (see the module docstring).

    Args:
        path: the file to write; its folder is created if needed.
        writer: called once with the open temporary file (``mode``: ``"wb"`` binary,
            ``"w"`` text, UTF-8, ``newline=""`` so a CSV writer controls line ends).

    Raises:
        OutputError: one line naming ``path`` and the reason (the temporary file removed).
    """
    path = Path(path)
    if path.is_dir():
        raise OutputError(f"cannot write {path}: it is a folder; name a file")
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        text = "b" not in mode
        with open(tmp, mode, **({"encoding": "utf-8", "newline": ""} if text else {})) as f:
            writer(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except (OSError, ValueError, RuntimeError) as exc:
        # The cause stays attached: for log.txt, and for callers that word their own line.
        raise write_error(path, exc) from exc
    finally:
        try:
            tmp.unlink()
        except OSError:  # renamed (the normal case), or never created
            pass
    return path


def write_bytes(path: "str | os.PathLike", data: bytes) -> Path:
    """``atomic_write`` of ``data``."""
    return atomic_write(path, lambda f: f.write(data))


def write_text(path: "str | os.PathLike", text: str) -> Path:
    """``atomic_write`` of ``text`` (UTF-8)."""
    return atomic_write(path, lambda f: f.write(text), mode="w")
