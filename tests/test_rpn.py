"""Anchors, box coding, RPN anchor targets, sampling, outside weights and losses."""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F
from torchvision.models.detection import _utils as tv_det_utils
from torchvision.models.detection.anchor_utils import AnchorGenerator as TVAnchorGenerator
from torchvision.models.detection.image_list import ImageList

from detector.config import RPNConfig
from detector.modeling.anchors import AnchorGenerator
from detector.modeling.box_coder import BoxCoder
from detector.modeling.matching import sample_minibatch
from detector.modeling.rpn import RegionProposalNetwork, RPNHead, rpn_outside_weights


def make_rpn(**overrides) -> RegionProposalNetwork:
    c = RPNConfig(**overrides)
    anchors = AnchorGenerator([[32.0]], [1.0])
    return RegionProposalNetwork(
        anchors, RPNHead(8, 1), box_coder_weights=c.box_coder_weights,
        fg_iou_thresh=c.fg_iou_thresh, bg_iou_thresh=c.bg_iou_thresh,
        batch_size_per_image=c.batch_size_per_image, positive_fraction=c.positive_fraction,
        sigma=c.sigma, positive_weight=c.positive_weight)


# ---------------------------------------------------------------- anchors and coder


def test_anchors_equal_torchvision():
    sizes = ((32,), (64,), (128,), (256,), (512,))
    ratios = (0.5, 1.0, 2.0)
    ours = AnchorGenerator([list(s) for s in sizes], list(ratios))
    theirs = TVAnchorGenerator(sizes, (ratios,) * len(sizes))
    image = torch.zeros(1, 3, 800, 832)  # padded batch; last level 13 x 13 -> stride 61 / 64
    feats = [torch.zeros(1, 1, 800 // s, 832 // s) for s in (4, 8, 16, 32)] + [torch.zeros(1, 1, 13, 13)]
    expected = theirs(ImageList(image, [(790, 820)]), feats)[0]
    got = ours((800, 832), [tuple(f.shape[-2:]) for f in feats], torch.device("cpu"))
    assert [g.shape[0] for g in got] == [f.shape[-2] * f.shape[-1] * 3 for f in feats]
    torch.testing.assert_close(torch.cat(got), expected, rtol=0, atol=0)
    # Cached: the same tensor object comes back.
    again = ours((800, 832), [tuple(f.shape[-2:]) for f in feats], torch.device("cpu"))
    assert all(a is b for a, b in zip(got, again))


def test_cell_anchor_shapes():
    gen = AnchorGenerator([[16.0, 32.0]], [0.5, 1.0, 2.0])
    cell = gen.cell_anchors[0]
    w, h = cell[:, 2] - cell[:, 0], cell[:, 3] - cell[:, 1]
    assert cell.shape == (6, 4)
    # Ratio = h / w, area ~ size^2 (corners rounded to pixels).
    torch.testing.assert_close(h / w, torch.tensor([0.5, 0.5, 1.0, 1.0, 2.0, 2.0]), atol=0, rtol=0.1)
    torch.testing.assert_close((w * h).sqrt(), torch.tensor([16.0, 32.0] * 3), atol=1.0, rtol=0)


def test_box_coder_matches_torchvision_and_round_trips():
    g = torch.Generator().manual_seed(0)
    ref = torch.rand(50, 2, generator=g) * 100
    ref = torch.cat((ref, ref + 5 + torch.rand(50, 2, generator=g) * 80), dim=1)
    gt = ref + torch.randn(50, 4, generator=g) * 3
    gt[:, 2:] = torch.maximum(gt[:, 2:], gt[:, :2] + 1)
    for weights in ((1.0, 1.0, 1.0, 1.0), (10.0, 10.0, 5.0, 5.0)):
        ours = BoxCoder(weights)
        theirs = tv_det_utils.BoxCoder(weights)
        deltas = ours.encode(ref, gt)
        torch.testing.assert_close(deltas, theirs.encode_single(gt, ref))
        torch.testing.assert_close(ours.decode(deltas, ref), gt, atol=1e-3, rtol=0)
        many = torch.randn(50, 12, generator=g)
        torch.testing.assert_close(ours.decode(many, ref), theirs.decode_single(many, ref))
    # dw is clamped at log(1000 / 16)
    big = BoxCoder((1.0, 1.0, 1.0, 1.0)).decode(torch.tensor([[0.0, 0.0, 50.0, 0.0]]), torch.tensor([[0.0, 0.0, 10.0, 10.0]]))
    assert big[0, 2] - big[0, 0] == pytest.approx(10 * 1000 / 16, rel=1e-4)


# ---------------------------------------------------------------- anchor labels


def test_anchor_labels_on_hand_made_anchors():
    rpn = make_rpn()
    gt = torch.tensor([[0.0, 0.0, 100.0, 100.0], [200.0, 200.0, 300.0, 300.0]])
    anchors = torch.tensor([
        [0.0, 0.0, 100.0, 75.0],     # IoU 0.75 with gt 0 -> positive
        [0.0, 0.0, 100.0, 20.0],     # IoU 0.20 -> negative
        [0.0, 0.0, 100.0, 50.0],     # IoU 0.50 -> ignored
        [200.0, 200.0, 300.0, 240.0],  # IoU 0.40, gt 1's best -> positive
        [200.0, 200.0, 300.0, 230.0],  # IoU 0.30 with gt 1 -> ignored (>= 0.3)
        [500.0, 500.0, 540.0, 540.0],  # IoU 0 -> negative
    ])
    labels, matched = rpn.label_anchors(anchors, gt)
    assert labels.tolist() == [1, 0, -1, 1, -1, 0]
    assert matched[[0, 3]].tolist() == [0, 1]
    # No ground truth: everything is background.
    labels, _ = rpn.label_anchors(anchors, torch.zeros(0, 4))
    assert labels.tolist() == [0] * 6


def test_ties_for_best_anchor_are_all_positive():
    rpn = make_rpn()
    gt = torch.tensor([[0.0, 0.0, 100.0, 100.0]])
    anchors = torch.tensor([[0.0, 0.0, 100.0, 40.0], [0.0, 60.0, 100.0, 100.0], [0.0, 0.0, 100.0, 25.0]])
    labels, _ = rpn.label_anchors(anchors, gt)
    assert labels.tolist() == [1, 1, 0]


# ---------------------------------------------------------------- sampling


@pytest.mark.parametrize("num_pos,num_neg", [(400, 2000), (10, 2000), (300, 20), (0, 50), (5, 0)])
def test_sampling_bounds(num_pos, num_neg):
    torch.manual_seed(0)
    labels = torch.cat([torch.ones(num_pos), torch.zeros(num_neg), -torch.ones(100)]).long()
    labels = labels[torch.randperm(len(labels))]
    s = sample_minibatch(labels, 256, 0.5)
    idx = s.index[s.valid]
    assert idx.unique().numel() == idx.numel()  # no duplicates
    assert (labels[idx] >= 0).all()  # ignored never drawn
    assert (labels[s.index[s.foreground]] == 1).all()
    assert (labels[s.index[s.valid & ~s.foreground]] == 0).all()
    n_fg = int(s.foreground.sum())
    assert n_fg == min(num_pos, 128)
    assert int(s.valid.sum()) == min(256, n_fg + num_neg)


def test_sampling_is_random():
    labels = torch.cat([torch.ones(500), torch.zeros(5000)]).long()
    torch.manual_seed(0)
    a = sample_minibatch(labels, 256, 0.5).index
    b = sample_minibatch(labels, 256, 0.5).index
    assert set(a.tolist()) != set(b.tolist())


def test_outside_weights_uniform_and_positive_weight():
    torch.manual_seed(0)
    labels = torch.cat([torch.ones(40), torch.zeros(3000)]).long()
    s = sample_minibatch(labels, 256, 0.5)
    w = rpn_outside_weights(s, -1.0)
    assert float(w.sum()) == pytest.approx(1.0)
    assert torch.allclose(w[s.valid], torch.full((256,), 1 / 256))
    for p in (0.3, 0.9):
        w = rpn_outside_weights(s, p)
        assert float(w[s.foreground].sum()) == pytest.approx(p)
        assert float(w[s.valid & ~s.foreground].sum()) == pytest.approx(1 - p)
        assert torch.allclose(w[s.foreground], torch.full((40,), p / 40))
    with pytest.raises(ValueError, match="positive_weight"):
        rpn_outside_weights(s, 1.5)


# ---------------------------------------------------------------- losses


def test_rpn_losses_equal_independent_computation():
    """Few anchors, so every non-ignored anchor is sampled and the loss is deterministic."""
    rpn = make_rpn()
    gt = torch.tensor([[10.0, 10.0, 60.0, 70.0]])
    anchors = torch.tensor([[10.0, 10.0, 60.0, 60.0], [12.0, 14.0, 58.0, 70.0], [100.0, 100.0, 140.0, 140.0],
                            [0.0, 0.0, 20.0, 20.0], [10.0, 10.0, 60.0, 40.0]])
    labels, _ = rpn.label_anchors(anchors, gt)
    assert labels.tolist() == [1, 1, 0, 0, -1]
    logits = torch.randn(1, 5)
    deltas = torch.randn(1, 5, 4)
    losses = rpn.losses(anchors, logits, deltas, [{"boxes": gt}])
    keep = torch.tensor([0, 1, 2, 3])
    exp_cls = F.binary_cross_entropy_with_logits(logits[0, keep], torch.tensor([1.0, 1.0, 0.0, 0.0]))
    targets = BoxCoder((1, 1, 1, 1)).encode(anchors[:2], gt.expand(2, 4))
    exp_box = F.smooth_l1_loss(deltas[0, :2], targets, beta=1 / 9, reduction="sum") / 4  # 4 sampled
    torch.testing.assert_close(losses["loss_rpn_cls"], exp_cls)
    torch.testing.assert_close(losses["loss_rpn_box"], exp_box)
    # positive_weight p: box loss weighted p / num_pos.
    rpn_p = make_rpn(positive_weight=0.25)
    losses = rpn_p.losses(anchors, logits, deltas, [{"boxes": gt}])
    torch.testing.assert_close(losses["loss_rpn_box"], exp_box * 4 * 0.25 / 2)
    # An image without boxes: only the objectness loss, all negatives.
    losses = rpn.losses(anchors, logits, deltas, [{"boxes": torch.zeros(0, 4)}])
    torch.testing.assert_close(losses["loss_rpn_cls"], F.binary_cross_entropy_with_logits(logits[0], torch.zeros(5)))
    assert losses["loss_rpn_box"].item() == 0.0


def test_proposals_are_clipped_sorted_and_limited():
    torch.manual_seed(0)
    gen = AnchorGenerator([[16.0], [32.0]], [0.5, 1.0, 2.0])
    rpn = RegionProposalNetwork(gen, RPNHead(8, 3), pre_nms_topk=(50, 40), post_nms_topk=(30, 20))
    rpn.eval()
    feats = [torch.randn(2, 8, 16, 16), torch.randn(2, 8, 8, 8)]
    sizes = [(60, 64), (50, 40)]
    with torch.no_grad():
        props, losses = rpn(feats, (64, 64), sizes)
    assert losses == {}
    for p, (h, w) in zip(props, sizes):
        assert 0 < len(p) <= 20
        assert (p[:, 0] >= 0).all() and (p[:, 2] <= w).all() and (p[:, 3] <= h).all()
        assert (p[:, 2] > p[:, 0]).all() and (p[:, 3] > p[:, 1]).all()


def test_cell_anchors_move_with_the_model_and_stay_out_of_the_state_dict():
    """They are non-persistent buffers: ``.to()`` moves them (a compiled or CUDA-graphed
    step then reads them on its device instead of copying them from host memory at each
    call), and the state dict stays torchvision's (its generator keeps a plain list)."""
    gen = AnchorGenerator([[16.0], [32.0]], [0.5, 1.0, 2.0])
    assert gen.state_dict() == {}
    before = [c.clone() for c in gen.cell_anchors]
    gen.to(torch.float64)
    assert all(c.dtype == torch.float64 for c in gen.cell_anchors)
    assert all(torch.equal(c, b.double()) for c, b in zip(gen.cell_anchors, before))
    gen.to("meta")
    assert all(c.device.type == "meta" for c in gen.cell_anchors)
