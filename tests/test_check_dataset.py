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
