"""The record store (detector/data/records.py): it gives back exactly the records the
parsers made (real COCO and VOC data, the tiny generated set), its subsets and files
too, and a forked worker that reads every record does not copy it (its private memory
stays flat in the number of records, where one object per image grows ~0.85 KB each)."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import numpy as np
import pytest

from detector.data import CocoDetection, build_dataset
from detector.data.coco import parse_coco
from detector.data.dataset import DetectionDataset, Issues
from detector.data.records import BOX_FIELDS, ImageRecord, RecordStore
from detector.data.voc import VOC_CLASSES, parse_voc

SMAPS_ROLLUP = Path("/proc/self/smaps_rollup")


def _assert_same(got: ImageRecord, want: ImageRecord) -> None:
    assert (got.image_id, got.path, got.width, got.height) == (want.image_id, want.path, want.width, want.height)
    assert type(got.image_id) is int and type(got.width) is int and type(got.height) is int
    for name in BOX_FIELDS:
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and a.shape == b.shape, name
        np.testing.assert_array_equal(a, b, err_msg=name)


def _assert_store_holds(store: RecordStore, records) -> None:
    assert len(store) == len(records)
    for got, want in zip(store, records):
        _assert_same(got, want)
    for i in (0, len(records) - 1, -1) if records else ():
        _assert_same(store[i], records[i])


@pytest.mark.realdata
def test_store_round_trips_a_real_coco_parse(real_data, tmp_path):
    root = real_data / "coco2017_16"
    records, *_ = parse_coco(root / "instances.json", root / "images", Issues(strict=True))
    store = RecordStore.from_records(records)
    _assert_store_holds(store, records)
    assert store.num_boxes == sum(len(r.labels) for r in records) == 197
    store.save(tmp_path)
    _assert_store_holds(RecordStore.load(tmp_path, mmap=True), records)
    _assert_store_holds(RecordStore.load(tmp_path, mmap=False), records)
    # The data set reads the same records through get_annotation.
    ds = CocoDetection(root / "images", root / "instances.json")
    for i, want in enumerate(records):
        ann = ds.get_annotation(i)
        assert (ann["image_id"], ann["path"], ann["width"], ann["height"]) == (
            want.image_id, want.path, want.width, want.height)
        for name in ("boxes", "labels", "iscrowd", "difficult"):
            np.testing.assert_array_equal(ann[name].numpy(), getattr(want, name))


@pytest.mark.realdata
def test_store_round_trips_a_real_voc_parse(real_data):
    root = real_data / "voc2012_100" / "VOCdevkit" / "VOC2012"
    records = parse_voc(root, "all", VOC_CLASSES, Issues(strict=True))
    store = RecordStore.from_records(records)
    _assert_store_holds(store, records)
    assert int(store.arrays["difficult"].sum()) == 38
    # A subset (any order, repeats) holds the same records as picking them from the list.
    pick = [5, 0, 99, 5, 42]
    _assert_store_holds(store.subset(pick), [records[i] for i in pick])
    _assert_store_holds(store.subset([]), [])


def test_tiny_dataset_filter_empty_keeps_what_the_list_filter_kept(tiny_cfg):
    cfg = tiny_cfg("data.filter_empty=false")
    full = build_dataset(cfg, "train", is_train=True)
    records = list(full.records)
    # Make every third image crowd-only, every fourth difficult-only, then filter.
    for i, r in enumerate(records):
        if i % 3 == 0:
            r.iscrowd = np.ones_like(r.iscrowd)
        elif i % 4 == 0:
            r.difficult = np.ones_like(r.difficult)
    for use_difficult in (False, True):
        ds = DetectionDataset(records, full.class_names, full.label_to_category_id, filter_empty=True,
                              use_difficult=use_difficult, source="tiny")
        mask = [(~r.iscrowd & (np.ones_like(r.difficult) if use_difficult else ~r.difficult)).any() for r in records]
        _assert_store_holds(ds.records, [r for r, keep in zip(records, mask) if keep])
        assert ds.num_images_before_filter == len(records)
        assert ds.image_ids == [r.image_id for r, keep in zip(records, mask) if keep]


def test_store_records_are_read_only_and_paths_round_trip():
    odd = "imgs/caf\u00e9/\udcff.jpg"  # non-ASCII and an undecodable byte (surrogate escape)
    records = [ImageRecord(7, odd, 3, 2, np.zeros((0, 4), np.float32), np.zeros(0, np.int64), np.zeros(0, bool),
                           np.zeros(0, bool), np.zeros(0, np.int64), np.zeros(0, np.float32))]
    store = RecordStore.from_records(records)
    assert store[0].path == odd and store[0].boxes.shape == (0, 4)
    with pytest.raises(ValueError):
        store[0].boxes[...] = 1  # read-only view: nobody changes the shared arrays
    with pytest.raises(IndexError):
        store[1]


# ---------------------------------------------------------------------------------- memory
def _synthetic_records(num_images: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(num_images):
        n = int(rng.integers(1, 15))
        xy = rng.uniform(0, 300, (n, 2)).astype(np.float32)
        boxes = np.concatenate([xy, xy + rng.uniform(1, 300, (n, 2)).astype(np.float32)], axis=1)
        out.append(ImageRecord(i + 1, f"/data/coco/train2017/{i + 1:012d}.jpg", 640, 480, boxes,
                               rng.integers(1, 81, n), np.zeros(n, bool), np.zeros(n, bool),
                               np.arange(n, dtype=np.int64), rng.uniform(1, 9e4, n).astype(np.float32)))
    return out


def _uss_kib() -> int:
    """Private (unshared) memory of this process, KiB: Private_Clean + Private_Dirty."""
    fields = dict(line.split(":", 1) for line in SMAPS_ROLLUP.read_text().splitlines()[1:])
    return sum(int(fields[k].split()[0]) for k in ("Private_Clean", "Private_Dirty"))


def _walk(ds: DetectionDataset) -> None:
    for i in range(len(ds)):
        ds.get_annotation(i)


def _growth_in_forked_child(ds: DetectionDataset) -> int:
    """KiB by which a forked child's private memory grows while it reads every record."""
    read_fd, write_fd = os.pipe()
    gc.collect()
    pid = os.fork()
    if pid == 0:  # the child, as a data loader worker: read everything, report, leave
        code = 1
        try:
            os.close(read_fd)
            _walk_first = [ds.get_annotation(i) for i in range(8)]  # warm the allocator
            del _walk_first
            before = _uss_kib()
            _walk(ds)
            os.write(write_fd, str(_uss_kib() - before).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write_fd)
    with os.fdopen(read_fd) as pipe:
        result = pipe.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0 and result, "forked child failed"
    return int(result)


class _ListDataset(DetectionDataset):
    """The former layout, one ``ImageRecord`` per image in a list: the probe's control."""

    def __init__(self, records) -> None:
        super().__init__(records[:1], ["a"], {1: 1}, source="control")
        self.records = records


@pytest.mark.skipif(not SMAPS_ROLLUP.exists() or not hasattr(os, "fork"), reason="needs /proc/self/smaps_rollup and fork")
def test_forked_worker_memory_stays_flat_in_the_number_of_records():
    records = _synthetic_records(20_000)
    store_ds = DetectionDataset(records, ["a"] * 80, {k: k for k in range(1, 81)}, source="synthetic")
    list_ds = _ListDataset(records)
    del records
    # The control shows the probe sees copying: one object per image grows ~17 MiB.
    assert _growth_in_forked_child(list_ds) > 8 * 1024
    del list_ds
    assert _growth_in_forked_child(store_ds) < 2 * 1024
