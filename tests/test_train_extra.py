"""Several training sets as one (``data.train_extra``): the joined set holds each set's
images and boxes, refuses sets of other classes or a set listed twice with one line, and
trains; ``tools/check_dataset.py`` reports each set."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import load_tool
from detector.config import ConfigError, load_config
from detector.data import DataError, build_dataset
from detector.data.check import check_datasets
from detector.data.concat import check_every_class
from detector.data.dataset import DetectionDataset
from detector.data.records import ImageRecord, RecordStore


@pytest.fixture
def halves(tiny_cfg, tmp_path):
    """The tiny shapes training set as two COCO files of half its images each:
    ``(full data set, image folder, a.json, b.json, overrides for a COCO config)``."""
    full = build_dataset(tiny_cfg(), "train", is_train=True)
    folder = Path(full.records.path(0)).parent
    coco = json.loads((folder.parent / "train.json").read_text())
    half = len(coco["images"]) // 2
    files = []
    for name, images in (("a", coco["images"][:half]), ("b", coco["images"][half:])):
        ids = {im["id"] for im in images}
        part = {**coco, "images": images, "annotations": [a for a in coco["annotations"] if a["image_id"] in ids]}
        files.append(tmp_path / f"{name}.json")
        files[-1].write_text(json.dumps(part))
    overrides = ["data.format=coco", f"data.train.root={folder}", f"data.train.ann_file={files[0]}",
                 "data.filter_empty=false"]
    return full, folder, files[0], files[1], overrides


def _extra(folder: Path, ann_file: Path) -> str:
    return f"data.train_extra=[{{root: '{folder}', ann_file: '{ann_file}'}}]"


def test_record_stores_concatenate_to_the_whole():
    rng = np.random.default_rng(0)
    counts = [2, 0, 3, 1]
    arrays = {
        "boxes": rng.random((6, 4)).astype(np.float32), "labels": rng.integers(1, 4, 6), "iscrowd": np.zeros(6, bool),
        "difficult": np.zeros(6, bool), "ann_ids": np.arange(6), "areas": rng.random(6).astype(np.float32),
        "image_ids": np.array([5, 6, 7, 8]), "widths": np.array([10, 20, 30, 40]), "heights": np.array([1, 2, 3, 4]),
        "box_start": np.concatenate([[0], np.cumsum(counts)]), "path_start": np.array([0, 3, 5, 9, 10]),
        "path_bytes": np.frombuffer("abcdeéfgh".encode(), np.uint8).copy(),
    }
    whole = RecordStore(arrays)
    joined = RecordStore.concatenate([whole.subset([0, 1]), whole.subset([2, 3])], [0, 100])
    for name, array in whole.arrays.items():
        expect = array + np.array([0, 0, 100, 100]) if name == "image_ids" else array
        assert np.array_equal(joined.arrays[name], expect), name
    assert [joined.path(i) for i in range(4)] == [whole.path(i) for i in range(4)]
    with pytest.raises(ValueError, match="one id offset per store"):
        RecordStore.concatenate([whole], [0, 1])


def test_two_coco_files_train_as_the_set_they_were_cut_from(halves, tiny_cfg):
    full, folder, a, b, overrides = halves
    joined = build_dataset(tiny_cfg(*overrides, _extra(folder, b)), "train", is_train=True)
    alone = build_dataset(tiny_cfg(*overrides), "train", is_train=True)
    assert len(alone) < len(joined) == len(full)
    assert joined.class_names == full.class_names and joined.source.count(" + ") == 1
    for name in ("boxes", "labels", "image_ids", "path_bytes", "box_start"):
        assert np.array_equal(joined.records.arrays[name], full.records.arrays[name]), name
    image, target = joined[len(joined) - 1]  # an image of the second file, through the transforms
    assert image.dtype == torch.uint8 and target["image_id"] == full.image_ids[-1]
    assert target["boxes"].shape[0] == len(full.get_annotation(len(full) - 1)["boxes"])


def test_overlapping_image_ids_are_shifted_apart(halves, tiny_cfg, caplog):
    full, folder, a, b, overrides = halves
    coco = json.loads(b.read_text())
    new = {im["id"]: i for i, im in enumerate(coco["images"], start=1)}  # 1, 2, ...: a's ids too
    coco["images"] = [{**im, "id": new[im["id"]]} for im in coco["images"]]
    coco["annotations"] = [{**ann, "image_id": new[ann["image_id"]]} for ann in coco["annotations"]]
    b.write_text(json.dumps(coco))
    with caplog.at_level(logging.INFO, logger="detector.data.concat"):
        joined = build_dataset(tiny_cfg(*overrides, _extra(folder, b)), "train", is_train=True)
    ids = joined.image_ids
    assert len(set(ids)) == len(ids) == len(full)
    assert "data.train_extra[0]" in caplog.text and "shifted by" in caplog.text
    half = len(full) // 2
    assert (f"training sets joined: data.train {half} images, data.train_extra[0] {len(full) - half} images: "
            f"{len(full)} images, {full.records.num_boxes} boxes") in caplog.text
    assert np.array_equal(joined.records.arrays["boxes"], full.records.arrays["boxes"])


def test_sets_of_other_classes_are_refused_until_class_names_pick_them(halves, tiny_cfg):
    full, folder, a, b, overrides = halves
    coco = json.loads(b.read_text())
    coco["categories"] = coco["categories"][::-1]  # the same names, numbered otherwise: labels would swap
    for i, cat in enumerate(sorted(coco["categories"], key=lambda c: c["name"], reverse=True)):
        cat["id"] = i + 1
    b.write_text(json.dumps(coco))
    with pytest.raises(DataError) as err:
        build_dataset(tiny_cfg(*overrides, _extra(folder, b)), "train", is_train=True)
    message = str(err.value)
    assert "\n" not in message and "data.train_extra[0]" in message and "data.train " in message
    assert "label 1 is" in message and "data.class_names" in message
    names = "[" + ", ".join(full.class_names) + "]"
    joined = build_dataset(tiny_cfg(*overrides, _extra(folder, b), f"data.class_names={names}"), "train", True)
    assert joined.class_names == full.class_names and len(joined) == len(full)
    by_name = {c["id"]: c["name"] for c in coco["categories"]}
    i = len(joined) - 1
    ann = [x for x in coco["annotations"] if x["image_id"] == joined.image_ids[i]]
    assert [joined.class_names[lab - 1] for lab in joined.get_annotation(i)["labels"].tolist()] == \
        [by_name[x["category_id"]] for x in ann]  # each box keeps its class by name


def test_a_set_listed_twice_is_refused(halves, tiny_cfg, tmp_path):
    full, folder, a, b, overrides = halves
    (tmp_path / "whole.json").write_text((folder.parent / "train.json").read_text())
    with pytest.raises(DataError) as err:
        build_dataset(tiny_cfg(*overrides, _extra(folder, a)), "train", is_train=True)
    message = str(err.value)
    assert "\n" not in message and "is in data.train and in data.train_extra[0]" in message and str(folder) in message
    os.symlink(folder, tmp_path / "linked")  # the same images under a second folder name
    with pytest.raises(DataError, match=r"is in data\.train and in data\.train_extra\[0\]"):
        build_dataset(tiny_cfg(*overrides, _extra(tmp_path / "linked", b.parent / "whole.json")), "train", True)
    # check_dataset finds what training refuses, in the report of the set named second
    reports = check_datasets(tiny_cfg(*overrides, f"data.train_extra=[{{root: '{folder}', ann_file: '{b}'}}, "
                                                  f"{{root: '{tmp_path / 'linked'}', ann_file: '{b}'}}]"),
                             "train", decode=False)
    assert [len(r.errors) for r in reports] == [0, 0, 1]
    assert "is in data.train_extra[0] and in data.train_extra[1]" in reports[2].errors[0]
    assert all(not r.errors for r in check_datasets(tiny_cfg(*overrides, _extra(folder, b)), "train", decode=False))


def test_a_missing_extra_set_is_named_by_its_key(halves, tiny_cfg):
    full, folder, a, b, overrides = halves
    with pytest.raises(DataError, match=r"^data\.train_extra\[0\]\.ann_file: annotation file .*nope\.json not found$"):
        build_dataset(tiny_cfg(*overrides, _extra(folder, folder / "nope.json")), "train", is_train=True)
    with pytest.raises(DataError, match=r"^data\.train_extra\[0\]\.root is empty"):
        build_dataset(tiny_cfg(*overrides, "data.train_extra=[{ann_file: x.json}]"), "train", is_train=True)


def test_train_tool_trains_on_two_sets_and_check_dataset_reports_each(halves, tiny_cfg, tmp_path, capsys):
    full, folder, a, b, overrides = halves
    cfg = tiny_cfg()
    val = [f"data.val.root={folder.parent / 'val'}", f"data.val.ann_file={folder.parent / 'val.json'}"]
    args = ["--config", str(Path(__file__).parent / "configs" / "tiny.yaml"), *overrides, *val, _extra(folder, b),
            f"train.output_dir={tmp_path / 'run'}", "solver.max_iter=2", "solver.warmup_iters=1", "solver.steps=[1]",
            f"data.shapes.num_train={cfg.data.shapes.num_train}"]
    assert load_tool("train").main(args) == 0
    saved = (tmp_path / "run" / "config.yaml").read_text()
    assert str(b) in saved and "train_extra" in saved
    capsys.readouterr()
    check = [x for x in args if not x.startswith(("train.", "solver."))]
    assert load_tool("check_dataset").main([*check, "--split", "train", "--no-decode"]) == 0
    out = capsys.readouterr().out
    assert f"data set: data.train: COCO {a}" in out and f"data set: data.train_extra[0]: COCO {b}" in out, out
    counts = [int(line.split()[1]) for line in out.splitlines() if line.startswith("images:")]
    assert sum(counts) == len(full) and len(counts) == 2 and out.count("OK: no errors found") == 2, out
    coco = json.loads(b.read_text())
    coco["categories"][0]["name"] = "kite"  # training refuses it: so does the check
    b.write_text(json.dumps(coco))
    assert load_tool("check_dataset").main([*check, "--split", "train", "--no-decode"]) == 1
    out = capsys.readouterr().out
    assert "data.train_extra[0]: its classes" in out and "kite" in out, out


@pytest.mark.realdata
def test_voc_sets_of_one_year_folder_join(real_data, tiny_cfg, tmp_path):
    """Two split files of the real VOC 2012 folder (disjoint halves of its 100 images)
    join into the 100; the same split twice is refused."""
    year = real_data / "voc2012_100" / "VOCdevkit" / "VOC2012"
    ids = (year / "ImageSets" / "Main" / "all.txt").read_text().split()
    root = tmp_path / "VOC2012"
    (root / "ImageSets" / "Main").mkdir(parents=True)
    for name in ("Annotations", "JPEGImages"):
        os.symlink(year / name, root / name)
    (root / "ImageSets" / "Main" / "a.txt").write_text("\n".join(ids[:50]) + "\n")
    (root / "ImageSets" / "Main" / "b.txt").write_text("\n".join(ids[50:]) + "\n")
    (root / "ImageSets" / "Main" / "all.txt").write_text("\n".join(ids) + "\n")
    voc = ["data.format=voc", f"data.train.root={root}", "data.filter_empty=false", "data.class_names=[]"]
    whole = build_dataset(tiny_cfg(*voc, "data.train.split=all"), "train", is_train=True)
    joined = build_dataset(tiny_cfg(*voc, "data.train.split=a", f"data.train_extra=[{{root: '{root}', split: b}}]"),
                           "train", is_train=True)
    assert len(joined) == len(whole) == 100
    for name in ("boxes", "labels", "difficult"):
        assert np.array_equal(joined.records.arrays[name], whole.records.arrays[name]), name
    with pytest.raises(DataError, match=r"is in data\.train and in data\.train_extra\[0\]"):
        build_dataset(tiny_cfg(*voc, "data.train.split=a", f"data.train_extra=[{{root: '{root}', split: a}}]"),
                      "train", is_train=True)
    # A class subset needs objects in the joined set, not in each: a class only in b's images.
    labels = [set(whole.get_annotation(i)["labels"].tolist()) for i in range(len(whole))]
    only = next(lab for lab in range(1, 21) if 0 < sum(lab in x for x in labels) < len(labels))
    name = whole.class_names[only - 1]
    with_it = [ids[i] for i in range(100) if only in labels[i]]
    (root / "ImageSets" / "Main" / "a.txt").write_text("\n".join(i for i in ids if i not in with_it) + "\n")
    (root / "ImageSets" / "Main" / "b.txt").write_text("\n".join(with_it) + "\n")
    subset = [*voc[:-1], f"data.class_names=[{name}]", "data.train.split=a"]
    with pytest.raises(DataError, match=f"data.class_names: '{name}' has no object in {root} \\(a\\)"):
        build_dataset(tiny_cfg(*subset), "train", is_train=True)  # one set: refused, as before
    joined = build_dataset(tiny_cfg(*subset, f"data.train_extra=[{{root: '{root}', split: b}}]"), "train", True)
    alone = build_dataset(tiny_cfg(*subset[:-1], "data.train.split=all"), "train", is_train=True)
    assert len(joined) == len(alone) == 100 and joined.num_training_boxes() == alone.num_training_boxes() > 0


def test_the_joined_set_must_hold_every_listed_voc_class(tmp_path):
    """``check_every_class`` on a joined set without one class: one line naming the keys."""
    boxes = np.array([[0, 0, 4, 4]], np.float32)
    record = ImageRecord(1, str(tmp_path / "a.jpg"), 8, 8, boxes, np.array([1]), np.zeros(1, bool),
                         np.zeros(1, bool), np.array([1]), np.array([16], np.float32))
    dataset = DetectionDataset([record], ["cat", "dog"], {1: 1, 2: 2})
    with pytest.raises(DataError, match=r"^data\.class_names: 'dog' has no object in the training sets "
                                        r"\(data\.train, data\.train_extra\[0\]\)$"):
        check_every_class(dataset, ["data.train", "data.train_extra[0]"])


def test_shapes_data_takes_no_extra_sets(tmp_path):
    with pytest.raises(ConfigError, match=r"^config key 'data\.train_extra' joins coco or voc training sets"):
        load_config(Path(__file__).parent / "configs" / "tiny.yaml",
                    ["data.format=shapes", f"data.train_extra=[{{root: '{tmp_path}'}}]"])
