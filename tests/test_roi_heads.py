"""ROI heads: RoI pooling, proposal sampling, class-specific targets, losses, post-processing."""

from __future__ import annotations

import math
from collections import OrderedDict

import pytest
import torch
import torch.nn.functional as F
from torchvision.ops import MultiScaleRoIAlign

from detector.modeling.roi_heads import (FastRCNNPredictor, MultiLevelRoIAlign, ROIHeads, TwoMLPHead,
                                         class_specific_targets)

K = 3  # classes without background


def make_heads(**kwargs) -> ROIHeads:
    pooler = MultiLevelRoIAlign([4, 8, 16, 32], output_size=7, sampling_ratio=2)
    return ROIHeads(pooler, TwoMLPHead(4 * 49, 32), FastRCNNPredictor(32, K + 1), num_classes=K, **kwargs)


def random_boxes(n: int, size: float, g: torch.Generator) -> torch.Tensor:
    xy = torch.rand(n, 2, generator=g) * size * 0.8
    wh = 4 + torch.rand(n, 2, generator=g) * size * 0.5
    return torch.cat((xy, (xy + wh).clamp(max=size)), dim=1)


def test_pooler_equals_torchvision_multiscale_roi_align():
    g = torch.Generator().manual_seed(0)
    feats = [torch.randn(2, 4, 256 // s, 320 // s, generator=g) for s in (4, 8, 16, 32)]
    boxes = [random_boxes(40, 250, g), random_boxes(25, 250, g)]
    boxes[0][:5] = torch.tensor([0.0, 0.0, 250.0, 250.0])  # large boxes go to the top level
    ours = MultiLevelRoIAlign([4, 8, 16, 32], 7, 2)(feats, boxes)
    theirs = MultiScaleRoIAlign(["0", "1", "2", "3"], 7, 2)(
        OrderedDict((str(i), f) for i, f in enumerate(feats)), boxes, [(256, 320), (240, 300)])
    assert ours.shape == (65, 4, 7, 7)
    torch.testing.assert_close(ours, theirs)
    levels = MultiLevelRoIAlign([4, 8, 16, 32]).level_of(torch.tensor([[0.0, 0, 224, 224], [0, 0, 112, 112],
                                                                       [0, 0, 20, 20], [0, 0, 800, 800]]))
    assert levels.tolist() == [2, 1, 0, 3]
    # aligned=True shifts the sampling grid by half a pixel: a different result.
    shifted = MultiLevelRoIAlign([4, 8, 16, 32], 7, 2, aligned=True)(feats, boxes)
    assert not torch.allclose(shifted, ours)


def test_sampling_labels_and_class_specific_targets():
    heads = make_heads(bg_iou_lo=0.1)
    gt = torch.tensor([[0.0, 0.0, 100.0, 100.0]])
    proposals = torch.tensor([
        [0.0, 0.0, 100.0, 60.0],    # IoU 0.60 -> foreground
        [0.0, 0.0, 100.0, 40.0],    # IoU 0.40 -> background
        [10.0, 0.0, 100.0, 100.0],  # IoU 0.90 -> foreground
        [0.0, 0.0, 100.0, 5.0],     # IoU 0.05 < bg_iou_lo -> ignored
    ])
    torch.manual_seed(0)
    rois, labels, reg, valid = heads.sample_proposals([proposals], [{"boxes": gt, "labels": torch.tensor([2])}])
    rois = rois[0]
    assert rois.shape == (5, 4)  # 4 proposals + the ground truth, fewer than 512
    as_list = [tuple(r.tolist()) for r in rois]
    lab = {box: (int(l), bool(v)) for box, l, v in zip(as_list, labels, valid)}
    assert lab[(0.0, 0.0, 100.0, 60.0)] == (2, True)
    assert lab[(10.0, 0.0, 100.0, 100.0)] == (2, True)
    assert lab[(0.0, 0.0, 100.0, 100.0)] == (2, True)  # the appended ground truth
    assert lab[(0.0, 0.0, 100.0, 40.0)] == (0, True)
    assert lab[(0.0, 0.0, 100.0, 5.0)][1] is False  # ignored: an invalid slot

    targets, inside = class_specific_targets(reg, labels * valid, K + 1)
    assert targets.shape == inside.shape == (5, 4 * (K + 1))
    for i, box in enumerate(as_list):
        cls, ok = lab[box]
        if cls > 0:
            cols = list(range(4 * cls, 4 * cls + 4))
            assert inside[i].nonzero().flatten().tolist() == cols
            # Targets are deltas divided by the stds (0.1, 0.1, 0.2, 0.2).
            r = torch.tensor(box)
            w, h = r[2] - r[0], r[3] - r[1]
            raw = torch.stack([(50 - (r[0] + w / 2)) / w, (50 - (r[1] + h / 2)) / h, torch.log(100 / w), torch.log(100 / h)])
            torch.testing.assert_close(targets[i, cols], raw / torch.tensor([0.1, 0.1, 0.2, 0.2]))
            assert (targets[i, [c for c in range(16) if c not in cols]] == 0).all()
        else:
            assert (inside[i] == 0).all() and (targets[i] == 0).all()
    # The (0, 0, 100, 60) proposal: dy = (50 - 30) / 60 / 0.1, dh = log(100 / 60) / 0.2
    i = as_list.index((0.0, 0.0, 100.0, 60.0))
    assert targets[i, 9].item() == pytest.approx(20 / 60 * 10, rel=1e-5)
    assert targets[i, 11].item() == pytest.approx(math.log(100 / 60) * 5, rel=1e-5)


def test_sampling_fraction_on_many_proposals():
    g = torch.Generator().manual_seed(3)
    heads = make_heads()
    gt = torch.tensor([[50.0, 50.0, 150.0, 150.0], [300.0, 300.0, 400.0, 380.0]])
    near = gt.repeat(300, 1) + torch.randn(600, 4, generator=g) * 4  # mostly foreground
    far = random_boxes(2000, 600, g)
    torch.manual_seed(0)
    rois, labels, reg, valid = heads.sample_proposals([torch.cat((near, far))], [{"boxes": gt, "labels": torch.tensor([1, 3])}])
    assert rois[0].shape[0] == 512 and bool(valid.all())
    assert int((labels > 0).sum()) == 128  # 25 % of 512
    assert set(labels[labels > 0].tolist()) == {1, 3}


def test_roi_losses_equal_independent_computation():
    heads = make_heads()
    g = torch.Generator().manual_seed(1)
    labels = torch.tensor([2, 0, 1, 0, 3, 0])
    valid = torch.tensor([True, True, True, True, True, False])
    reg = torch.randn(6, 4, generator=g) * (labels > 0)[:, None]
    logits = torch.randn(6, K + 1, generator=g)
    deltas = torch.randn(6, 4 * (K + 1), generator=g)
    losses = heads.losses(logits, deltas, labels, reg, valid)
    exp_cls = F.cross_entropy(logits[:5], labels[:5])
    cols = torch.stack([torch.arange(4 * c, 4 * c + 4) for c in labels[:5]])
    pred = deltas[:5].gather(1, cols)[[0, 2, 4]]
    exp_box = F.smooth_l1_loss(pred, reg[[0, 2, 4]], beta=1.0, reduction="sum") / 5
    torch.testing.assert_close(losses["loss_roi_cls"], exp_cls)
    torch.testing.assert_close(losses["loss_roi_box"], exp_box)


def test_postprocess_threshold_nms_topk():
    heads = make_heads(score_thresh=0.3, nms_thresh=0.5, detections_per_img=2)
    props = torch.tensor([[10.0, 10.0, 50.0, 50.0], [11.0, 11.0, 51.0, 51.0], [100.0, 100.0, 150.0, 140.0],
                          [0.0, 0.0, 30.0, 30.0]])
    logits = torch.tensor([[0.0, 5.0, 0.0, 0.0],   # class 1, high
                           [0.0, 4.0, 0.0, 0.0],   # class 1, overlaps the first -> suppressed
                           [0.0, 0.0, 0.0, 3.0],   # class 3
                           [5.0, 0.0, 0.0, 0.0]])  # background
    deltas = torch.zeros(4, 16)
    deltas[2, 12] = 10.0  # class 3: dx = 10 / 10 = one box width to the right
    out = heads.postprocess(logits, deltas, [props], [(120, 160)])[0]
    assert out["labels"].tolist() == [1, 3]
    probs = F.softmax(logits, 1)
    torch.testing.assert_close(out["scores"], torch.stack([probs[0, 1], probs[2, 3]]))
    torch.testing.assert_close(out["boxes"][0], props[0])
    # dx = 10 / 10 = 1 box width to the right (50 px), then clipped to the 160 x 120 image
    torch.testing.assert_close(out["boxes"][1], torch.tensor([150.0, 100.0, 160.0, 120.0]))
    # Everything below the threshold: empty but well-formed.
    none = heads.postprocess(torch.zeros(4, 4), deltas, [props], [(120, 160)])[0]
    assert none["boxes"].shape == (0, 4) and none["labels"].dtype == torch.int64
