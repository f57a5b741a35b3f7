"""Soft-NMS (detector/ops/soft_nms.py) against a plain transcription of Algorithm 1 of
Bodla et al. 2017, run on the same inputs; and its use in the ROI heads' post-processing."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from detector.config import ConfigError, load_config
from detector.modeling.roi_heads import SoftNMSSettings
from detector.ops import batched_soft_nms, soft_nms

from test_roi_heads import make_heads


def reference_iou(a, b):
    """IoU of two [x1, y1, x2, y2] boxes, plain Python."""
    iw = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    ih = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = iw * ih
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


def reference_soft_nms(boxes, scores, method, nt, sigma, thresh):
    """Algorithm 1 of the paper: B the boxes, S their scores, D the kept ones. While B is
    not empty: m = argmax S; move b_m to D; for each b_i in B, s_i <- s_i f(iou(b_m, b_i));
    then boxes whose score fell below the threshold leave B. Returns (indices, scores) of D."""
    B = [i for i in range(len(boxes)) if scores[i] >= thresh]
    S = {i: float(scores[i]) for i in B}
    D, DS = [], []
    while B:
        m = B[0]
        for i in B:  # first maximum in index order (B stays in index order)
            if S[i] > S[m]:
                m = i
        D.append(m)
        DS.append(S[m])
        B.remove(m)
        for i in B:
            iou = reference_iou(boxes[m], boxes[i])
            if method == "linear":
                if iou > nt:
                    S[i] = S[i] * (1 - iou)
            else:
                S[i] = S[i] * math.exp(-(iou * iou) / sigma)
        B = [i for i in B if S[i] >= thresh]
    return D, DS


def random_case(rng: np.random.Generator, n: int):
    """n boxes with clusters, exact duplicates and tied scores."""
    centres = rng.uniform(20, 80, size=(max(1, n // 4), 2))
    c = centres[rng.integers(0, len(centres), size=n)] + rng.normal(0, 4, size=(n, 2))
    wh = rng.uniform(8, 30, size=(n, 2))
    boxes = np.concatenate([c - wh / 2, c + wh / 2], axis=1)
    scores = rng.choice([0.9, 0.5, 0.3], size=n) if rng.random() < 0.3 else rng.uniform(0, 1, size=n)
    if n >= 4:
        boxes[1] = boxes[0]  # identical boxes
        scores[3] = scores[2]  # tied scores
    return boxes, scores


@pytest.mark.parametrize("method", ["linear", "gaussian"])
def test_soft_nms_equals_the_papers_algorithm_on_random_sets(method):
    rng = np.random.default_rng(0)
    cases = 0
    for trial in range(150):
        n = int(rng.integers(0, 40))
        boxes, scores = random_case(rng, n)
        nt, sigma, thresh = float(rng.choice([0.3, 0.5])), float(rng.choice([0.3, 0.5, 1.0])), float(rng.choice([0.001, 0.1]))
        keep, new = soft_nms(torch.from_numpy(boxes), torch.from_numpy(scores), method, nt, sigma, thresh)
        ref_keep, ref_scores = reference_soft_nms(boxes.tolist(), scores.tolist(), method, nt, sigma, thresh)
        assert keep.tolist() == ref_keep, (trial, method)
        np.testing.assert_allclose(new.numpy(), np.array(ref_scores, dtype=np.float64).reshape(-1), rtol=1e-12, atol=1e-12)
        cases += len(ref_keep) < n  # some boxes were dropped: the decay did something
    assert cases > 20


def test_soft_nms_empty_identical_and_disjoint():
    keep, new = soft_nms(torch.zeros(0, 4), torch.zeros(0))
    assert keep.tolist() == [] and new.tolist() == []
    same = torch.tensor([[0.0, 0, 10, 10]] * 3)
    keep, new = soft_nms(same, torch.tensor([0.5, 0.9, 0.5]), "linear", 0.3, 0.5, 0.001)
    assert keep.tolist() == [1]  # IoU 1: linear decay to 0, dropped
    keep, new = soft_nms(same, torch.tensor([0.5, 0.9, 0.5]), "gaussian", 0.3, 0.5, 0.001)
    assert keep.tolist() == [1, 0, 2]  # ties to the lower index
    torch.testing.assert_close(new, torch.tensor([0.9, 0.5 * math.exp(-2), 0.5 * math.exp(-4)]))
    apart = torch.tensor([[0.0, 0, 10, 10], [20.0, 20, 30, 30]])
    keep, new = soft_nms(apart, torch.tensor([0.2, 0.7]), "gaussian")
    assert keep.tolist() == [1, 0] and new.tolist() == pytest.approx([0.7, 0.2])
    with pytest.raises(ValueError, match="method must be one of linear, gaussian"):
        soft_nms(apart, torch.tensor([0.2, 0.7]), "cubic")


def test_batched_soft_nms_is_per_class():
    rng = np.random.default_rng(1)
    boxes, scores = random_case(rng, 30)
    labels = rng.integers(1, 4, size=30)
    keep, new = batched_soft_nms(torch.from_numpy(boxes), torch.from_numpy(scores), torch.from_numpy(labels),
                                 "gaussian", 0.3, 0.5, 0.01)
    expected = []
    for c in (1, 2, 3):
        idx = np.where(labels == c)[0]
        k, s = reference_soft_nms(boxes[idx].tolist(), scores[idx].tolist(), "gaussian", 0.3, 0.5, 0.01)
        expected += [(float(v), int(idx[i])) for i, v in zip(k, s)]
    got = sorted(zip(keep.tolist(), new.tolist()))
    want = sorted((i, v) for v, i in expected)
    assert [i for i, _ in got] == [i for i, _ in want]
    assert [v for _, v in got] == pytest.approx([v for _, v in want], rel=1e-12)
    assert new.tolist() == sorted(new.tolist(), reverse=True)


def test_roi_heads_soft_nms_keeps_overlapping_boxes_with_decayed_scores():
    torch.manual_seed(0)
    hard = make_heads(score_thresh=0.0, nms_thresh=0.5).eval()
    soft = make_heads(score_thresh=0.0, nms_thresh=0.5, nms=SoftNMSSettings("linear", 0.5, 0.0)).eval()
    # Two proposals, IoU 0.81; logits put both on class 1.
    proposals = torch.tensor([[10.0, 10, 60, 60], [10.0, 10, 60, 55]])
    logits = torch.tensor([[0.0, 5.0, 0.0, 0.0], [0.0, 4.0, 0.0, 0.0]])
    deltas = torch.zeros(2, 16)
    h = hard.postprocess(logits, deltas, [proposals], [(100, 100)])[0]
    s = soft.postprocess(logits, deltas, [proposals], [(100, 100)])[0]
    cls1 = s["labels"] == 1
    assert int((h["labels"] == 1).sum()) == 1 and int(cls1.sum()) == 2
    p = torch.softmax(logits, 1)[:, 1]
    torch.testing.assert_close(s["scores"][cls1], torch.stack([p[0], p[1] * (1 - 0.9)]))


def test_nms_config_keys_are_checked():
    cfg = load_config(None, ["roi_heads.nms.type=soft", "roi_heads.nms.method=gaussian", "roi_heads.nms.sigma=0.3"])
    assert (cfg.roi_heads.nms.type, cfg.roi_heads.nms.method, cfg.roi_heads.nms.sigma) == ("soft", "gaussian", 0.3)
    assert load_config(None, []).roi_heads.nms.type == "hard"
    with pytest.raises(ConfigError, match="roi_heads.nms.type"):
        load_config(None, ["roi_heads.nms.type=greedy"])
    with pytest.raises(ConfigError, match="roi_heads.nms.sigma"):
        load_config(None, ["roi_heads.nms.sigma=0"])
    with pytest.raises(ConfigError, match="roi_heads.nms.method"):
        load_config(None, ["roi_heads.nms.method=cubic"])
