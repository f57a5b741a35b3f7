"""FrozenBatchNorm2d with eps 0.0 (torchvision's COCO weights) never reaches
``F.batch_norm``, which some torch releases (2.11) refuse for eps <= 0, and its output is
bit-identical to torchvision's FrozenBatchNorm2d."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torchvision.ops import FrozenBatchNorm2d as TVFrozenBatchNorm2d

from detector.config import load_config
from detector.modeling import build_model
from detector.modeling.backbone import FrozenBatchNorm2d

# The torchvision-weights layout (FrozenBatchNorm2d, eps 0.0, torchvision's heads) with a
# ResNet-18 body, a narrow FPN and small inputs: the same FrozenBatchNorm2d code path.
TINY_TV_LAYOUT = ["model.backbone=resnet18", "model.fpn_channels=32", "roi_heads.score_thresh=0.0",
                  "input.min_size_test=96", "input.max_size_test=128"]


@pytest.fixture
def batch_norm_refusing_eps_le_0(monkeypatch):
    """``F.batch_norm`` as torch 2.11 has it: a ValueError for eps <= 0."""
    real = F.batch_norm
    calls = []

    def batch_norm(*args, **kwargs):
        eps = kwargs.get("eps", args[7] if len(args) > 7 else 1e-5)
        calls.append(eps)
        if eps <= 0:
            raise ValueError(f"batch_norm eps must be positive, but got {eps}")
        return real(*args, **kwargs)

    monkeypatch.setattr(F, "batch_norm", batch_norm)
    return calls


def randomise_statistics(model: nn.Module) -> None:
    """Non-trivial affine parameters and running statistics in every FrozenBatchNorm2d."""
    g = torch.Generator().manual_seed(0)
    for m in model.modules():
        if isinstance(m, TVFrozenBatchNorm2d):
            for t, lo, hi in ((m.weight, 0.8, 1.2), (m.bias, -0.05, 0.05),
                              (m.running_mean, -0.1, 0.1), (m.running_var, 0.5, 2.0)):
                t.copy_(torch.empty(t.shape).uniform_(lo, hi, generator=g))


def with_torchvision_frozen_bn(module: nn.Module) -> nn.Module:
    """A copy of ``module`` whose FrozenBatchNorm2d layers are torchvision's own."""
    module = copy.deepcopy(module)
    for name, child in list(module.named_modules()):
        for cname, c in list(child.named_children()):
            if isinstance(c, FrozenBatchNorm2d):
                tv = TVFrozenBatchNorm2d(c.weight.numel(), eps=c.eps)
                tv.load_state_dict(c.state_dict())
                setattr(child, cname, tv)
    return module


def test_eps_zero_layer_skips_batch_norm_and_equals_torchvision(batch_norm_refusing_eps_le_0):
    ours = FrozenBatchNorm2d(8, eps=0.0)
    with torch.no_grad():
        randomise_statistics(ours)
    ref = with_torchvision_frozen_bn(nn.Sequential(ours))[0]
    x = torch.randn(2, 8, 5, 7)
    with torch.no_grad():
        assert torch.equal(ours(x), ref(x))
    assert batch_norm_refusing_eps_le_0 == []


def test_positive_eps_keeps_the_fused_kernel(batch_norm_refusing_eps_le_0):
    ours = FrozenBatchNorm2d(8, eps=1e-5)
    with torch.no_grad():
        randomise_statistics(ours)
        x = torch.randn(2, 8, 5, 7)
        torch.testing.assert_close(ours(x), TVFrozenBatchNorm2d.forward(ours, x), rtol=1e-6, atol=1e-6)
    assert batch_norm_refusing_eps_le_0 == [1e-5]


def test_torchvision_layout_model_runs_where_batch_norm_refuses_eps_0(repo_root, batch_norm_refusing_eps_le_0):
    cfg = load_config(repo_root / "configs" / "torchvision_r50_fpn_coco.yaml", TINY_TV_LAYOUT)
    assert cfg.model.norm == "frozen_bn" and cfg.model.norm_eps == 0.0
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    with torch.no_grad():
        randomise_statistics(model)
        model.roi_heads.box_predictor.cls_score.weight.normal_(0, 0.01)
    frozen = [m for m in model.modules() if isinstance(m, FrozenBatchNorm2d)]
    assert len(frozen) == 20 and all(m.eps == 0.0 for m in frozen)  # every norm of a ResNet-18
    reference = with_torchvision_frozen_bn(model)
    image = torch.rand(3, 96, 112, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = model([image])[0]
        expected = reference([image])[0]
    assert len(got["boxes"]) > 0
    for key in ("boxes", "scores", "labels"):
        assert torch.equal(got[key], expected[key]), key
    assert batch_norm_refusing_eps_le_0 == []  # no batch_norm call at all in this model
