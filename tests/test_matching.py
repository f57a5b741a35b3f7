"""Batched matching and sampling (issue 15, dispatch cost): the training heads label,
sample and encode all images at once. Each batched form is checked against the
per-image computation it replaces, and the IoU against ``torchvision.ops.box_iou``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torchvision.ops import box_iou

from detector.modeling.box_coder import BoxCoder
from detector.modeling import matching
from detector.modeling.matching import (IGNORE, PAD_BOX, box_iou_batched, match_by_iou, pad_boxes,
                                        sample_minibatch)
from detector.modeling.losses import weighted_smooth_l1
from detector.modeling.rpn import rpn_outside_weights

from test_roi_heads import make_heads, random_boxes
from test_rpn import make_rpn


def per_image_boxes(counts, size=100.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [random_boxes(n, size, g) for n in counts]


def test_pad_boxes_marks_padding_and_keeps_real_boxes():
    boxes = per_image_boxes([3, 0, 5])
    padded, real = pad_boxes(boxes)
    assert padded.shape == (3, 5, 4) and real.shape == (3, 5)
    assert real.sum(1).tolist() == [3, 0, 5]
    for i, b in enumerate(boxes):
        assert torch.equal(padded[i, : len(b)], b)
        assert torch.equal(padded[i, len(b):], torch.tensor(PAD_BOX).expand(5 - len(b), 4))
    # No image has a box: still one (padding) slot per image.
    padded, real = pad_boxes([torch.zeros(0, 4), torch.zeros(0, 4)])
    assert padded.shape == (2, 1, 4) and not real.any()


def test_batched_iou_is_box_iou_exactly():
    gt = per_image_boxes([4, 7], seed=1)
    boxes = per_image_boxes([50, 50], seed=2)
    padded_gt, _ = pad_boxes(gt)
    iou = box_iou_batched(padded_gt, torch.stack(boxes))
    shared = box_iou_batched(padded_gt, boxes[0])
    for i in range(2):
        assert torch.equal(iou[i, : len(gt[i])], box_iou(gt[i], boxes[i]))  # bit for bit
        assert torch.equal(shared[i, : len(gt[i])], box_iou(gt[i], boxes[0]))


@pytest.mark.parametrize("low_quality", [False, True])
def test_batched_matching_equals_per_image(low_quality):
    gt = per_image_boxes([2, 0, 6], seed=3)
    near = torch.cat((gt[0], gt[2])) + 1.0  # IoU > 0.7 with their ground truth
    anchors = torch.cat((per_image_boxes([200], seed=4)[0], near))
    padded, real = pad_boxes(gt)
    labels, matched, max_iou = match_by_iou(padded, anchors, 0.7, 0.0, 0.3, low_quality, gt_valid=real)
    for i, g in enumerate(gt):
        exp_labels, exp_matched, exp_iou = match_by_iou(g, anchors, 0.7, 0.0, 0.3, low_quality)
        assert torch.equal(labels[i], exp_labels)
        assert torch.equal(max_iou[i], exp_iou)
        assert torch.equal(matched[i], exp_matched)
    assert (labels[1] == 0).all()  # no ground truth: all background
    assert (labels[0] == 1).any() and (labels[2] == 1).any()


@pytest.mark.parametrize("shared", [True, False])
def test_matching_in_image_groups_equals_one_group(monkeypatch, shared):
    """A batch whose IoU exceeds MATCH_CHUNK_ELEMENTS is matched a few images at a time
    (bounded memory), with the same results as all images at once."""
    gt = per_image_boxes([3, 0, 6, 1, 5], seed=5)
    anchors = per_image_boxes([120], seed=6)[0]
    boxes = anchors if shared else torch.stack([anchors + i for i in range(len(gt))])
    padded, real = pad_boxes(gt)
    whole = match_by_iou(padded, boxes, 0.7, 0.0, 0.3, True, gt_valid=real)
    calls = []
    real_iou = matching.box_iou_batched
    monkeypatch.setattr(matching, "box_iou_batched", lambda a, b: calls.append(len(a)) or real_iou(a, b))
    monkeypatch.setattr(matching, "MATCH_CHUNK_ELEMENTS", 2 * 6 * 120)  # two images of 6 boxes x 120
    grouped = match_by_iou(padded, boxes, 0.7, 0.0, 0.3, True, gt_valid=real)
    assert calls == [2, 2, 1]
    for a, b in zip(whole, grouped):
        assert torch.equal(a, b)


def test_batched_sampler_samples_each_row_on_its_own():
    torch.manual_seed(0)
    labels = torch.full((3, 600), IGNORE, dtype=torch.int64)
    labels[0, :300] = 1
    labels[0, 300:] = 0
    labels[1, :5] = 1
    labels[1, 5:40] = 0  # fewer candidates than slots: invalid slots
    labels[2, 100:500] = 0  # no foreground
    s = sample_minibatch(labels, 64, 0.25)
    assert s.index.shape == s.valid.shape == s.foreground.shape == (3, 64)
    assert s.foreground.sum(1).tolist() == [16, 5, 0]
    assert s.valid.sum(1).tolist() == [64, 40, 64]
    for i in range(3):
        idx = s.index[i][s.valid[i]]
        assert idx.unique().numel() == idx.numel()
        assert (labels[i, s.index[i][s.foreground[i]]] == 1).all()
        assert (labels[i, s.index[i][s.valid[i] & ~s.foreground[i]]] == 0).all()
    # Rows draw different keys: the same labels in two rows give two different samples.
    same = sample_minibatch(torch.stack([labels[0], labels[0]]), 64, 0.25)
    assert set(same.index[0].tolist()) != set(same.index[1].tolist())


def test_batched_outside_weights_are_per_image():
    torch.manual_seed(0)
    labels = torch.cat([torch.ones(2, 30), torch.zeros(2, 500)], dim=1).long()
    labels[1, :25] = 0  # image 1: 5 foreground
    s = sample_minibatch(labels, 128, 0.5)
    w = rpn_outside_weights(s, 0.25)
    for i, num_fg in enumerate([30, 5]):
        assert float(w[i][s.foreground[i]].sum()) == pytest.approx(0.25)
        assert torch.allclose(w[i][s.foreground[i]], torch.full((num_fg,), 0.25 / num_fg))
    assert torch.allclose(rpn_outside_weights(s, -1.0).sum(1), torch.ones(2))


def test_batched_rpn_losses_are_the_mean_of_per_image_losses():
    """Samplers that take every candidate make the loss deterministic; the batched loss
    is then the mean of the per-image losses computed independently, with one image
    without boxes (objectness loss only)."""
    rpn = make_rpn(batch_size_per_image=10_000)
    anchors = per_image_boxes([300], seed=5)[0]
    gt = per_image_boxes([3, 0, 1], seed=6)
    logits, deltas = torch.randn(3, 300), torch.randn(3, 300, 4)
    got = rpn.losses(anchors, logits, deltas, [{"boxes": g} for g in gt])
    coder = BoxCoder((1.0, 1.0, 1.0, 1.0))
    exp_cls, exp_box = 0.0, 0.0
    for i, g in enumerate(gt):
        labels, matched = rpn.label_anchors(anchors, g)
        keep = labels >= 0
        fg = (labels[keep] == 1).float()
        exp_cls += F.binary_cross_entropy_with_logits(logits[i, keep], fg)
        if len(g):
            pos = labels == 1
            targets = coder.encode(anchors[pos], g[matched[pos]])
            exp_box += F.smooth_l1_loss(deltas[i, pos], targets, beta=1 / 9, reduction="sum") / int(keep.sum())
    torch.testing.assert_close(got["loss_rpn_cls"], exp_cls / 3)
    torch.testing.assert_close(got["loss_rpn_box"], exp_box / 3)


def test_batched_proposal_sampling_equals_per_image_labels_and_targets():
    """Images with different proposal and box counts (one without boxes): every real
    candidate is sampled once, padding never; labels and targets equal the per-image
    computation."""
    heads = make_heads(batch_size_per_image=10_000, bg_iou_lo=0.0)
    proposals = per_image_boxes([40, 7, 25], seed=7)
    gt = per_image_boxes([2, 0, 5], seed=8)
    labels_in = [torch.randint(1, 4, (len(g),)) for g in gt]
    rois, labels, reg, valid = heads.sample_proposals(proposals, [{"boxes": g, "labels": c}
                                                                  for g, c in zip(gt, labels_in)])
    slots = rois.shape[1]
    assert rois.shape == (3, slots, 4) and labels.shape == valid.shape == (3 * slots,)
    coder = BoxCoder((10.0, 10.0, 5.0, 5.0))
    for i, (props, g, c) in enumerate(zip(proposals, gt, labels_in)):
        candidates = torch.cat((props, g))
        exp_labels, matched, _ = match_by_iou(g, candidates, 0.5, 0.0, 0.5)
        v = valid[i * slots:(i + 1) * slots]
        assert int(v.sum()) == len(candidates)  # bg_iou_lo 0: nothing ignored
        got_boxes = rois[i][v]
        # Each real candidate exactly once, in some order.
        order = torch.cdist(got_boxes, candidates).argmin(1)
        assert torch.equal(got_boxes, candidates[order]) and order.unique().numel() == len(candidates)
        exp_cls = torch.where(exp_labels == 1, c[matched] if len(g) else 0, 0)[order]
        assert torch.equal(labels[i * slots:(i + 1) * slots][v], exp_cls)
        got_reg = reg[i * slots:(i + 1) * slots][v]
        if len(g):
            exp_reg = coder.encode(candidates, g[matched]) * (exp_labels == 1)[:, None]
            torch.testing.assert_close(got_reg, exp_reg[order])
        else:
            assert (got_reg == 0).all()
    # The box loss only sees foreground slots: finite with the padded ground truth.
    assert torch.isfinite(reg).all()
    assert torch.isfinite(weighted_smooth_l1(reg, torch.zeros_like(reg))).all()
