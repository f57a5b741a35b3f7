"""VOC AP: a case worked out by hand (11-point and area rules), difficult objects,
the IoU threshold and the absence of the "+1" pixel convention."""

from __future__ import annotations

import math

import numpy as np
import pytest

from detector.evaluation.voc import ap_area, ap_voc07, mean_ap, voc_evaluate


def xywh(x1, y1, x2, y2):
    return [x1, y1, x2 - x1, y2 - y1]


def gt_dict(objects, num_images=2, cats=(1, 2, 3)):
    """objects: (image_id, cat, xyxy, difficult)."""
    anns = []
    for k, (img, cat, box, diff) in enumerate(objects):
        ann = {"id": k + 1, "image_id": img, "category_id": cat, "bbox": xywh(*box), "iscrowd": 0}
        if diff:
            ann.update(ignore=1, difficult=1)
        anns.append(ann)
    return {
        "images": [{"id": i + 1, "width": 200, "height": 200} for i in range(num_images)],
        "annotations": anns,
        "categories": [{"id": c, "name": f"c{c}"} for c in cats],
    }


def det(img, cat, box, score):
    return {"image_id": img, "category_id": cat, "bbox": xywh(*box), "score": score}


A1, A2, A3, D = (0, 0, 10, 10), (20, 20, 30, 30), (0, 0, 10, 10), (50, 50, 60, 60)
GT = [(1, 1, A1, False), (1, 1, A2, False), (2, 1, A3, False), (2, 1, D, True), (1, 2, (5, 5, 50, 50), False)]
DETS = [
    det(1, 1, A1, 0.9),  # TP
    det(1, 1, A1, 0.8),  # duplicate: FP
    det(2, 1, (100, 100, 110, 110), 0.7),  # FP
    det(2, 1, A3, 0.6),  # TP
    det(2, 1, D, 0.5),  # on the difficult object: ignored
    det(1, 1, A2, 0.4),  # TP
]
# By hand (ignored detection left out): TP FP FP TP TP, 3 positives:
# recall 1/3 1/3 1/3 2/3 1, precision 1 1/2 1/3 1/2 3/5.
# 11-point: t = 0..0.3 -> 1 (4 levels), t = 0.4..1.0 -> 0.6 (7 levels): 8.2 / 11.
# Area: envelope 1 on (0, 1/3], 0.6 on (1/3, 1]: 1/3 + 2/3 * 0.6 = 11/15.
AP07 = 8.2 / 11
AP_AREA = 11 / 15


def test_hand_worked_case():
    res = voc_evaluate(gt_dict(GT), DETS)
    r = res[1]
    assert r.num_gt == 3 and r.num_tp == 3 and r.num_det == 5
    assert r.ap_voc07 == pytest.approx(AP07, abs=1e-12)
    assert r.ap_area == pytest.approx(AP_AREA, abs=1e-12)
    assert res[2].num_gt == 1 and res[2].ap_voc07 == 0.0 and res[2].ap_area == 0.0  # no detections
    assert math.isnan(res[3].ap_area)  # no ground truth: undefined, left out of the mean
    assert mean_ap(res, "area") == pytest.approx((AP_AREA + 0.0) / 2)
    assert mean_ap(res, "voc07") == pytest.approx((AP07 + 0.0) / 2)
    # No class with ground truth: -1, as pycocotools' "cannot compute" (it was 0.0, a worst score).
    no_gt = {3: res[3]}
    assert mean_ap(no_gt, "area") == mean_ap(no_gt, "voc07") == mean_ap({}, "area") == -1.0


def test_difficult_changes_nothing():
    base = voc_evaluate(gt_dict(GT), DETS)[1]
    no_difficult = [o for o in GT if not o[3]]
    dets_without = [d for d in DETS if d["score"] != 0.5]
    for gt, dets in [(no_difficult, dets_without), (GT, dets_without), (no_difficult[:], DETS[:4] + DETS[5:])]:
        r = voc_evaluate(gt_dict(gt), dets)[1]
        assert (r.ap_voc07, r.ap_area, r.num_gt) == (base.ap_voc07, base.ap_area, base.num_gt)
    # Control: the same object NOT difficult does change the result (4 positives, 4 TP).
    plain = [(img, c, b, False) for img, c, b, _ in GT]
    r = voc_evaluate(gt_dict(plain), DETS)[1]
    assert r.num_gt == 4 and r.ap_area != pytest.approx(AP_AREA)


def test_iou_threshold_and_no_plus_one():
    gt = gt_dict([(1, 1, (0, 0, 10, 10), False)], num_images=1)
    # IoU = 50 / 100 = 0.5 exactly in continuous coordinates; with "+1" it would be
    # 66 / 121 = 0.545.
    dets = [det(1, 1, (0, 0, 10, 5), 0.9)]
    assert voc_evaluate(gt, dets, iou_thresh=0.5)[1].ap_area == 1.0
    assert voc_evaluate(gt, dets, iou_thresh=0.52)[1].ap_area == 0.0
    assert voc_evaluate(gt, dets, iou_thresh=0.3)[1].ap_voc07 == 1.0


def test_ap_rules_on_known_curves():
    # A perfect detector.
    assert ap_voc07(np.array([0.5, 1.0]), np.array([1.0, 1.0])) == 1.0
    assert ap_area(np.array([0.5, 1.0]), np.array([1.0, 1.0])) == 1.0
    # Recall reaches only 0.5 with precision 1: area 0.5, 11-point 6/11 (t = 0..0.5).
    assert ap_area(np.array([0.25, 0.5]), np.array([1.0, 1.0])) == pytest.approx(0.5)
    assert ap_voc07(np.array([0.25, 0.5]), np.array([1.0, 1.0])) == pytest.approx(6 / 11)
    # No detections.
    assert ap_area(np.zeros(0), np.zeros(0)) == 0.0
    assert ap_voc07(np.zeros(0), np.zeros(0)) == 0.0


def test_crowd_box_is_ignored_like_difficult():
    gt = gt_dict([(1, 1, (0, 0, 10, 10), False)], num_images=1)
    gt["annotations"].append({"id": 9, "image_id": 1, "category_id": 1, "bbox": xywh(50, 50, 90, 90), "iscrowd": 1})
    dets = [det(1, 1, (0, 0, 10, 10), 0.5), det(1, 1, (50, 50, 90, 90), 0.9)]
    r = voc_evaluate(gt, dets)[1]
    assert r.num_gt == 1 and r.ap_area == 1.0


# --------------------------------------------------------------------------- VOC07 recall levels

# 10 objects (one per image), detections in decreasing score, T = on an object, F = a
# false positive: recall reaches exactly 0.3, 0.6 and 0.7, and precision drops right after.
FLAGS = "TTTFFTTTFTFF"


def flag_case():
    objects = [(i + 1, 1, (0, 0, 10, 10), False) for i in range(10)]
    dets, tp = [], 0
    for k, f in enumerate(FLAGS):
        score = 1.0 - k / 100
        if f == "T":
            tp += 1
            dets.append(det(tp, 1, (0, 0, 10, 10), score))
        else:
            dets.append(det(1, 1, (100, 100, 110, 110), score))
    return gt_dict(objects, num_images=10, cats=(1,)), dets


def numpy_arange_reference(rec, prec):
    """py-faster-rcnn's / detectron2's voc_eval, 11-point branch, as they write it."""
    ap = 0.0
    for t in np.arange(0.0, 1.1, 0.1):
        p = 0 if np.sum(rec >= t) == 0 else np.max(prec[rec >= t])
        ap = ap + p / 11.0
    return ap


def exact_reference():
    """The same rule in exact rational arithmetic, levels k/10."""
    from fractions import Fraction

    tp = fp = 0
    points = []
    for f in FLAGS:
        tp, fp = tp + (f == "T"), fp + (f == "F")
        points.append((Fraction(tp, 10), Fraction(tp, tp + fp)))
    total = Fraction(0)
    for k in range(11):
        reached = [p for r, p in points if r >= Fraction(k, 10)]
        total += max(reached) if reached else 0
    return float(total / 11)


def test_voc07_thresholds_numpy_arange_and_exact():
    gt, dets = flag_case()
    rec = np.cumsum([f == "T" for f in FLAGS]) / 10
    prec = np.cumsum([f == "T" for f in FLAGS]) / np.arange(1, len(FLAGS) + 1)
    assert set(rec[[2, 7, 9]].tolist()) == {0.3, 0.6, 0.7}  # exactly 3/10, 6/10, 7/10
    peers, exact = numpy_arange_reference(rec, prec), exact_reference()
    assert abs(peers - exact) > 0.05  # the three levels matter on this curve

    arange = voc_evaluate(gt, dets, voc07_thresholds="numpy_arange")[1]
    np.testing.assert_array_equal(arange.recall, rec)
    np.testing.assert_array_equal(arange.precision, prec)
    assert arange.ap_voc07 == peers  # bit for bit
    assert ap_voc07(rec, prec, "numpy_arange") == peers

    default = voc_evaluate(gt, dets)[1]
    assert default.ap_voc07 == pytest.approx(exact, rel=1e-15)
    assert ap_voc07(rec, prec) == pytest.approx(exact, rel=1e-15)
    assert default.ap_area == arange.ap_area  # the area rule has no levels


def test_voc07_thresholds_key_is_checked():
    from detector.config import ConfigError, load_config

    assert load_config(None).eval.voc07_thresholds == "exact"
    assert load_config(None, ["eval.voc07_thresholds=numpy_arange"]).eval.voc07_thresholds == "numpy_arange"
    with pytest.raises(ConfigError, match="eval.voc07_thresholds"):
        load_config(None, ["eval.voc07_thresholds=arange"])
    with pytest.raises(ValueError, match="voc07_thresholds"):
        ap_voc07(np.ones(1), np.ones(1), "arange")
