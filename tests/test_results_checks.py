"""Every results record and ground-truth record is checked before scoring: a bad one is
one line naming the file, its index and the field (tools/eval.py: exit status 1, no
traceback). Also: reading a results file keeps every record, in order."""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import numpy as np
import pytest

from detector.evaluation.results import ResultsError, read_results_file
from cases import make_coco_case
from conftest import load_tool

from conftest import ROOT  # noqa: E402
BAD = 3  # index of the broken record


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    d = tmp_path_factory.mktemp("checks")
    gt, dets = make_coco_case(num_images=8)
    (d / "gt.json").write_text(json.dumps(gt))
    return d, gt, dets


RESULT_CASES = {
    "nan_score": ("score", float("nan"), r"result 3: 'score' is nan; it must be finite"),
    "inf_score": ("score", float("inf"), r"result 3: 'score' is inf; it must be finite"),
    "string_score": ("score", "0.5", r"result 3: 'score' must be a number, got \"0.5\""),
    "negative_width": ("bbox", [10, 10, -4, 5], r"result 3: 'bbox' has a negative width or height"),
    "string_box": ("bbox", ["1", "2", "3", "4"], r"result 3: 'bbox' must be 4 numbers \[x, y, w, h\]"),
    "number_box": ("bbox", 5, r"result 3: 'bbox' must be 4 numbers \[x, y, w, h\], got 5"),
    "nan_box": ("bbox", [1, float("nan"), 3, 4], r"result 3: 'bbox' has a non-finite number"),
    "unknown_image": ("image_id", 4242, r"result 3: image_id 4242 is not in the ground truth"),
    "unknown_category": ("category_id", 99, r"result 3: category_id 99 is not among the ground-truth categories"),
    "float_image_id": ("image_id", 100.5, r"result 3: 'image_id' must be an integer, got 100.5"),
    "missing_score": ("score", None, r"result 3 has no 'score'"),
    # JSON true / false beside numbers: numpy reads them as 1 / 0 (scored as such, silently).
    "bool_image_id": ("image_id", True, r"result 3: 'image_id' must be an integer, got true"),
    "bool_category": ("category_id", True, r"result 3: 'category_id' must be an integer, got true"),
    "bool_score": ("score", True, r"result 3: 'score' must be a number, got true"),
    # finite numbers whose corner or area overflow (three numpy overflow warnings, then scored)
    "overflowing_box": ("bbox", [0, 0, 1e308, 1e308], r"result 3: 'bbox' is too large to score \(its corner or area is "
                                                       r"not a finite number\): \[0, 0, 1e\+308, 1e\+308\]"),
    "bool_in_box": ("bbox", [1, False, 3, 4], r"result 3: 'bbox' must be 4 numbers \[x, y, w, h\], got \[1, false, 3, 4\]"),
}


@pytest.mark.parametrize("name", sorted(RESULT_CASES))
def test_bad_result_record_is_one_named_line(case, tmp_path, capsys, name):
    d, gt, dets = case
    field, value, message = RESULT_CASES[name]
    bad = copy.deepcopy(dets)
    if value is None:
        del bad[BAD][field]
    else:
        bad[BAD][field] = value
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(bad))  # NaN and Infinity as Python's json writes them
    assert load_tool("eval").main(["--predictions", str(path), "--annotations", str(d / "gt.json")]) == 1
    out = capsys.readouterr()
    lines = out.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.err + out.out, out.err
    assert str(path) in lines[0]
    assert pytest.importorskip("re").search(message, lines[0]), lines[0]


GT_CASES = {
    "image_without_id": (lambda gt: gt["images"][2].pop("id"), r"images\[2\] has no 'id'"),
    "nan_box": (lambda gt: gt["annotations"][1].__setitem__("bbox", [1, float("nan"), 3, 4]),
                r"annotations\[1\]\.bbox\[1\]: expected a finite number, got NaN"),
    "negative_height": (lambda gt: gt["annotations"][1].__setitem__("bbox", [1, 2, 3, -4]),
                        r"annotations\[1\]: 'bbox' has a negative width or height"),
    "string_category": (lambda gt: gt["annotations"][0].__setitem__("category_id", "cat"),
                        r"annotations\[0\]\.category_id: expected an integer, got \"cat\""),
    "duplicate_image_id": (lambda gt: gt["images"][1].__setitem__("id", gt["images"][0]["id"]),
                           r"'images' lists id 100 2 times"),
}


@pytest.mark.parametrize("name", sorted(GT_CASES))
def test_bad_ground_truth_record_is_one_named_line(case, tmp_path, capsys, name):
    d, gt, dets = case
    spoil, message = GT_CASES[name]
    bad = copy.deepcopy(gt)
    spoil(bad)
    (tmp_path / "gt.json").write_text(json.dumps(bad))
    (tmp_path / "dets.json").write_text(json.dumps(dets))
    assert load_tool("eval").main(["--predictions", str(tmp_path / "dets.json"), "--annotations", str(tmp_path / "gt.json")]) == 1
    out = capsys.readouterr()
    lines = out.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.err + out.out, out.err
    assert "gt.json" in lines[0] and pytest.importorskip("re").search(message, lines[0]), lines[0]


def test_nan_score_in_a_subprocess(case, tmp_path):
    """The tool as a user runs it: non-zero exit, one line on stderr, no traceback."""
    d, _, dets = case
    bad = copy.deepcopy(dets)
    bad[BAD]["score"] = float("nan")
    (tmp_path / "p.json").write_text(json.dumps(bad))
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "eval.py"), "--predictions", str(tmp_path / "p.json"),
                           "--annotations", str(d / "gt.json")], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr + proc.stdout
    assert proc.stderr.strip().splitlines() == [f"error: {tmp_path / 'p.json'}: result 3: 'score' is nan; it must be finite"]


def test_reading_a_results_file_keeps_every_record_and_names_the_global_index(case, tmp_path):
    _, _, dets = case
    many = [dict(r, score=float(k) / 1000) for k, r in enumerate(dets * 20)]
    many[5]["note"] = "a string with }, inside"  # an extra field is ignored
    path = tmp_path / "many.json"
    path.write_text(json.dumps(many, indent=1))
    got = read_results_file(path)
    assert len(got) == len(many)
    np.testing.assert_array_equal(got.score, [r["score"] for r in many])
    np.testing.assert_array_equal(got.bbox, [r["bbox"] for r in many])
    del many[5]["note"]
    path.write_text(json.dumps(many, indent=1))
    again = read_results_file(path)
    np.testing.assert_array_equal(again.image_id, got.image_id)
    np.testing.assert_array_equal(again.category_id, got.category_id)
    late = len(many) - 7
    many[late]["bbox"] = [1, 2, -3, 4]
    path.write_text(json.dumps(many, indent=1))
    with pytest.raises(ResultsError, match=rf"result {late}: 'bbox' has a negative width"):
        read_results_file(path)


@pytest.mark.parametrize("encoding", ["utf-8-sig", "utf-16"])
def test_results_file_with_a_byte_order_mark_or_in_utf16_reads_as_utf8(case, tmp_path, encoding):
    _, _, dets = case
    path = tmp_path / "p.json"
    path.write_text(json.dumps(dets))
    plain = read_results_file(path)
    path.write_bytes(json.dumps(dets).encode(encoding))
    other = read_results_file(path)
    np.testing.assert_array_equal(other.bbox, plain.bbox)
    np.testing.assert_array_equal(other.score, plain.score)


@pytest.mark.parametrize("backend", ["pycocotools", "faster"])
def test_large_file_path_equals_pycocotools(tmp_path, backend, monkeypatch):
    """The generator of the 2M benchmark at a tiny size, scored through the file path
    with several category groups and read pieces: the 12 numbers equal pycocotools'."""
    from cases import main as write_case
    from detector.evaluation import coco as coco_mod
    from detector.evaluation import load_ground_truth, load_predictions, score_detections
    from cases import pycocotools_stats

    write_case(["--images", "40", "--objects", "4", "--dets", "30", "--out", str(tmp_path / "c")])
    gt = load_ground_truth(tmp_path / "c_gt.json")
    monkeypatch.setattr(coco_mod, "CHUNK_DETECTIONS", 100)
    dets = load_predictions(tmp_path / "c_dets.json", gt)
    assert len(coco_mod.category_chunks(dets.category_id, list(range(1, 81)), 100)) > 5
    report = score_detections(gt, dets, backend=backend)
    got = np.array([report.metrics[k] for k in coco_mod.COCO_METRIC_NAMES])
    expected = pycocotools_stats(gt, json.loads((tmp_path / "c_dets.json").read_text()))
    if backend == "pycocotools":
        np.testing.assert_array_equal(got, expected)
    else:  # faster-coco-eval sums in another order: 3e-17 from pycocotools, 0 from itself in one pass
        np.testing.assert_allclose(got, expected, rtol=0, atol=1e-15)
        one_pass = coco_mod.coco_evaluate(gt, dets, backend="faster", chunk_detections=10**9)
        np.testing.assert_array_equal(got, [one_pass.metrics[k] for k in coco_mod.COCO_METRIC_NAMES])


def test_written_results_file_is_the_json_dumps_text(case, tmp_path):
    """write_results_file formats the records itself: the text json.dumps gives (in
    pieces), read back to the same records; a non-finite score is refused."""
    from detector.evaluation.results import detections_from_records, write_results_file

    _, _, dets = case
    records = [dict(r, score=s) for r, s in zip(dets * 3, [-0.0, 1e-300, 1e22, 0.1, 1 / 3] * len(dets))]
    arrays = detections_from_records(records)
    path = write_results_file(tmp_path / "d.json", arrays, chunk=7)
    pieces = [json.dumps(arrays.take(slice(k, k + 7)).to_records())[1:-1] for k in range(0, len(records), 7)]
    assert path.read_text() == "[" + ",".join("\n" + p for p in pieces) + "\n]\n"
    assert json.loads(path.read_text()) == arrays.to_records()
    arrays.score[2] = float("nan")
    with pytest.raises(ValueError, match="not JSON compliant"):
        write_results_file(tmp_path / "bad.json", arrays)


def test_image_ids_above_2_53_are_read_exactly_and_past_int64_refused(tmp_path):
    """Results and ground truth with ids 2**53 .. 2**53 + 3 (odd and even neighbours,
    which float64 merges) keep every id; an id past int64 (2**63, which numpy would read
    as uint64 and wrap) is one line naming the file and the field."""
    from detector.evaluation import load_ground_truth, load_predictions, score_detections

    ids = [2**53 + k for k in range(4)]
    gt = {"images": [{"id": i, "width": 100, "height": 100} for i in ids],
          "categories": [{"id": 1, "name": "a"}],
          "annotations": [{"id": k + 1, "image_id": i, "category_id": 1, "bbox": [10.0 + k, 10, 30, 30], "area": 900,
                           "iscrowd": 0} for k, i in enumerate(ids)]}
    dets = [{"image_id": i, "category_id": 1, "bbox": [10.0 + k, 10, 30, 30], "score": 0.9} for k, i in enumerate(ids)]
    (tmp_path / "gt.json").write_text(json.dumps(gt))
    (tmp_path / "d.json").write_text(json.dumps(dets))
    gt_read = load_ground_truth(tmp_path / "gt.json")
    got = load_predictions(tmp_path / "d.json", gt_read)
    assert got.image_id.dtype == np.int64 and got.image_id.tolist() == ids
    assert score_detections(gt_read, got).metrics["AP"] == 1.0  # each box on its own image
    dets[2]["image_id"] = 2**63
    (tmp_path / "d.json").write_text(json.dumps(dets))
    with pytest.raises(ResultsError) as info:
        load_predictions(tmp_path / "d.json", gt_read)
    assert str(info.value) == f"{tmp_path / 'd.json'}: the 'image_id' values do not fit 64-bit numbers"
    for d in dets:
        d["image_id"] = 2**63 + 1
    (tmp_path / "d.json").write_text(json.dumps(dets))  # all in uint64 range: no wrap to negative ids
    with pytest.raises(ResultsError, match="'image_id' values do not fit 64-bit numbers"):
        load_predictions(tmp_path / "d.json", gt_read)


def test_results_file_nested_too_deep_is_one_line(case, tmp_path, capsys):
    """json's decoder recurses once per level: a file of 100000 nested lists was a
    RecursionError traceback (the annotation files had this guard already)."""
    d, _, _ = case
    path = tmp_path / "deep.json"
    path.write_text("[" * 100000 + "]" * 100000)
    assert load_tool("eval").main(["--predictions", str(path), "--annotations", str(d / "gt.json")]) == 1
    err = capsys.readouterr().err
    assert err.strip() == (f"error: {path}: the predictions file is nested too deep (more than about 1000 levels of "
                           "lists and objects)"), err
