"""The annotation records of a data set: ``ImageRecord`` (one image, the value a reader
gets) and ``RecordStore`` (every image's records in a few flat numpy arrays).

Why flat arrays: a data loader worker is a fork of the main process and shares its
memory until a page is written. Reading a Python object writes its reference count, so
a data set of one object per image (a record, its arrays, its path) is copied into
every worker, page by page, as the worker reads it: about 0.85 KB per image, 98 MiB per
worker at COCO train2017's 118k images. A ``RecordStore`` holds 13 numpy arrays
whatever the number of images; reading image ``i`` builds its ``ImageRecord`` from
slices of them, and nothing of the shared pages is written. The arrays can also be
saved to a folder of ``.npy`` files and memory-mapped back (``save`` / ``load``); the
ranks of a machine share one copy through a checked single file instead
(``record_file.py``, ``record_cache.py``: ``data.cache_dir``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from operator import attrgetter
from pathlib import Path
from typing import Dict, Iterator, List, Sequence, Union, overload

import numpy as np

# Per box (index j in 0..N-1, images' boxes one after another): dtype, trailing shape.
BOX_FIELDS = {
    "boxes": (np.float32, (4,)),  # xyxy, clipped to the image
    "labels": (np.int64, ()),  # 1..K
    "iscrowd": (np.bool_, ()),
    "difficult": (np.bool_, ()),
    "ann_ids": (np.int64, ()),
    "areas": (np.float32, ()),  # pixels^2
}
# Per image (index i in 0..I-1).
IMAGE_FIELDS = {"image_ids": np.int64, "widths": np.int64, "heights": np.int64}
# Offsets: image i's boxes are box_start[i]:box_start[i+1], its path (utf-8, as
# ``os.fsencode`` writes it) path_bytes[path_start[i]:path_start[i+1]].
OFFSET_FIELDS = ("box_start", "path_start")
ALL_FIELDS = (*BOX_FIELDS, *IMAGE_FIELDS, *OFFSET_FIELDS, "path_bytes")


@dataclass
class ImageRecord:
    """One image and its raw annotations in original-image pixel coordinates.

    Read from a ``RecordStore``, the arrays are read-only views into the store."""

    image_id: int
    path: str
    width: int
    height: int
    boxes: np.ndarray  # float32 [N, 4] xyxy, clipped to the image
    labels: np.ndarray  # int64 [N], 1..K
    iscrowd: np.ndarray  # bool [N]
    difficult: np.ndarray  # bool [N]
    ann_ids: np.ndarray  # int64 [N], annotation ids (VOC: running index within the set)
    areas: np.ndarray  # float32 [N], area for COCO size buckets (pixels^2)


def _read_only(array: np.ndarray) -> np.ndarray:
    view = array.view()
    view.flags.writeable = False
    return view


class RecordStore:
    """The records of ``I`` images with ``N`` boxes in all, as flat numpy arrays.

    Fields (see ``BOX_FIELDS``, ``IMAGE_FIELDS``): per box ``boxes`` float32 ``[N, 4]``,
    ``labels`` int64 ``[N]``, ``iscrowd`` / ``difficult`` bool ``[N]``, ``ann_ids`` int64
    ``[N]``, ``areas`` float32 ``[N]``; per image ``image_ids``, ``widths``, ``heights``
    int64 ``[I]``; offsets ``box_start`` int64 ``[I + 1]`` (image ``i``'s boxes are
    ``box_start[i]:box_start[i+1]``), ``path_start`` int64 ``[I + 1]`` into
    ``path_bytes`` uint8 ``[P]``.

    Indexing gives ``ImageRecord`` values (``store[i]``; a slice gives a list); iterating
    gives every record in order. The arrays are never written after construction.
    """

    def __init__(self, arrays: Dict[str, np.ndarray]) -> None:
        missing = [name for name in ALL_FIELDS if name not in arrays]
        if missing:
            raise ValueError(f"RecordStore: missing arrays {missing}")
        self.arrays = {name: _read_only(arrays[name]) for name in ALL_FIELDS}
        num_images, num_boxes = len(self.arrays["image_ids"]), len(self.arrays["labels"])
        a = self.arrays
        if (len(a["box_start"]) != num_images + 1 or len(a["path_start"]) != num_images + 1
                or int(a["box_start"][-1]) != num_boxes or int(a["path_start"][-1]) != len(a["path_bytes"])):
            raise ValueError(f"RecordStore: inconsistent offsets for {num_images} images, {num_boxes} boxes")
        self._num_images = num_images

    # ------------------------------------------------------------------ building
    @classmethod
    def from_records(cls, records: Sequence[ImageRecord]) -> "RecordStore":
        """The store of ``records`` (any sequence of ``ImageRecord``, e.g. a parser's list)."""
        counts = np.fromiter((len(r.labels) for r in records), np.int64, len(records))
        paths = [os.fsencode(r.path) for r in records]
        arrays: Dict[str, np.ndarray] = {
            "box_start": np.concatenate([[0], np.cumsum(counts)]).astype(np.int64),
            "path_start": np.concatenate([[0], np.cumsum([len(p) for p in paths], dtype=np.int64)]).astype(np.int64),
            "path_bytes": np.frombuffer(b"".join(paths), np.uint8).copy(),
            "image_ids": np.fromiter((r.image_id for r in records), np.int64, len(records)),
            "widths": np.fromiter((r.width for r in records), np.int64, len(records)),
            "heights": np.fromiter((r.height for r in records), np.int64, len(records)),
        }
        for name, (dtype, shape) in BOX_FIELDS.items():
            parts = list(map(attrgetter(name), records))
            if any(p.shape[1:] != shape for p in parts):  # e.g. an empty image's boxes of shape [0]
                parts = [np.asarray(p).reshape((-1, *shape)) for p in parts]
            arrays[name] = np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros((0, *shape), dtype)
        return cls(arrays)

    def subset(self, indices: Sequence[int] | np.ndarray) -> "RecordStore":
        """A new store of the images ``indices`` (int ``[M]``), in that order."""
        idx = np.asarray(indices, np.int64).reshape(-1)
        a = self.arrays
        starts, ends = a["box_start"][idx], a["box_start"][idx + 1]
        box_idx = _ranges(starts, ends)
        pstarts, pends = a["path_start"][idx], a["path_start"][idx + 1]
        out = {name: a[name][box_idx] for name in BOX_FIELDS}
        out.update({name: a[name][idx] for name in IMAGE_FIELDS})
        out["box_start"] = np.concatenate([[0], np.cumsum(ends - starts)]).astype(np.int64)
        out["path_start"] = np.concatenate([[0], np.cumsum(pends - pstarts)]).astype(np.int64)
        out["path_bytes"] = a["path_bytes"][_ranges(pstarts, pends)]
        return RecordStore(out)

    @classmethod
    def concatenate(cls, stores: Sequence["RecordStore"], id_offsets: Sequence[int]) -> "RecordStore":
        """One store of ``stores``' images, one store after another, each store's image
        ids plus its entry of ``id_offsets`` (int, one per store)."""
        if not stores or len(id_offsets) != len(stores):
            raise ValueError("RecordStore.concatenate: one id offset per store, and at least one store")
        out = {name: np.concatenate([s.arrays[name] for s in stores]) for name in (*BOX_FIELDS, "widths", "heights",
                                                                                   "path_bytes")}
        out["image_ids"] = np.concatenate([s.arrays["image_ids"] + off for s, off in zip(stores, id_offsets)])
        for name, total in (("box_start", "labels"), ("path_start", "path_bytes")):
            bases = np.cumsum([0] + [len(s.arrays[total]) for s in stores[:-1]])
            out[name] = np.concatenate([[0]] + [s.arrays[name][1:] + b for s, b in zip(stores, bases)]).astype(np.int64)
        return cls(out)

    # ------------------------------------------------------------------ files
    def save(self, folder: Union[str, os.PathLike]) -> None:
        """Write each array to ``folder/<name>.npy`` (the folder must exist)."""
        for name, array in self.arrays.items():
            np.save(Path(folder) / f"{name}.npy", array, allow_pickle=False)

    @classmethod
    def load(cls, folder: Union[str, os.PathLike], mmap: bool = True) -> "RecordStore":
        """The store saved in ``folder``; with ``mmap`` its arrays are read-only memory
        maps (the processes that map one file share its pages)."""
        mode = "r" if mmap else None
        return cls({name: np.load(Path(folder) / f"{name}.npy", mmap_mode=mode, allow_pickle=False)
                    for name in ALL_FIELDS})

    # ------------------------------------------------------------------ reading
    def __len__(self) -> int:
        return self._num_images

    @property
    def num_boxes(self) -> int:
        return len(self.arrays["labels"])

    @property
    def nbytes(self) -> int:
        """Bytes of all arrays."""
        return sum(int(a.nbytes) for a in self.arrays.values())

    def box_image_index(self) -> np.ndarray:
        """int64 ``[N]``: the image index ``i`` of each box."""
        return np.repeat(np.arange(self._num_images, dtype=np.int64), np.diff(self.arrays["box_start"]))

    def path(self, i: int) -> str:
        """The image file of image ``i``."""
        start, end = self.arrays["path_start"][i], self.arrays["path_start"][i + 1]
        return os.fsdecode(self.arrays["path_bytes"][start:end].tobytes())

    def record(self, i: int) -> ImageRecord:
        """Image ``i``'s record (``0 <= i < len``, negative counts from the end); its
        arrays are read-only views into the store."""
        if not -self._num_images <= i < self._num_images:
            raise IndexError(f"record index {i} out of range for {self._num_images} images")
        i = int(i) % self._num_images
        a = self.arrays
        lo, hi = int(a["box_start"][i]), int(a["box_start"][i + 1])
        return ImageRecord(image_id=int(a["image_ids"][i]), path=self.path(i), width=int(a["widths"][i]),
                           height=int(a["heights"][i]), **{name: a[name][lo:hi] for name in BOX_FIELDS})

    @overload
    def __getitem__(self, key: int) -> ImageRecord: ...

    @overload
    def __getitem__(self, key: slice) -> List[ImageRecord]: ...

    def __getitem__(self, key: int | slice) -> ImageRecord | List[ImageRecord]:
        if isinstance(key, slice):
            return [self.record(i) for i in range(*key.indices(self._num_images))]
        return self.record(int(key))

    def __iter__(self) -> Iterator[ImageRecord]:
        return (self.record(i) for i in range(self._num_images))

    def __repr__(self) -> str:
        return f"RecordStore(images={self._num_images}, boxes={self.num_boxes}, {self.nbytes / 2**20:.1f} MiB)"


def _ranges(starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """int64: the concatenation of ``arange(starts[k], ends[k])`` over k (no Python loop)."""
    lengths = ends - starts
    total = int(lengths.sum())
    if total == 0:
        return np.zeros((0,), np.int64)
    # Each element is its run's start plus its position within the run.
    run_offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    return np.repeat(starts - run_offsets, lengths) + np.arange(total, dtype=np.int64)
