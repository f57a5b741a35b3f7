"""IoU and related metrics on cases worked out by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torchvision.ops import box_iou

from detector.evaluation.iou import (IGNORED, UNMATCHED, confusion_matrix, count_mae, greedy_match, group_by_image,
                                     iou_metrics, pearson)
from detector.evaluation.iou import _pair_iou_torchvision


def xywh(b):
    return [b[0], b[1], b[2] - b[0], b[3] - b[1]]


def records(gt_objects, dets, num_images=1, cats=(1, 2)):
    gt = {
        "images": [{"id": i + 1, "width": 100, "height": 100} for i in range(num_images)],
        "annotations": [
            {"id": k + 1, "image_id": img, "category_id": c, "bbox": xywh(b), "iscrowd": int(crowd)}
            for k, (img, c, b, crowd) in enumerate(gt_objects)
        ],
        "categories": [{"id": c, "name": str(c)} for c in cats],
    }
    res = [{"image_id": img, "category_id": c, "bbox": xywh(b), "score": s} for img, c, b, s in dets]
    return group_by_image(gt, res)


G0, G1, G2 = (0, 0, 10, 10), (20, 0, 30, 10), (0, 20, 10, 30)
GT = [(1, 1, G0, False), (1, 1, G1, False), (1, 2, G2, False)]
DETS = [
    (1, 1, (0, 0, 10, 10), 0.90),  # IoU 1 with G0, but d1 scores higher and takes G0 first
    (1, 1, (0, 0, 10, 8), 0.95),  # IoU 0.8 with G0
    (1, 1, (20, 0, 30, 5), 0.60),  # IoU 0.5 with G1
    (1, 1, (0, 20, 10, 30), 0.70),  # on G2 but the wrong class
]


def tensors(dets, gt):
    return (
        torch.tensor([d[2] for d in dets], dtype=torch.float32),
        torch.tensor([d[3] for d in dets]),
        torch.tensor([d[1] for d in dets]),
        torch.tensor([g[2] for g in gt], dtype=torch.float32),
        torch.tensor([g[1] for g in gt]),
    )


def test_greedy_match_by_score_per_class():
    db, ds, dl, gb, gl = tensors(DETS, GT)
    m = greedy_match(db, ds, dl, gb, gl, iou_thresh=0.5)
    assert m.det_to_gt.tolist() == [UNMATCHED, 0, 1, UNMATCHED]
    assert m.iou.tolist() == pytest.approx([0.0, 0.8, 0.5, 0.0])
    assert m.gt_matched.tolist() == [True, True, False]
    m75 = greedy_match(db, ds, dl, gb, gl, iou_thresh=0.75)
    assert m75.det_to_gt.tolist() == [UNMATCHED, 0, UNMATCHED, UNMATCHED]
    # Class-agnostic: d3 takes G2.
    agnostic = greedy_match(db, ds, dl, gb, gl, iou_thresh=0.5, class_aware=False)
    assert agnostic.det_to_gt.tolist() == [UNMATCHED, 0, 1, 2]


def test_pairwise_iou_is_torchvision():
    """The matcher's IoU of paired boxes gives torchvision's box_iou doubles, bit for bit,
    on the hand case, random boxes (overlapping, disjoint, nested) and touching edges."""
    db, _, _, gb, _ = tensors(DETS, GT)
    ours = _pair_iou_torchvision(db[[1, 2]].double().numpy(), gb[[0, 1]].double().numpy())
    assert ours.tolist() == pytest.approx([0.8, 0.5])
    rng = np.random.default_rng(0)
    xy = rng.uniform(0, 100, (2, 500, 2))
    wh = rng.uniform(0.5, 60, (2, 500, 2))
    a, b = (np.concatenate([xy[i], xy[i] + wh[i]], axis=1) for i in range(2))
    a[-1], b[-1] = [0, 0, 10, 10], [10, 0, 20, 10]  # touching: IoU 0
    expected = box_iou(torch.from_numpy(a), torch.from_numpy(b)).diagonal().numpy()
    np.testing.assert_array_equal(_pair_iou_torchvision(a, b), expected)
    assert 0 < (expected > 0).mean() < 1  # both overlapping and disjoint pairs were tried


def test_ignored_ground_truth():
    gt = [(1, 1, G0, False), (1, 1, (50, 50, 90, 90), True)]
    dets = [(1, 1, G0, 0.9), (1, 1, (50, 50, 90, 88), 0.8), (1, 1, (0, 60, 10, 70), 0.7)]
    db, ds, dl, gb, gl = tensors(dets, gt)
    m = greedy_match(db, ds, dl, gb, gl, 0.5, gt_ignore=torch.tensor([False, True]))
    assert m.det_to_gt.tolist() == [0, IGNORED, UNMATCHED]
    out = iou_metrics(records(gt, dets).values(), score_thresh=0.0)
    # 1 TP, 1 FP (the ignored detection counts neither way), no miss (crowd is not a miss).
    assert out["precision_50"] == pytest.approx(0.5) and out["recall_50"] == 1.0


def test_iou_metrics_hand_case():
    out = iou_metrics(records(GT, DETS).values(), score_thresh=0.0)
    # IoU 0.5: TP 2 (0.8, 0.5), FP 2, FN 1.
    assert out["mean_iou"] == pytest.approx(0.65)
    assert out["precision_50"] == pytest.approx(0.5)
    assert out["recall_50"] == pytest.approx(2 / 3)
    assert out["f1_50"] == pytest.approx(2 * 0.5 * (2 / 3) / (0.5 + 2 / 3))
    # IoU 0.75: TP 1, FP 3, FN 2.
    assert out["precision_75"] == pytest.approx(0.25)
    assert out["recall_75"] == pytest.approx(1 / 3)
    assert out["f1_75"] == pytest.approx(2 * 0.25 * (1 / 3) / (0.25 + 1 / 3))
    # Score threshold 0.65 drops the 0.60 detection (the 0.5-IoU match).
    hi = iou_metrics(records(GT, DETS).values(), score_thresh=0.65)
    assert hi["recall_50"] == pytest.approx(1 / 3) and hi["precision_50"] == pytest.approx(1 / 3)
    assert hi["mean_iou"] == pytest.approx(0.8)


def test_count_mae_and_pearson_known_arrays():
    pred, gt = [1, 2, 3, 4], [2, 2, 2, 6]
    assert count_mae(pred, gt) == pytest.approx(1.0)
    assert pearson(pred, gt) == pytest.approx(np.corrcoef(pred, gt)[0, 1], abs=1e-12)
    assert pearson([1, 2, 3], [2, 4, 6]) == pytest.approx(1.0)
    assert pearson([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    assert math.isnan(pearson([1, 1, 1], [1, 2, 3]))
    with pytest.raises(ValueError, match="differ in shape"):
        count_mae([1, 2], [1, 2, 3])
    # Through the records: image 1 has 3 objects and 2 detections, image 2: 0 and 1.
    recs = records(
        [(1, 1, G0, False), (1, 1, G1, False), (1, 2, G2, False)],
        [(1, 1, G0, 0.9), (1, 2, G2, 0.8), (2, 1, G0, 0.9), (1, 1, G1, 0.1)],
        num_images=2,
    )
    out = iou_metrics(recs.values(), score_thresh=0.5)
    assert out["count_mae"] == pytest.approx((1 + 1) / 2)
    assert out["count_pearson"] == pytest.approx(np.corrcoef([2, 1], [3, 0])[0, 1])


def test_confusion_matrix_misclassified_and_missed():
    gt = [(1, 1, G0, False), (1, 2, G1, False), (1, 2, G2, False)]
    dets = [
        (1, 1, G0, 0.9),  # correct
        (1, 1, (20, 0, 30, 9), 0.8),  # G1 (class 2) detected as class 1: misclassified
        (1, 2, (60, 60, 80, 80), 0.7),  # background detected as class 2
        (1, 2, G2, 0.3),  # below the score threshold: G2 is missed
    ]
    m = confusion_matrix(records(gt, dets).values(), cat_ids=[1, 2], score_thresh=0.5)
    expected = np.array(
        [
            [0, 0, 1],  # background row: one false positive of class 2
            [0, 1, 0],  # class 1: one correct
            [1, 1, 0],  # class 2: one missed, one detected as class 1
        ]
    )
    np.testing.assert_array_equal(m, expected)


def test_greedy_match_all_equals_greedy_match_per_image():
    """All images at once (greedy_match_all) against greedy_match image by image, class
    aware and agnostic: the same matches, IoUs and matched boxes, with ties in score,
    crowd boxes and zero-width boxes."""
    from cases import generate_results_case
    from detector.evaluation.iou import greedy_match_all, group_by_image

    gt, dets = generate_results_case(30, 6, 60, num_classes=4, seed=1)
    for d in dets[::7]:
        d["score"] = 0.5
    for d in dets[3::25]:
        d["bbox"][2] = 0.0
    for a in gt["annotations"][::6]:
        a["iscrowd"] = 1
    recs = list(group_by_image(gt, dets).values())
    assert any(r.gt_ignore.any() for r in recs)
    for class_aware in (True, False):
        d2g, ious, taken = [], [], []
        offset = 0
        for r in recs:
            m = greedy_match(*(torch.from_numpy(x) for x in (r.dt_boxes, r.dt_scores, r.dt_cats, r.gt_boxes, r.gt_cats)),
                             0.5, torch.from_numpy(r.gt_ignore), class_aware=class_aware)
            d2g.append(torch.where(m.det_to_gt >= 0, m.det_to_gt + offset, m.det_to_gt).numpy())
            ious.append(m.iou.numpy())
            taken.append(m.gt_matched.numpy())
            offset += len(r.gt_cats)
        cat = np.concatenate
        got = greedy_match_all(
            np.repeat(np.arange(len(recs)), [len(r.dt_cats) for r in recs]), cat([r.dt_boxes for r in recs]),
            cat([r.dt_scores for r in recs]), cat([r.dt_cats for r in recs]),
            np.repeat(np.arange(len(recs)), [len(r.gt_cats) for r in recs]), cat([r.gt_boxes for r in recs]),
            cat([r.gt_cats for r in recs]), cat([r.gt_ignore for r in recs]), 0.5, class_aware=class_aware,
        )
        np.testing.assert_array_equal(got.det_to_gt, cat(d2g))
        np.testing.assert_array_equal(got.iou, cat(ious))
        np.testing.assert_array_equal(got.gt_matched, cat(taken))
        assert (got.det_to_gt >= 0).sum() > 20 and (got.det_to_gt == IGNORED).any()
