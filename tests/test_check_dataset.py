"""tools/check_dataset.py: clean sets pass, each kind of fault is reported, exit status."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image

from detector.config import load_config
from detector.data.check import check_dataset, format_report
from conftest import load_tool

main = load_tool("check_dataset").main


def _coco_set(tmp: Path) -> tuple[Path, Path]:
    img_dir = tmp / "images"
    img_dir.mkdir(parents=True)
    rng = np.random.default_rng(0)
    images = []
    for i, (w, h) in enumerate([(64, 48), (48, 64), (50, 50)], start=1):
        Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(img_dir / f"{i}.jpg")
        images.append({"id": i, "file_name": f"{i}.jpg", "width": w, "height": h})
    anns = [
        {"id": 1, "image_id": 1, "category_id": 3, "bbox": [1, 2, 10, 10], "iscrowd": 0},
        {"id": 2, "image_id": 1, "category_id": 5, "bbox": [20, 2, 10, 30], "iscrowd": 0},
        {"id": 3, "image_id": 2, "category_id": 5, "bbox": [0, 0, 48, 64], "iscrowd": 1},
    ]
    ann_file = tmp / "ann.json"
    ann_file.write_text(json.dumps({"images": images, "annotations": anns,
                                    "categories": [{"id": 3, "name": "cat"}, {"id": 5, "name": "dog"}]}))
    return img_dir, ann_file


def _cfg(img_dir, ann_file):
    return load_config(None, ["data.format=coco", f"data.train.root={img_dir}", f"data.train.ann_file={ann_file}"])


def test_clean_set(tmp_path):
    report = check_dataset(_cfg(*_coco_set(tmp_path)))
    assert report.ok, report.errors
    assert report.num_images == 3 and report.num_boxes == 3 and report.num_crowd == 1
    assert report.per_class == {"cat": 1, "dog": 2}
    assert report.images_without_annotations == 1
    assert report.aspect_hist["[0.75, 1)"] == 1 and report.aspect_hist["[1.333, 2)"] == 1
    assert sum(report.size_hist.values()) == 3
    text = format_report(report)
    assert "OK: no errors found" in text and "dog" in text


def test_every_fault_is_reported(tmp_path):
    img_dir, ann_file = _coco_set(tmp_path)
    data = json.loads(ann_file.read_text())
    data["images"].append({"id": 2, "file_name": "dup.jpg", "width": 10, "height": 10})  # duplicate id
    data["images"].append({"id": 4, "file_name": "missing.jpg", "width": 10, "height": 10})
    data["annotations"] += [
        {"id": 10, "image_id": 1, "category_id": 3, "bbox": [60, 2, 10, 10], "iscrowd": 0},  # past the edge
        {"id": 11, "image_id": 1, "category_id": 3, "bbox": [70, 2, 10, 10], "iscrowd": 0},  # outside
        {"id": 12, "image_id": 1, "category_id": 3, "bbox": [5, 5, 0, 10], "iscrowd": 0},  # degenerate
        {"id": 13, "image_id": 1, "category_id": 4, "bbox": [5, 5, 5, 5], "iscrowd": 0},  # unknown category
    ]
    ann_file.write_text(json.dumps(data))
    raw = (img_dir / "3.jpg").read_bytes()
    (img_dir / "3.jpg").write_bytes(raw[: len(raw) // 3])  # truncated JPEG
    report = check_dataset(_cfg(img_dir, ann_file))
    assert not report.ok
    assert report.past_edge_boxes == 1 and report.outside_boxes == 1 and report.degenerate_boxes == 1
    assert report.missing_files == [str(img_dir / "missing.jpg")]
    assert report.unreadable_files == [str(img_dir / "3.jpg")]
    text = "\n".join(report.errors)
    assert "image_id 2 appears twice" in text
    assert "annotation id 13: category_id 4 is not in 'categories'" in text
    assert "annotation id 10 (image_id 1): box [60, 2, 70, 12] extends 6 px past the edge" in text
    assert "annotation id 11" in text and "annotation id 12" in text
    assert "ERRORS: 7" in format_report(report)


def test_invalid_json_is_an_error_not_a_crash(tmp_path):
    img_dir, ann_file = _coco_set(tmp_path)
    ann_file.write_text("{oops")
    report = check_dataset(_cfg(img_dir, ann_file))
    assert not report.ok and "is not valid JSON" in report.errors[0]


def test_tool_exit_status(tmp_path):
    img_dir, ann_file = _coco_set(tmp_path)
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"data": {"format": "coco", "train": {"root": str(img_dir), "ann_file": str(ann_file)}}}))
    assert main(["--config", str(config)]) == 0
    (img_dir / "1.jpg").unlink()
    assert main(["--config", str(config), "--no-decode"]) == 1


@pytest.mark.slow  # a fresh interpreter importing torch and albumentations: ~3-8 s
def test_tool_script_subprocess(tmp_path, repo_root):
    img_dir, ann_file = _coco_set(tmp_path)
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"data": {"format": "coco", "train": {"root": str(img_dir), "ann_file": str(ann_file)}}}))
    (img_dir / "1.jpg").unlink()
    proc = subprocess.run([sys.executable, str(repo_root / "tools" / "check_dataset.py"), "--config", str(config)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert "1.jpg (image_id 1) not found" in proc.stdout


def _val_file(tmp: Path, categories: list) -> Path:
    """A val file of the same images as ``_coco_set``'s, with ``categories`` [(id, name)]
    and one box of each category on image 1."""
    anns = [{"id": i, "image_id": 1, "category_id": cid, "bbox": [2 + 12 * i, 2, 10, 10], "iscrowd": 0}
            for i, (cid, _) in enumerate(categories, start=1)]
    val = tmp / "val.json"
    val.write_text(json.dumps({"images": [{"id": 1, "file_name": "1.jpg", "width": 64, "height": 48}],
                               "annotations": anns,
                               "categories": [{"id": cid, "name": name} for cid, name in categories]}))
    return val


def _val_cfg(img_dir, train_file, val_file):
    return load_config(None, ["data.format=coco", f"data.train.root={img_dir}", f"data.train.ann_file={train_file}",
                              f"data.val.root={img_dir}", f"data.val.ann_file={val_file}"])


def test_val_split_is_read_by_the_training_classes(tmp_path):
    """--split val reads the val file as training does, by the training set's class names:
    other ids are fine, a category the training set lacks is dropped (as in training),
    not counted as a class of its own."""
    img_dir, train_file = _coco_set(tmp_path)
    val_file = _val_file(tmp_path, [(1, "dog"), (2, "bird"), (7, "cat")])
    report = check_dataset(_val_cfg(img_dir, train_file, val_file), "val")
    assert report.ok, report.errors
    assert report.per_class == {"cat": 1, "dog": 1}
    assert report.other_classes == {"bird": 1}
    assert (f"classes: the training set's ({train_file}), by name (as training pins them in data.class_names)"
            in format_report(report))


def test_val_split_without_a_training_class_is_an_error(tmp_path):
    """What training refuses before its first step (``check_val_classes``), the checker
    reports: here the val file names a training class otherwise."""
    img_dir, train_file = _coco_set(tmp_path)
    val_file = _val_file(tmp_path, [(3, "cat"), (5, "dogs")])
    report = check_dataset(_val_cfg(img_dir, train_file, val_file), "val")
    assert not report.ok
    assert report.errors[0].startswith(f"data.val.ann_file {val_file} has no category named 'dog' (did you mean "
                                       "'dogs'?), a class of the training set")
    assert report.per_class == {"cat": 1, "dogs": 1}  # read by its own categories
    assert "it fails training's class check" in format_report(report)


def test_val_split_with_an_unreadable_training_set_is_checked_alone(tmp_path):
    img_dir, train_file = _coco_set(tmp_path)
    val_file = _val_file(tmp_path, [(3, "cat"), (5, "dog")])
    train_file.write_text("{oops")
    report = check_dataset(_val_cfg(img_dir, train_file, val_file), "val")
    assert report.ok, report.errors
    assert report.per_class == {"cat": 1, "dog": 1}
    text = format_report(report)
    assert "classes: this file's own categories (the training set could not be read" in text
    assert "is not valid JSON" in text


def test_an_empty_path_names_its_key(tmp_path):
    img_dir, train_file = _coco_set(tmp_path)
    cfg = load_config(None, ["data.format=coco", f"data.train.root={img_dir}", f"data.train.ann_file={train_file}",
                             f"data.val.root={img_dir}", "data.val.ann_file="])
    report = check_dataset(cfg, "val")  # it was "annotation file not found: " (an empty path, no key)
    assert report.errors == ["data.val.ann_file is empty: set it to the COCO instances JSON"]
