"""One file that holds a ``RecordStore`` and a small JSON header: written atomically,
checked in full and memory-mapped read-only when read back.

Layout (little-endian; every offset a multiple of 64 bytes):

- ``DETREC01`` (8 bytes), the header's length ``H`` (uint64), the CRC-32 of the header
  (uint32) and of the data (uint32);
- the header, ``H`` bytes of UTF-8 JSON: ``version``, ``key`` (what the records were
  made from, compared on read), ``meta`` (the parser's other results: class names,
  counts), ``data_bytes`` and ``arrays`` (name -> ``[dtype, shape, offset, nbytes]``,
  offset from the data's start);
- zero padding, then the data: each array's bytes at its offset.

Reading maps the file once (``mmap``, read only) and makes each array a view of the
map: the processes that read one file share its pages (the page cache), and a forked
data loader worker shares them too; no array can be written. A file that is not
complete and intact (truncated, extended, a flipped byte, another version or key)
raises ``RecordFileError``, one line naming the file: nothing is read from it.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import zlib
from pathlib import Path
from typing import IO, Any, Dict, Tuple

import numpy as np

from detector.files import atomic_write

from .files import DataError
from .records import ALL_FIELDS, BOX_FIELDS, IMAGE_FIELDS, RecordStore

MAGIC = b"DETREC01"
VERSION = 1
ALIGN = 64
_PREFIX = struct.Struct("<8sQII")  # magic, header length, header CRC-32, data CRC-32

# The dtype of each array of a RecordStore.
FIELD_DTYPES: Dict[str, np.dtype] = {
    **{name: np.dtype(dtype) for name, (dtype, _) in BOX_FIELDS.items()},
    **{name: np.dtype(dtype) for name, dtype in IMAGE_FIELDS.items()},
    "box_start": np.dtype(np.int64), "path_start": np.dtype(np.int64), "path_bytes": np.dtype(np.uint8),
}


class RecordFileError(DataError):
    """A record file that cannot be used (one line naming it and why)."""


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _layout(store: RecordStore) -> Tuple[Dict[str, list], int]:
    """``(arrays spec, data bytes)``: each array's ``[dtype, shape, offset, nbytes]``."""
    specs, offset = {}, 0
    for name in ALL_FIELDS:
        a = store.arrays[name]
        specs[name] = [a.dtype.str, list(a.shape), offset, int(a.nbytes)]
        offset = _aligned(offset + int(a.nbytes))
    return specs, offset


def _chunks(store: RecordStore, specs: Dict[str, list], data_bytes: int):
    """The data's bytes, array by array, with the zero padding between them."""
    at = 0
    for name in ALL_FIELDS:
        offset, nbytes = specs[name][2], specs[name][3]
        if offset > at:
            yield bytes(offset - at)
        yield memoryview(np.ascontiguousarray(store.arrays[name]).reshape(-1).view(np.uint8))  # empty ones too
        at = offset + nbytes
    if data_bytes > at:
        yield bytes(data_bytes - at)


def write_record_file(path: str | os.PathLike, store: RecordStore, key: Dict[str, Any], meta: Dict[str, Any]) -> Path:
    """Write ``store`` with ``key`` and ``meta`` (JSON-able) to ``path``, atomically
    (``files.atomic_write``: a temporary file in the same folder, fsynced, renamed).
    Where ``path`` exists already (another process wrote the same records), it is
    replaced; readers that mapped the former file keep reading it.

    Raises:
        OutputError: one line naming ``path`` (the temporary file removed).
    """
    path = Path(path)
    specs, data_bytes = _layout(store)
    data_crc = 0
    for chunk in _chunks(store, specs, data_bytes):
        data_crc = zlib.crc32(chunk, data_crc)
    header = json.dumps({"version": VERSION, "key": key, "meta": meta, "data_bytes": data_bytes, "arrays": specs},
                        sort_keys=True).encode()
    prefix = _PREFIX.pack(MAGIC, len(header), zlib.crc32(header), data_crc)

    def write(f: IO[bytes]) -> None:
        f.write(prefix + header + bytes(_aligned(len(prefix) + len(header)) - len(prefix) - len(header)))
        for chunk in _chunks(store, specs, data_bytes):
            f.write(chunk)

    return atomic_write(path, write)


def _header(mm: mmap.mmap, path: Path) -> Tuple[Dict[str, Any], int]:
    """The checked header of the mapped file and the data's start."""
    if len(mm) < _PREFIX.size:
        raise RecordFileError(f"record file {path}: truncated ({len(mm)} bytes)")
    magic, size, header_crc, data_crc = _PREFIX.unpack_from(mm, 0)
    if magic != MAGIC:
        raise RecordFileError(f"record file {path}: not a record file of this version (starts {magic!r})")
    start = _aligned(_PREFIX.size + size)
    if len(mm) < start:
        raise RecordFileError(f"record file {path}: truncated ({len(mm)} bytes, the header alone needs {start})")
    raw = mm[_PREFIX.size:_PREFIX.size + size]
    if zlib.crc32(raw) != header_crc:
        raise RecordFileError(f"record file {path}: corrupt header (checksum mismatch)")
    header = json.loads(raw)
    if header.get("version") != VERSION:
        raise RecordFileError(f"record file {path}: version {header.get('version')}, this code reads {VERSION}")
    if len(mm) != start + header["data_bytes"]:
        raise RecordFileError(f"record file {path}: {len(mm)} bytes, its header says {start + header['data_bytes']} "
                              "(truncated or appended to)")
    if zlib.crc32(memoryview(mm)[start:]) != data_crc:
        raise RecordFileError(f"record file {path}: corrupt data (checksum mismatch)")
    return header, start


def _arrays(mm: mmap.mmap, header: Dict[str, Any], start: int, path: Path) -> Dict[str, np.ndarray]:
    """Read-only views of the mapped data, each checked against the store's dtypes."""
    specs = header["arrays"]
    if sorted(specs) != sorted(ALL_FIELDS):
        raise RecordFileError(f"record file {path}: arrays {sorted(specs)}, expected {sorted(ALL_FIELDS)}")
    out = {}
    for name, (dtype, shape, offset, nbytes) in specs.items():
        dt = np.dtype(dtype)
        count = int(np.prod(shape, dtype=np.int64))
        if dt != FIELD_DTYPES[name] or count * dt.itemsize != nbytes or offset + nbytes > header["data_bytes"]:
            raise RecordFileError(f"record file {path}: array {name!r} ({dtype}, shape {shape}) does not fit the file")
        out[name] = np.frombuffer(mm, dt, count, start + offset).reshape(shape)
    return out


def read_record_file(path: str | os.PathLike, key: Dict[str, Any] | None = None) -> Tuple[RecordStore, Dict[str, Any]]:
    """``(store, meta)`` of the record file ``path``, its arrays memory-mapped read-only.

    ``key``: the records' key expected (None: any).

    Raises:
        RecordFileError: a missing, unreadable, truncated, corrupt or foreign file, or one
            of another key: one line naming it.
    """
    path = Path(path)
    try:
        with open(path, "rb") as f:
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError) as exc:  # ValueError: an empty file cannot be mapped
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else "empty file"
        raise RecordFileError(f"record file {path}: cannot be read ({reason})") from None
    try:
        header, start = _header(mm, path)
        if key is not None and header["key"] != key:
            raise RecordFileError(f"record file {path}: made from other input than asked (key differs)")
        return RecordStore(_arrays(mm, header, start, path)), header["meta"]
    except (ValueError, KeyError, TypeError) as exc:  # JSON, a field missing, RecordStore's offset check
        if isinstance(exc, RecordFileError):
            raise
        raise RecordFileError(f"record file {path}: malformed ({type(exc).__name__}: {exc})") from None
