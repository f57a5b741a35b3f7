"""configs/torchvision_r50_fpn_coco.yaml + load_weights reproduces torchvision's
fasterrcnn_resnet50_fpn: same parameter names and shapes, same detections."""

from __future__ import annotations

import pytest
import torch
import torchvision
from torchvision.ops import box_iou

from functools import partial

from torchvision.models.detection import FasterRCNN
from torchvision.models.detection.backbone_utils import resnet_fpn_backbone
from torchvision.ops import FrozenBatchNorm2d

from detector.config import load_config
from detector.engine.optim import build_lr_scheduler, build_optimizer
from detector.modeling.weights import load_weights
from detector.modeling import build_model

OVERRIDES = ["roi_heads.score_thresh=0.0", "model.norm_eps=1e-5"]  # torchvision without weights: eps 1e-5


def redraw_predictor(model) -> None:
    """Re-draw the predictor with a spread that gives spread scores and moved boxes (the
    backbone's random features are large; the default init saturates the softmax)."""
    with torch.no_grad():
        model.roi_heads.box_predictor.cls_score.weight.normal_(0, 0.01)
        model.roi_heads.box_predictor.bbox_pred.weight.normal_(0, 0.005)


def torchvision_model(seed: int = 0):
    """torchvision's model built without weights: BatchNorm2d (eps 1e-5) in eval mode."""
    torch.manual_seed(seed)
    model = torchvision.models.detection.fasterrcnn_resnet50_fpn(
        weights=None, weights_backbone=None, box_score_thresh=0.0)
    redraw_predictor(model)
    return model.eval()


def torchvision_coco_layout_model(seed: int = 1):
    """What ``fasterrcnn_resnet50_fpn(weights=COCO_V1)`` builds before loading the weights:
    FrozenBatchNorm2d with eps 0.0, layer2..4 trainable; here with random non-trivial
    BatchNorm statistics and affine parameters instead of the downloaded ones."""
    torch.manual_seed(seed)
    backbone = resnet_fpn_backbone(backbone_name="resnet50", weights=None,
                                   norm_layer=partial(FrozenBatchNorm2d, eps=0.0), trainable_layers=3)
    model = FasterRCNN(backbone, num_classes=91, box_score_thresh=0.0)
    redraw_predictor(model)
    with torch.no_grad():
        for m in model.backbone.body.modules():
            if isinstance(m, FrozenBatchNorm2d):
                m.weight.uniform_(0.8, 1.2)
                m.bias.uniform_(-0.05, 0.05)
                m.running_mean.uniform_(-0.1, 0.1)
                m.running_var.uniform_(0.5, 2.0)
    return model.eval()


def sample_image() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    image = torch.rand(3, 800, 800, generator=g)  # torchvision leaves 800 x 800 as it is
    image[:, 200:500, 100:400] *= 0.3  # some structure for varied proposals
    return image


def our_model(repo_root, state, overrides=OVERRIDES):
    model = build_model(load_config(repo_root / "configs" / "torchvision_r50_fpn_coco.yaml", overrides))
    report = load_weights(model, state)
    assert not report.missing and not report.unexpected and not report.skipped
    return model.eval()


def test_state_dict_names_and_shapes_equal_torchvision(repo_root):
    ours = build_model(load_config(repo_root / "configs" / "torchvision_r50_fpn_coco.yaml")).state_dict()
    theirs = torchvision.models.detection.fasterrcnn_resnet50_fpn(weights=None, weights_backbone=None).state_dict()
    ours = {k: tuple(v.shape) for k, v in ours.items() if k not in ("pixel_mean", "pixel_std")}
    theirs = {k: tuple(v.shape) for k, v in theirs.items() if not k.endswith("num_batches_tracked")}
    assert ours == theirs


def paired(a: dict, b: dict):
    """Pair each detection of ``a`` with the same-label detection of ``b`` of highest IoU."""
    iou = box_iou(a["boxes"], b["boxes"])
    iou[a["labels"][:, None] != b["labels"][None, :]] = -1.0
    best, j = iou.max(dim=1)
    return best, j


def assert_same_detections(a: dict, b: dict, box_tol: float = 1e-3, score_tol: float = 1e-4):
    assert len(a["boxes"]) == len(b["boxes"]) > 10
    best, j = paired(a, b)
    assert j.unique().numel() == len(j)  # a one-to-one pairing
    assert (best > 0.99).all()
    assert torch.equal(a["labels"], b["labels"][j])
    assert (a["boxes"] - b["boxes"][j]).abs().max() <= box_tol
    assert (a["scores"] - b["scores"][j]).abs().max() <= score_tol


@pytest.mark.slow
def test_detections_equal_torchvision(repo_root, tmp_path):
    tv = torchvision_model()
    image = sample_image()
    with torch.no_grad():
        expected = tv([image])[0]
    assert expected["scores"].max() - expected["scores"].min() > 0.05  # spread scores

    state = tv.state_dict()
    ours = our_model(repo_root, state)
    with torch.no_grad():
        got = ours([image])[0]
    assert_same_detections(expected, got)

    # The same weights saved with torchvision's pre-v2 key names.
    old = {}
    for k, v in state.items():
        k = k.replace("rpn.head.conv.0.0.", "rpn.head.conv.")
        for block in ("inner_blocks", "layer_blocks"):
            for i in range(4):
                k = k.replace(f"backbone.fpn.{block}.{i}.0.", f"backbone.fpn.{block}.{i}.")
        old[k] = v
    assert "backbone.fpn.inner_blocks.2.weight" in old
    torch.save(old, tmp_path / "pre_v2.pth")
    ours_old = our_model(repo_root, str(tmp_path / "pre_v2.pth"))
    with torch.no_grad():
        got_old = ours_old([image])[0]
    assert_same_detections(expected, got_old)


@pytest.mark.slow
def test_detections_equal_torchvision_coco_layout(repo_root):
    """FrozenBatchNorm2d with eps 0.0 (torchvision's COCO_V1 model) against the config as
    it is (norm_eps 0.0), with non-trivial BatchNorm statistics. With eps 0 our
    FrozenBatchNorm2d multiplies and adds as torchvision's does (torch 2.11 refuses
    ``F.batch_norm`` with eps 0), so the detections are bit-identical."""
    tv = torchvision_coco_layout_model()
    image = sample_image()
    with torch.no_grad():
        expected = tv([image])[0]
    ours = our_model(repo_root, tv.state_dict(), overrides=["roi_heads.score_thresh=0.0"])
    with torch.no_grad():
        got = ours([image])[0]
    assert_same_detections(expected, got, box_tol=0.0, score_tol=0.0)


# --------------------------------------------------------------------------- training

BIG = 10**7  # sampler sizes that take every anchor and every proposal: no sampling randomness
TRAIN_OVERRIDES = [
    "model.norm_eps=1e-5",  # torchvision's FrozenBatchNorm2d default
    f"rpn.batch_size_per_image={BIG}",
    f"roi_heads.batch_size_per_image={BIG}",
]


def torchvision_train_model(height: int, width: int, post_nms_topk: int = 2000, seed: int = 0):
    """torchvision's FasterRCNN with a ResNet-50-FPN of FrozenBatchNorm2d (eps 1e-5),
    layer2..4 trainable, 91 classes, every other argument at its default except the
    sampler sizes (take everything) and the resize, which is set to leave a
    ``height x width`` image as it is (scale factor exactly 1)."""
    torch.manual_seed(seed)
    backbone = resnet_fpn_backbone(backbone_name="resnet50", weights=None,
                                   norm_layer=FrozenBatchNorm2d, trainable_layers=3)
    model = FasterRCNN(backbone, num_classes=91, min_size=min(height, width), max_size=max(height, width),
                       rpn_batch_size_per_image=BIG, box_batch_size_per_image=BIG,
                       rpn_post_nms_top_n_train=post_nms_topk)
    with torch.no_grad():
        for m in model.backbone.body.modules():  # non-trivial frozen statistics
            if isinstance(m, FrozenBatchNorm2d):
                m.weight.uniform_(0.8, 1.2)
                m.bias.uniform_(-0.05, 0.05)
                m.running_mean.uniform_(-0.1, 0.1)
                m.running_var.uniform_(0.5, 2.0)
        model.roi_heads.box_predictor.cls_score.weight.normal_(0, 0.01)
        model.roi_heads.box_predictor.bbox_pred.weight.normal_(0, 0.01)  # a box loss well above 0
    return model.train()


def train_batch(height: int, width: int):
    """Two images with some structure and targets of three classes."""
    g = torch.Generator().manual_seed(0)
    images = [torch.rand(3, height, width, generator=g) for _ in range(2)]
    images[0][:, 50:150, 40:200] *= 0.3
    targets = [
        {"boxes": torch.tensor([[40.0, 50.0, 200.0, 150.0], [10.0, 20.0, 60.0, 90.0]]), "labels": torch.tensor([1, 18])},
        {"boxes": torch.tensor([[100.0, 70.0, 220.0, 150.0]]), "labels": torch.tensor([62])},
    ]
    return images, targets


TV_LOSS_NAMES = {"loss_objectness": "loss_rpn_cls", "loss_rpn_box_reg": "loss_rpn_box",
                 "loss_classifier": "loss_roi_cls", "loss_box_reg": "loss_roi_box"}


def our_train_model(repo_root, tv, overrides=()):
    cfg = load_config(repo_root / "configs" / "torchvision_r50_fpn_coco.yaml", TRAIN_OVERRIDES + list(overrides))
    model = build_model(cfg)
    report = load_weights(model, tv.state_dict())
    assert not report.missing and not report.unexpected and not report.skipped
    return cfg, model.train()


def test_config_box_losses_are_torchvisions(repo_root):
    """torchvision: smooth_l1_loss(beta=1/9) in both heads, i.e. sigma 3."""
    cfg = load_config(repo_root / "configs" / "torchvision_r50_fpn_coco.yaml")
    assert cfg.rpn.sigma == 3.0 and cfg.roi_heads.sigma == 3.0


@pytest.mark.slow
def test_training_losses_equal_torchvision(repo_root):
    """Same weights, image and targets, samplers that take everything: the four losses
    of the config equal torchvision's to 1e-5 relative (with ``roi_heads.sigma=1`` the
    ROI box loss would be off by about 25 %)."""
    h, w = 200, 300
    tv = torchvision_train_model(h, w)
    _, ours = our_train_model(repo_root, tv)
    images, targets = train_batch(h, w)
    with torch.no_grad():
        expected = tv([im.clone() for im in images[:1]], [dict(targets[0])])
        got = ours([im.clone() for im in images[:1]], [dict(targets[0])])
    for theirs, name in TV_LOSS_NAMES.items():
        assert float(expected[theirs]) > 1e-4, theirs  # every loss takes part
        assert float(got[name]) == pytest.approx(float(expected[theirs]), rel=1e-5), name


@pytest.mark.slow
def test_training_iteration_equals_torchvision_reference(repo_root):
    """One iteration from the config (its optimizer and LR schedule: ``build_optimizer``,
    ``build_lr_scheduler``, the summed losses) against torchvision's references/detection
    loop on the same batch: SGD(lr, momentum 0.9, weight decay 1e-4) over every trainable
    parameter, ``LinearLR(start_factor=1/1000, total_iters=1000)`` warmup, ``sum(losses)``.

    Float32 limits how closely an update of ~1e-5 can be compared through the updated
    parameters (their rounding is ~3e-8), so the update is checked three ways: the
    updated parameters to 1e-5, the whole update vector to 1e-2 of its norm (a wrong LR,
    warmup factor, momentum rule or trainable set is off by far more), and the
    optimizer's per-parameter settings against the reference's (weight decay on every
    parameter: at this LR its effect on one step is below float32 resolution)."""
    h, w = 160, 224
    tv = torchvision_train_model(h, w, post_nms_topk=500)
    lr = 0.02
    cfg, ours = our_train_model(repo_root, tv, ["rpn.post_nms_topk_train=500", f"solver.lr={lr}",
                                                "solver.scale_lr=false"])
    before = {k: v.detach().clone() for k, v in tv.named_parameters()}
    images, targets = train_batch(h, w)

    # torchvision's references/detection/train.py + engine.train_one_epoch (epoch 0)
    params = [p for p in tv.parameters() if p.requires_grad]
    tv_opt = torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=1e-4, nesterov=False)
    tv_sched = torch.optim.lr_scheduler.LinearLR(tv_opt, start_factor=1.0 / 1000, total_iters=1000)
    loss_dict = tv([im.clone() for im in images], [dict(t) for t in targets])
    tv_loss = sum(loss for loss in loss_dict.values())
    tv_opt.zero_grad()
    tv_loss.backward()
    tv_opt.step()
    tv_sched.step()

    # ours
    opt = build_optimizer(ours, cfg)
    sched = build_lr_scheduler(opt, cfg)
    losses = ours([im.clone() for im in images], [dict(t) for t in targets])
    loss = torch.stack([losses[k].float() for k in sorted(losses)]).sum()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    sched.step()

    assert float(loss.detach()) == pytest.approx(float(tv_loss.detach()), rel=1e-5)
    theirs = dict(tv.named_parameters())
    mine = dict(ours.named_parameters())
    assert {k for k, p in mine.items() if p.requires_grad} == {k for k, p in theirs.items() if p.requires_grad}
    for group in opt.param_groups:  # the reference: one group, every parameter decayed
        assert (group["momentum"], group["weight_decay"], group["nesterov"], group["dampening"]) == (0.9, 1e-4, False, 0)
    step_tv, step_ours = [], []
    for k, p in theirs.items():
        if not p.requires_grad:
            assert torch.equal(mine[k].detach(), before[k]), k
            continue
        torch.testing.assert_close(mine[k].detach(), p.detach(), rtol=0, atol=1e-5, msg=k)
        step_tv.append((p.detach() - before[k]).flatten())
        step_ours.append((mine[k].detach() - before[k]).flatten())
    step_tv, step_ours = torch.cat(step_tv), torch.cat(step_ours)
    assert step_tv.abs().max() > 1e-6  # the step moved the weights
    assert float((step_ours - step_tv).norm() / step_tv.norm()) < 1e-2
    # The LR of the following iterations: the warmup ramp of LinearLR.
    for _ in range(5):
        assert [g["lr"] for g in opt.param_groups] == pytest.approx([tv_opt.param_groups[0]["lr"]] * len(opt.param_groups), rel=1e-9)
        sched.step()
        tv_sched.step()
