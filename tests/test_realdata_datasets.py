"""Real VOC and COCO data (../shared/data/real, see its README): counts, id maps, crowd,
and the checker's verdict on the clean sets and on a damaged copy."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import yaml
from pycocotools.coco import COCO

from detector.data import CocoDetection, VOCDetection
from detector.data.check import check_dataset
from conftest import load_tool

main = load_tool("check_dataset").main

pytestmark = pytest.mark.realdata


def _voc_root(real_data):
    return real_data / "voc2012_100" / "VOCdevkit" / "VOC2012"


def test_voc2012_100(real_data):
    ds = VOCDetection(_voc_root(real_data), "all")
    assert len(ds) == 100
    n_obj = n_difficult = 0
    for i in range(len(ds)):
        ann = ds.get_annotation(i)
        n_obj += len(ann["labels"])
        n_difficult += int(ann["difficult"].sum())
        b = ann["boxes"]
        assert (b[:, 0] >= 0).all() and (b[:, 1] >= 0).all()
        assert (b[:, 2] <= ann["width"]).all() and (b[:, 3] <= ann["height"]).all()
        assert (b[:, 2] > b[:, 0]).all() and (b[:, 3] > b[:, 1]).all()
    assert (n_obj, n_difficult) == (273, 38)
    assert sum(ds.skipped.values()) == 0
    # The first image: 2007_000027, person at VOC [174, 101, 349, 351] -> [173, 100, 349, 351].
    assert ds.image_ids[0] == 2007000027
    torch.testing.assert_close(ds.get_annotation(0)["boxes"], torch.tensor([[173.0, 100.0, 349.0, 351.0]]))
    image, target = ds[0]
    assert image.shape == (3, 500, 486) and target["labels"].tolist() == [ds.class_names.index("person") + 1]


def test_voc_coco_gt_matches_the_shipped_coco_conversion_in_size(real_data):
    ds = VOCDetection(_voc_root(real_data), "all")
    gt = ds.coco_gt()
    shipped = json.loads((real_data / "voc2012_100" / "coco" / "instances.json").read_text())
    assert len(gt["images"]) == len(shipped["images"]) == 100
    assert len(gt["annotations"]) == len(shipped["annotations"]) == 273
    # The shipped file writes VOC boxes without the 1-based shift; widths differ by exactly 1.
    ours = sorted(a["bbox"][2] for a in gt["annotations"])
    theirs = sorted(a["bbox"][2] for a in shipped["annotations"])
    assert ours == pytest.approx([w + 1 for w in theirs])


def test_coco2017_16(real_data):
    root = real_data / "coco2017_16"
    ds = CocoDetection(root / "images", root / "instances.json")
    assert len(ds) == 16
    raw = json.loads((root / "instances.json").read_text())
    cat_ids = sorted(c["id"] for c in raw["categories"])
    assert len(cat_ids) == 80 and cat_ids[-1] == 90
    assert list(ds.label_to_category_id) == list(range(1, 81))
    assert sorted(ds.label_to_category_id.values()) == cat_ids
    assert all(ds.category_id_to_label[c] == lab for lab, c in ds.label_to_category_id.items())
    # The crowd annotation: in get_annotation / coco_gt, not in the target.
    crowd = [a for a in raw["annotations"] if a["iscrowd"]]
    assert len(crowd) == 1
    idx = ds.image_ids.index(crowd[0]["image_id"])
    ann = ds.get_annotation(idx)
    assert int(ann["iscrowd"].sum()) == 1
    n_image_anns = sum(1 for a in raw["annotations"] if a["image_id"] == crowd[0]["image_id"])
    image, target = ds[idx]
    assert len(target["labels"]) == n_image_anns - 1
    assert image.shape[1:] == (ann["height"], ann["width"])
    gt = COCO()
    gt.dataset = ds.coco_gt()
    gt.createIndex()
    assert len(gt.getAnnIds(iscrowd=True)) == 1 and len(gt.getAnnIds()) == 197
    assert sorted(gt.getCatIds()) == cat_ids


def _write_cfg(path, data):
    path.write_text(yaml.safe_dump({"data": data}))
    return str(path)


def test_checker_clean_sets(real_data, tmp_path):
    voc = _write_cfg(tmp_path / "voc.yaml", {"format": "voc", "train": {"root": str(_voc_root(real_data)), "split": "all"}})
    coco = _write_cfg(tmp_path / "coco.yaml", {"format": "coco", "train": {
        "root": str(real_data / "coco2017_16" / "images"), "ann_file": str(real_data / "coco2017_16" / "instances.json")}})
    assert main(["--config", voc]) == 0
    assert main(["--config", coco]) == 0


def test_checker_damaged_copy(real_data, tmp_path):
    src = real_data / "coco2017_16"
    dst = tmp_path / "coco2017_16"
    shutil.copytree(src, dst)
    data = json.loads((dst / "instances.json").read_text())
    img = data["images"][0]
    raw = (dst / "images" / img["file_name"]).read_bytes()
    (dst / "images" / img["file_name"]).write_bytes(raw[: len(raw) // 2])  # corrupted (truncated) JPEG
    ann = next(a for a in data["annotations"] if not a["iscrowd"])
    im = next(i for i in data["images"] if i["id"] == ann["image_id"])
    ann["bbox"][0] = im["width"] - ann["bbox"][2] / 2  # half the box past the right edge
    (dst / "instances.json").write_text(json.dumps(data))
    cfg = _write_cfg(tmp_path / "bad.yaml", {"format": "coco", "train": {
        "root": str(dst / "images"), "ann_file": str(dst / "instances.json")}})
    assert main(["--config", cfg]) == 1
    from detector.config import load_config

    report = check_dataset(load_config(cfg))
    assert report.unreadable_files == [str(dst / "images" / img["file_name"])]
    assert report.past_edge_boxes == 1
    assert any(f"annotation id {ann['id']}" in e and "past the edge" in e for e in report.errors)
