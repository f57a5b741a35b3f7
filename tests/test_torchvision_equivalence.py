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
