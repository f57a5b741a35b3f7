"""The record store (detector/data/records.py): it gives back exactly the records the
parsers made (real COCO and VOC data, the tiny generated set), its subsets and files
too, and a forked worker that reads every record does not copy it (its private memory
stays flat in the number of records, where one object per image grows ~0.85 KB each)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from benchmarks.coco_file import write_coco_file
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
WALK = """
import json, sys
from benchmarks.records_memory import worker_walk
from detector.data.coco import CocoDetection
dataset = CocoDetection(sys.argv[2], sys.argv[1])
print(json.dumps({layout: worker_walk(dataset, layout)["growth_mib"] for layout in ("store", "list")}))
"""


@pytest.mark.skipif(not SMAPS_ROLLUP.exists() or not hasattr(os, "fork"), reason="needs /proc/self/smaps_rollup and fork")
def test_forked_worker_memory_stays_flat_in_the_number_of_records(tmp_path, repo_root):
    """A forked loader worker that reads all 20000 records keeps sharing them with its
    parent (USS growth < 2 MiB), while the control layout of one object per image is
    copied page by page (> 8 MiB). Measured in a fresh interpreter: the heap of a long
    pytest process has freed holes that any allocation in the child would dirty."""
    ann_file = tmp_path / "coco.json"
    write_coco_file(ann_file, 20_000, 140_000)
    env = {**os.environ, "PYTHONPATH": str(repo_root), "NO_ALBUMENTATIONS_UPDATE": "1"}
    out = subprocess.run([sys.executable, "-c", WALK, str(ann_file), str(tmp_path)], capture_output=True,
                         text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    growth_mib = json.loads(out.stdout.strip().splitlines()[-1])
    assert growth_mib["list"] > 8, growth_mib  # the probe sees copying
    assert growth_mib["store"] < 2, growth_mib
