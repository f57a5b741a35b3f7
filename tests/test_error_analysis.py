"""Error analysis (detector/evaluation/analysis.py, tools/eval.py --analysis): a hand-made
case where each error type appears a known number of times, and the real COCO results file."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from detector.evaluation.analysis import analyse_errors, run_analysis

ROOT = Path(__file__).resolve().parents[1]
REAL = ROOT.parent / "shared" / "data" / "real"
CAT, DOG = 1, 2


def ann(i, image_id, cat, xyxy, crowd=0):
    x1, y1, x2, y2 = xyxy
    return {"id": i, "image_id": image_id, "category_id": cat, "bbox": [x1, y1, x2 - x1, y2 - y1],
            "area": (x2 - x1) * (y2 - y1), "iscrowd": crowd}


def det(image_id, cat, xyxy, score):
    x1, y1, x2, y2 = xyxy
    return {"image_id": image_id, "category_id": cat, "bbox": [x1, y1, x2 - x1, y2 - y1], "score": score}


def hand_made():
    """Image 1: a true positive, a duplicate, a classification, a localisation and a
    background error (and one detection under the score threshold). Image 2: a true
    positive, a detection on a crowd box (ignored), a 'both' error and a missed cat.
    Image 3: a missed cat. Image 4: nothing."""
    gt = {
        "images": [{"id": i, "file_name": f"{i}.jpg", "height": 700, "width": 700} for i in (1, 2, 3, 4)],
        "categories": [{"id": CAT, "name": "cat"}, {"id": DOG, "name": "dog"}],
        "annotations": [
            ann(1, 1, CAT, (0, 0, 100, 100)), ann(2, 1, DOG, (200, 200, 300, 300)), ann(3, 1, CAT, (400, 0, 500, 100)),
            ann(4, 2, DOG, (0, 0, 100, 100)), ann(5, 2, CAT, (0, 200, 100, 300)),
            ann(6, 2, DOG, (300, 300, 400, 400), crowd=1),
            ann(7, 3, CAT, (10, 10, 50, 50)),
        ],
    }
    dets = [
        det(1, CAT, (0, 0, 100, 100), 0.9),      # tp
        det(1, CAT, (2, 2, 100, 100), 0.8),      # duplicate of the cat above
        det(1, CAT, (200, 200, 300, 300), 0.7),  # classification: on the dog
        det(1, CAT, (400, 0, 500, 40), 0.7),     # localisation: IoU 0.4 with the cat
        det(1, CAT, (600, 600, 650, 650), 0.6),  # background
        det(1, DOG, (600, 0, 650, 50), 0.3),     # under the score threshold: not counted
        det(2, DOG, (0, 0, 100, 100), 0.95),     # tp
        det(2, DOG, (300, 300, 400, 400), 0.9),  # on the crowd box: ignored
        det(2, CAT, (0, 0, 100, 30), 0.8),       # both: IoU 0.3 with the dog only
    ]
    return gt, dets


def test_each_error_type_counted_as_built():
    gt, dets = hand_made()
    a = analyse_errors(gt, dets, score_thresh=0.5)
    assert a.counts == {"tp": 2, "classification": 1, "localisation": 1, "both": 1, "duplicate": 1,
                        "background": 1, "missed": 2}
    assert a.per_class[CAT] == {"tp": 1, "classification": 1, "localisation": 1, "both": 1, "duplicate": 1,
                                "background": 1, "missed": 2}
    assert a.per_class[DOG] == {"tp": 1, "classification": 0, "localisation": 0, "both": 0, "duplicate": 0,
                                "background": 0, "missed": 0}
    assert a.images[2].dt_kind == ["tp", "ignored", "both"]
    assert a.images[2].missed == [1]  # the cat of image 2 (index 1 of its ground truth)
    assert a.worst_images(10) == [1, 2, 3]  # 4, 2 and 1 errors; image 4 has none
    # A lower threshold brings in the dog at 0.3: one more background error.
    assert analyse_errors(gt, dets, score_thresh=0.2).counts["background"] == 2
    # With the localisation box closer (IoU 0.6) it is a true positive and nothing is missed in image 1.
    dets[3] = det(1, CAT, (400, 0, 500, 60), 0.7)
    b = analyse_errors(gt, dets, score_thresh=0.5)
    assert (b.counts["tp"], b.counts["localisation"], b.counts["missed"]) == (3, 0, 2)


def test_unexplained_miss_and_bad_thresholds():
    gt, dets = hand_made()
    dets = [d for d in dets if d["category_id"] == DOG]  # no cat detections: the cats are plain misses
    a = analyse_errors(gt, dets, score_thresh=0.5)
    assert a.counts["missed"] == 5  # cats 1, 3, 5, 7 and the dog of image 1
    with pytest.raises(ValueError, match="bg_iou <= fg_iou"):
        analyse_errors(gt, dets, fg_iou=0.3, bg_iou=0.5)


def test_outputs_written(tmp_path):
    gt, dets = hand_made()
    run_analysis(gt, dets, tmp_path, score_thresh=0.5, num_images=2)
    summary = json.loads((tmp_path / "analysis.json").read_text())
    assert summary["counts"]["duplicate"] == 1 and summary["worst_images"][0] == {"image_id": 1, "errors": 4}
    rows = list(csv.DictReader((tmp_path / "analysis.csv").open()))
    assert rows[0]["name"] == "all" and rows[0]["missed"] == "2" and rows[1]["name"] == "cat"
    assert Image.open(tmp_path / "analysis.png").size[0] > 100
    drawn = sorted(p.name for p in (tmp_path / "worst_images").iterdir())
    assert drawn == ["1.png", "2.png"]
    assert np.asarray(Image.open(tmp_path / "worst_images" / "1.png")).std() > 0  # boxes on the grey canvas


def test_eval_tool_analysis_flag(tmp_path):
    gt, dets = hand_made()
    (tmp_path / "gt.json").write_text(json.dumps(gt))
    (tmp_path / "dets.json").write_text(json.dumps(dets))
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "eval.py"), "--predictions", str(tmp_path / "dets.json"),
                           "--annotations", str(tmp_path / "gt.json"), "--output-dir", str(out), "--analysis"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "error analysis (score >= 0.5): 2 true positives" in proc.stdout
    assert json.loads((out / "analysis" / "analysis.json").read_text())["counts"]["both"] == 1
    bad = subprocess.run([sys.executable, str(ROOT / "tools" / "eval.py"), "--config", "c.yaml", "--weights", "w.pth",
                          "--analysis"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--analysis with --config/--weights needs --output-dir" in bad.stderr
    bad = subprocess.run([sys.executable, str(ROOT / "tools" / "eval.py"), "--predictions", "d.json", "--annotations",
                          "g.json", "--analysis", "--analysis-images", "-1"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--analysis-images must be >= 0, got -1" in bad.stderr


@pytest.mark.realdata
def test_analysis_on_the_real_coco_results_file(tmp_path):
    folder = REAL / "coco_eval_val2014_100"
    if not folder.is_dir():
        pytest.skip("../shared/data/real is absent")
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "eval.py"), "--predictions",
                           str(folder / "instances_val2014_fakebbox100_results.json"), "--annotations",
                           str(folder / "instances_val2014_100.json"), "--output-dir", str(out), "--analysis",
                           "--analysis-images", "3"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((out / "analysis" / "analysis.json").read_text())
    gt = json.loads((folder / "instances_val2014_100.json").read_text())
    free = sum(1 for a in gt["annotations"] if not a.get("iscrowd", 0))
    counts = summary["counts"]
    assert counts["tp"] > 0 and all(counts[k] >= 0 for k in counts)
    assert counts["tp"] + counts["missed"] <= free  # each object at most once as found or missed
    assert (out / "analysis" / "analysis.png").stat().st_size > 1000
    assert len(list((out / "analysis" / "worst_images").glob("*.png"))) == 3


def test_worst_images_are_drawn_on_their_own_pictures_only(tmp_path, caplog, capsys):
    """--image-dir with other pictures of the same names (another size): the boxes were
    drawn on the wrong images; a folder that does not exist fell back to grey canvases
    without a word. Now: a file of another size is not used (grey, one warning), the right
    one is, and --image-dir that is no folder is a usage error."""
    from conftest import load_tool

    gt, dets = hand_made()
    images = tmp_path / "images"
    images.mkdir()
    Image.new("RGB", (700, 700), (255, 0, 0)).save(images / "1.jpg")  # the annotated size
    Image.new("RGB", (640, 480), (0, 0, 255)).save(images / "2.jpg")  # another picture
    with caplog.at_level("WARNING"):
        run_analysis(gt, dets, tmp_path / "out", score_thresh=0.5, num_images=2, image_dir=images)
    first = np.asarray(Image.open(tmp_path / "out" / "worst_images" / "1.png"))
    second = np.asarray(Image.open(tmp_path / "out" / "worst_images" / "2.png"))
    from detector.evaluation.analysis import GREY

    assert first[350, 2, 0] > 240 and first[350, 2, 1:].max() < 15  # drawn on its (red) picture (JPEG)
    assert second[350, 2].tolist() == [GREY] * 3  # a grey canvas, not the blue picture of another size
    assert f"--image-dir {images}: 1 of the 2 worst images drawn on a grey canvas instead (first: " \
           f"{images / '2.jpg'} is 640x480, the annotation 700x700)" in caplog.text
    for bad in (tmp_path / "nope", images / "1.jpg"):
        with pytest.raises(SystemExit) as info:
            load_tool("eval").parse_args(["--predictions", "p.json", "--annotations", "a.json", "--image-dir", str(bad)])
        assert info.value.code == 2 and f"--image-dir {bad} " in capsys.readouterr().err
