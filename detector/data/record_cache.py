"""Parse an annotation file once per machine and share the records (``data.cache_dir``).

Without it, each rank of a run parses the annotation file and keeps its own copy: at
COCO train size (118k images) about 10 s of CPU and a transient peak of ~0.6 GiB per
rank, ~8.7 GiB per rank at Objects365 size, times the ranks of the machine.

With a cache folder, ``load_or_parse`` reads the records from a record file
(``record_file.py``) named after the annotation file and a key: the file's path, size,
modification and change times (ns) and inode, everything else the records depend on
(the data set class, image folder, classes, label space, ``filter_empty`` and
``use_difficult``), the record file's version and the package version. The file's
arrays are memory-mapped read-only, so the ranks of a machine and their loader workers
share one copy (the page cache).

- In a distributed run (a process group of more than one rank), local rank 0 of each
  machine reads the file or, when it is missing or invalid, parses the annotation file
  and writes it; the other ranks wait in a collective (up to ``train.dist_timeout_s``),
  then map the file local rank 0 names. A parse error on local rank 0 is every rank's
  error (one line). Where local rank 0 cannot write the file (a read-only folder, a full
  disk), a warning says so and every rank parses for itself.
- In one process, or in processes without a process group, each process reads the file
  or parses and writes it; two processes that write at once each write their own
  temporary file and rename it into place (the same records either way).

A file that is truncated, corrupt or made from other input is never read: it is parsed
again and rewritten, with a warning naming it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Tuple

from detector import __version__
from detector.distributed import all_gather_object, get_world_size, is_dist, node_of_process
from detector.files import OutputError
from detector.messages import first_line

from .files import DataError
from .record_file import VERSION as FILE_VERSION, RecordFileError, read_record_file, write_record_file
from .records import RecordStore

logger = logging.getLogger(__name__)

# Bump when a parser's output changes for the same input (the key then differs).
PARSER_VERSION = 1


@dataclass(frozen=True)
class RecordCache:
    """Where the record files go (``data.cache_dir`` resolved, see ``build.record_cache``)."""

    folder: Path


@dataclass
class ParsedRecords:
    """A parser's result: the records and its other results (JSON-able ``meta``: class
    names, the label -> category id map, counts for the log)."""

    store: RecordStore
    meta: Dict[str, Any]


def cache_key(ann_file: str | os.PathLike, options: Dict[str, Any]) -> Dict[str, Any]:
    """What the records of ``ann_file`` parsed with ``options`` (JSON-able) depend on."""
    st = os.stat(ann_file)
    return {"ann_file": os.path.realpath(ann_file), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "ctime_ns": st.st_ctime_ns, "inode": st.st_ino, "options": options, "parser_version": PARSER_VERSION,
            "file_version": FILE_VERSION, "detector_version": __version__}


def cache_path(folder: Path, ann_file: str | os.PathLike, key: Dict[str, Any]) -> Path:
    """``folder/<annotation file stem>-<16 hex digits of the key's hash>.records``."""
    stem = re.sub(r"[^A-Za-z0-9._-]", "_", Path(ann_file).stem)[:64]
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return folder / f"{stem}-{digest}.records"


def _read(path: Path, key: Dict[str, Any]) -> ParsedRecords:
    store, meta = read_record_file(path, key)
    return ParsedRecords(store, meta)


def _read_or_build(path: Path, key: Dict[str, Any], parse: Callable[[], ParsedRecords]) -> Tuple[ParsedRecords, bool]:
    """The records of ``path``, or ``parse()``'d and written there (then read back,
    mapped). Returns ``(records, in the file)``: False where the file cannot be written."""
    if path.exists():
        try:
            records = _read(path, key)
            logger.info("records: %d images, %d boxes read from %s", len(records.store), records.store.num_boxes, path)
            return records, True
        except RecordFileError as exc:
            logger.warning("%s; parsing the annotation file again", exc)
    records = parse()
    try:
        write_record_file(path, records.store, key, records.meta)
    except OutputError as exc:
        logger.warning("data.cache_dir: %s; the records are not shared", first_line(exc))
        return records, False
    try:
        mapped = _read(path, key)  # the parsed arrays are freed; the pages are the file's
    except RecordFileError as exc:  # e.g. replaced meanwhile by a file of another version
        logger.warning("%s; the records are not shared", exc)
        return records, False
    logger.info("records: %d images, %d boxes saved to %s (data.cache_dir)", len(records.store),
                records.store.num_boxes, path)
    return mapped, True


def _leader_status(path: Path, key: Dict[str, Any],
                   parse: Callable[[], ParsedRecords]) -> Tuple[Optional[ParsedRecords], Optional[BaseException], tuple]:
    """Local rank 0: ``(records, error, status for the others)``; the status is ``("file",
    path)``, ``("parse", "")`` (no file: each rank parses) or ``("error", message)``."""
    try:
        records, in_file = _read_or_build(path, key, parse)
    except Exception as exc:  # noqa: BLE001 - every rank of the machine raises it (one line)
        return None, exc, ("error", first_line(exc))
    return records, None, ("file", str(path)) if in_file else ("parse", "")


def load_or_parse(cache: Optional[RecordCache], ann_file: str | os.PathLike, options: Dict[str, Any],
                  parse: Callable[[], ParsedRecords]) -> ParsedRecords:
    """The records of ``ann_file`` parsed with ``options``: ``parse()`` without a cache,
    else shared through the record file in ``cache.folder`` (see the module docstring).

    In a distributed run every rank must call it (it holds a collective).

    Raises:
        whatever ``parse`` raises (on every rank of the machine: ``DataError`` with local
        rank 0's one line on the others).
    """
    if cache is None or not os.path.isfile(ann_file):  # no file: the parser's own error, on every rank
        return parse()
    key = cache_key(ann_file, options)
    path = cache_path(cache.folder, ann_file, key)
    if not (is_dist() and get_world_size() > 1):
        return _read_or_build(path, key, parse)[0]
    node, local_rank = node_of_process()
    records, error, status = _leader_status(path, key, parse) if local_rank == 0 else (None, None, None)
    statuses = all_gather_object((node, local_rank, status))
    if error is not None:
        raise error
    if records is not None:
        return records
    leader = next((s for n, r, s in statuses if n == node and r == 0), None)
    if leader is None:  # no local rank 0 on this machine: a launch of its own kind
        return _read_or_build(path, key, parse)[0]
    kind, text = leader
    if kind == "error":
        raise DataError(text)
    if kind == "parse":
        return parse()
    try:
        return _read(Path(text), key)
    except RecordFileError as exc:  # e.g. a folder that is not the same on every rank
        logger.warning("%s; parsing the annotation file here", exc)
        return parse()
