"""Real data (../shared/data/real): tools/eval.py file mode against pycocotools and the
numbers published in that folder's README; VOC AP from VOC XML."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import numpy as np
import pytest

from detector.evaluation import COCO_METRIC_NAMES
from cases import pycocotools_stats
from conftest import load_tool

pytestmark = pytest.mark.realdata

# From ../shared/data/real/README.md (pycocotools 2.0.11 on coco_eval_val2014_100).
README_NUMBERS = [
    0.5045806987, 0.6969727247, 0.5729816670, 0.5856257209, 0.5193996948, 0.5013978986,
    0.3868127796, 0.5936795763, 0.5953529829, 0.6398109626, 0.5664205979, 0.5642905983,
]  # fmt: skip


def eval_main(argv):
    return load_tool("eval").main(argv)



def printed_numbers(text):
    values = {}
    for line in text.splitlines():
        parts = line.split()
        if parts and parts[0] in COCO_METRIC_NAMES and len(parts) > 2:
            values[parts[0]] = parts[-1]
    return [values[k] for k in COCO_METRIC_NAMES]


@pytest.mark.parametrize("backend", ["pycocotools", "faster"])
def test_coco_val2014_100_readme_numbers(real_data, tmp_path, capsys, backend):
    folder = real_data / "coco_eval_val2014_100"
    gt_file = folder / "instances_val2014_100.json"
    dt_file = folder / "instances_val2014_fakebbox100_results.json"
    rc = eval_main(["--predictions", str(dt_file), "--annotations", str(gt_file), "--output-dir", str(tmp_path),
                    f"eval.backend={backend}"])
    assert rc == 0
    printed = printed_numbers(capsys.readouterr().out)
    assert printed == [f"{v:.10f}" for v in README_NUMBERS]
    ref = pycocotools_stats(json.loads(gt_file.read_text()), json.loads(dt_file.read_text()))
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    np.testing.assert_allclose([metrics[k] for k in COCO_METRIC_NAMES], ref, rtol=0, atol=1e-9)


def _remap_to(gt, det_dict):
    """Detections of voc2012_100/coco/detections.json (own ids) onto ``gt``'s ids by
    file name and class name -- written independently of detector.evaluation."""
    file_to_gt = {Path(i["file_name"]).name: i["id"] for i in gt["images"]}
    name_to_gt = {c["name"]: c["id"] for c in gt["categories"]}
    img = {i["id"]: file_to_gt[Path(i["file_name"]).name] for i in det_dict["images"]}
    cat = {c["id"]: name_to_gt[c["name"]] for c in det_dict["categories"]}
    return [
        {"image_id": img[a["image_id"]], "category_id": cat[a["category_id"]], "bbox": a["bbox"], "score": a["score"]}
        for a in det_dict["annotations"]
    ]


def test_voc2012_100_from_xml(real_data, tmp_path, capsys):
    from detector.data import VOCDetection

    folder = real_data / "voc2012_100"
    voc_root = folder / "VOCdevkit" / "VOC2012"
    det_file = folder / "coco" / "detections.json"
    rc = eval_main(["--predictions", str(det_file), "--voc-root", str(voc_root), "--voc-split", "all",
                    "--output-dir", str(tmp_path)])
    assert rc == 0
    out = capsys.readouterr().out
    with (tmp_path / "per_class.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 20
    assert sum(int(r["num_gt"]) for r in rows) == 273 - 38  # difficult objects are not positives
    for r in rows:
        for key in ("AP_voc07", "AP_voc_area"):
            assert 0.0 <= float(r[key]) <= 1.0, r
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert 0.3 < metrics["mAP_voc_area"] < 0.9 and not math.isnan(metrics["mAP_voc07"])
    # COCO numbers of that run equal pycocotools on the same (XML-derived) ground truth.
    gt = VOCDetection(voc_root, "all").coco_gt()
    ref = pycocotools_stats(gt, _remap_to(gt, json.loads(det_file.read_text())))
    np.testing.assert_allclose([metrics[k] for k in COCO_METRIC_NAMES], ref, rtol=0, atol=1e-9)
    assert printed_numbers(out) == [f"{v:.10f}" for v in ref]


def test_voc2012_100_coco_copy(real_data, tmp_path, capsys):
    folder = real_data / "voc2012_100" / "coco"
    gt = json.loads((folder / "instances.json").read_text())
    det_dict = json.loads((folder / "detections.json").read_text())
    rc = eval_main(["--predictions", str(folder / "detections.json"), "--annotations", str(folder / "instances.json"),
                    "--output-dir", str(tmp_path)])
    assert rc == 0
    capsys.readouterr()
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    ref = pycocotools_stats(gt, _remap_to(gt, det_dict))
    np.testing.assert_allclose([metrics[k] for k in COCO_METRIC_NAMES], ref, rtol=0, atol=1e-9)
    assert ref[0] > 0.2
