"""Training logs: console lines with ETA, ``metrics.jsonl`` and TensorBoard.

Only the main process creates these writers; other ranks keep ``None``.
"""

from __future__ import annotations

import datetime
import json
import logging
import math
import os
import resource
import statistics
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, NamedTuple, Optional, Sequence

import torch

from detector.files import json_safe, write_error, write_text

logger = logging.getLogger(__name__)


class ErrorsOnly(logging.Filter):
    """Passes records of level ERROR and above: the console filter of ranks other than
    0, so that a warning every rank would repeat is printed once, by rank 0."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR


LOG_WIDTH = 120  # characters per console and log.txt line


class WrappingFormatter(logging.Formatter):
    """Wraps each line of a message longer than ``width`` characters at spaces, the
    continuation lines indented by 4 (a traceback is left as it is)."""

    def __init__(self, fmt: str, datefmt: str, width: int = LOG_WIDTH) -> None:
        super().__init__(fmt, datefmt)
        self.width = width

    def formatMessage(self, record: logging.LogRecord) -> str:
        lines = []
        for line in super().formatMessage(record).splitlines() or [""]:
            lines.extend(textwrap.wrap(line, self.width, subsequent_indent="    ", break_long_words=False,
                                       break_on_hyphens=False) if len(line) > self.width else [line])
        return "\n".join(lines)


class LogFileHandler(logging.FileHandler):
    """``log.txt``: a write that fails (a full disk) is one warning on the console, and
    the file is written no more (logging's default prints a traceback for every record)."""

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 (logging's name)
        exc = sys.exc_info()[1]
        if not isinstance(exc, OSError):
            super().handleError(record)
            return
        self.setLevel(logging.CRITICAL + 1)  # nothing more to this file
        stream, self.stream = self.stream, None
        try:
            stream.close()  # (the unwritten buffer fails again; the file is closed)
        except OSError:
            pass
        print(f"warning: {write_error(self.baseFilename, exc)}; the log goes on on the console only",
              file=sys.stderr)


def setup_logging(output_dir: Optional[str | os.PathLike] = None, rank: int = 0, level: int = logging.INFO) -> None:
    """Configure the ``detector`` logger and Python's warnings (``py.warnings``, through
    ``logging.captureWarnings``): console on rank 0 at ``level``, errors only on the
    other ranks (``ErrorsOnly``), and ``<output_dir>/log.txt`` on rank 0, lines wrapped
    at ``LOG_WIDTH``. Called once by the entry point."""
    logging.captureWarnings(True)
    prefix = f"[rank {rank}] " if rank > 0 else ""
    fmt = WrappingFormatter(f"%(asctime)s {prefix}%(levelname).1s %(name)s: %(message)s", "%H:%M:%S")
    console = logging.StreamHandler(sys.stdout)
    console.setLevel(level)
    if rank > 0:
        console.addFilter(ErrorsOnly())
    console.setFormatter(fmt)
    handlers: List[logging.Handler] = [console]
    if output_dir is not None and rank == 0:
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        fh = LogFileHandler(Path(output_dir) / "log.txt")
        fh.setLevel(logging.DEBUG)
        fh.setFormatter(fmt)
        handlers.append(fh)
    for name in ("detector", "py.warnings"):
        log = logging.getLogger(name)
        log.setLevel(logging.DEBUG)
        log.propagate = False
        for h in list(log.handlers):
            if getattr(h, "_detector_handler", False):
                log.removeHandler(h)
                if name == "detector":  # the same handler objects serve both loggers
                    h.close()
        for h in handlers:
            h._detector_handler = True  # type: ignore[attr-defined]
            log.addHandler(h)


def eta_seconds(recent_iter_times: Sequence[float], remaining: int) -> float:
    """Seconds left: the median seconds per iteration of the recent logging windows
    times the ``remaining`` iterations (0 before any window). The median, not the mean:
    one slow window (the first one's compilation and CUDA-graph capture, an evaluation,
    a checkpoint) stops setting the estimate once three windows are in."""
    return statistics.median(recent_iter_times) * remaining if recent_iter_times else 0.0


def format_eta(seconds: float) -> str:
    """``3725.2`` -> ``"1:02:05"``."""
    return str(datetime.timedelta(seconds=int(max(0.0, seconds))))


def peak_memory_mb(device: torch.device) -> float:
    """Peak memory of this process in MiB: CUDA max allocated, or the CPU peak RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    # ru_maxrss is in KiB on Linux.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def format_lrs(lrs: Dict[str, float]) -> str:
    """Each optimizer group's LR by name, ``lr[default] 0.02  lr[backbone.body] 0.002``;
    a sub-group (``default/norm``, ``default/bias``) is shown only where its LR differs
    from its rule's group."""
    shown = {}
    for name, lr in lrs.items():
        parent = name.split("/")[0]
        if parent != name and parent in lrs and lrs[parent] == lr:
            continue
        shown[name] = lr
    return "  ".join(f"lr[{name}] {lr:.3g}" for name, lr in shown.items())


def format_console_line(record: Dict[str, Any], max_iter: int, eta_seconds: float,
                        lrs: Optional[Dict[str, float]] = None) -> str:
    """One console line from a training record of ``metrics.jsonl``; ``lrs``: each
    group's LR by name (default: the record's ``lr``, the ``default`` group's)."""
    losses = "  ".join(f"{k} {record[k]:.4f}" for k in sorted(record) if k.startswith("loss_"))
    lr_text = format_lrs(lrs) if lrs else f"lr[default] {record['lr']:.3g}"
    return (
        f"iter {record['iteration']}/{max_iter}  eta {format_eta(eta_seconds)}  "
        f"total_loss {record['total_loss']:.4f}  {losses}  {lr_text}  "
        f"time {record['time']:.3f}s  data {record['data_time']:.3f}s  "
        f"{record['images_per_sec']:.1f} img/s  mem {record['memory_mb']:.0f}MiB"
    )


class DeviceCounter(NamedTuple):
    """A count the training step keeps on the device (it never reads it itself), which
    ``MetricsWriter`` reads at logging points: it records how much it grew since the
    last record under ``name`` and, when it grew, logs one warning ``message.format(count=N)``.

    Attributes:
        name: the ``metrics.jsonl`` key and TensorBoard tag, e.g. ``static/nms_unconverged``.
        value: 0-d device tensor, the count so far; its owner updates it in place.
        message: the warning, a format string with ``{count}``, naming what to change.
    """

    name: str
    value: torch.Tensor
    message: str


class JSONLWriter:
    """Append-only ``metrics.jsonl``: one strict JSON object per line (a NaN or Inf value,
    e.g. the loss of a skipped step, is ``null``), each with ``iteration``.

    ``truncate_after(it)`` drops every line whose iteration is greater than ``it``
    (used on resume, so no iteration is logged twice and none is missing).
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def truncate_after(self, iteration: int) -> int:
        """Keep the records with ``iteration <= iteration``; returns how many lines were
        dropped: those past it, and any line that is no record (cut by a crash, or bytes
        that are no text: a file system may leave garbage at the end after a power loss)."""
        if not self.path.exists():
            return 0
        kept: List[str] = []
        dropped = 0
        for line in self.path.read_bytes().decode("utf-8", errors="replace").splitlines():
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                record = None
            it = record.get("iteration", 0) if isinstance(record, dict) else None
            if isinstance(it, (int, float)) and it <= iteration:
                kept.append(line)
            else:
                dropped += 1
        write_text(self.path, "".join(line + "\n" for line in kept))
        return dropped

    def write(self, record: Dict[str, Any]) -> None:
        """Append ``record`` as one line.

        Raises:
            OutputError: one line naming the file (a full disk: "no space left on the device").
        """
        try:
            with open(self.path, "a") as f:
                f.write(json.dumps(json_safe(record), sort_keys=True, allow_nan=False) + "\n")  # NaN: null
                f.flush()
        except OSError as exc:
            raise write_error(self.path, exc) from None


def read_jsonl(path: str | os.PathLike) -> List[Dict[str, Any]]:
    """All records of a ``metrics.jsonl``."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


class TensorBoardWriter:
    """A thin wrapper over ``torch.utils.tensorboard.SummaryWriter`` writing to ``<dir>``."""

    def __init__(self, log_dir: str | os.PathLike, purge_step: Optional[int] = None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # purge_step drops events at or after that step left by an interrupted run.
        self.writer = SummaryWriter(log_dir=str(log_dir), purge_step=purge_step)

    def scalars(self, values: Dict[str, float], step: int) -> None:
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, step)

    def image(self, tag: str, image_chw_uint8: torch.Tensor, step: int) -> None:
        """``image_chw_uint8``: uint8 ``[3, H, W]``."""
        self.writer.add_image(tag, image_chw_uint8, step, dataformats="CHW")

    def text(self, tag: str, text: str, step: int = 0) -> None:
        self.writer.add_text(tag, text, step)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


@dataclass
class EventWriters:
    """Where records go (rank 0; None elsewhere or when turned off)."""

    jsonl: Optional[JSONLWriter] = None
    tb: Optional[TensorBoardWriter] = None

    def write(self, record: Dict[str, Any], scalars: Dict[str, float], step: int) -> None:
        if self.jsonl is not None:
            self.jsonl.write(record)
        if self.tb is not None:
            self.tb.scalars({k: v for k, v in scalars.items() if math.isfinite(v)}, step)

    def close(self) -> None:
        """Close the TensorBoard writer (the JSONL file is closed after every record)."""
        if self.tb is not None:
            self.tb.close()
            self.tb = None
