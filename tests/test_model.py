"""The whole model on configs/tiny_cpu.yaml: training step, gradients, mixed batches,
overfitting, input checks; backbone variants."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torchvision.ops import FrozenBatchNorm2d, box_iou

from detector.config import load_config
from detector.modeling import build_model
from detector.modeling.backbone import build_resnet_fpn
from detector.ops import stem_max_pool

LOSS_KEYS = {"loss_rpn_cls", "loss_rpn_box", "loss_roi_cls", "loss_roi_box"}


@pytest.fixture(scope="module")
def tiny_cpu_cfg(repo_root):
    """configs/tiny_cpu.yaml on purpose: these tests are about the model users train on a
    CPU (the demo's recipe), at its 128..224 px input sizes, which the 128 px hand-made
    images and the overfitting test were set for. (The tests' own tiny model is
    conftest's ``tiny_cfg``/``TINY_CONFIG``.)"""
    return load_config(repo_root / "configs" / "tiny_cpu.yaml")


def shapes_image(h: int = 128, w: int = 128):
    """A flat image with a rectangle (label 1), an ellipse (2) and a triangle (3)."""
    g = torch.Generator().manual_seed(0)
    img = (40 + torch.randint(0, 20, (3, h, w), generator=g)).to(torch.uint8)
    boxes = torch.tensor([[10.0, 12.0, 50.0, 60.0], [60.0, 20.0, 118.0, 50.0], [40.0, 70.0, 100.0, 120.0]])
    labels = torch.tensor([1, 2, 3])
    yy, xx = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    colours = [(220, 40, 40), (40, 220, 40), (40, 40, 220)]
    for (x1, y1, x2, y2), c, lab in zip(boxes.tolist(), colours, labels.tolist()):
        inside = (xx >= x1) & (xx < x2) & (yy >= y1) & (yy < y2)
        if lab == 2:
            inside = ((xx - (x1 + x2) / 2) / ((x2 - x1) / 2)) ** 2 + ((yy - (y1 + y2) / 2) / ((y2 - y1) / 2)) ** 2 <= 1
        elif lab == 3:
            inside &= (xx - x1) / (x2 - x1) <= (yy - y1) / (y2 - y1) + 0.05
        for ch in range(3):
            img[ch][inside] = c[ch]
    return img, {"boxes": boxes, "labels": labels}


def test_one_training_step_losses_and_gradients(tiny_cpu_cfg):
    torch.manual_seed(0)
    assert tiny_cpu_cfg.model.freeze_at == 2  # stem and layer1 frozen
    model = build_model(tiny_cpu_cfg).train()
    img, target = shapes_image()
    losses = model([img], [target])
    assert set(losses) == LOSS_KEYS
    for name, value in losses.items():
        assert value.dim() == 0 and torch.isfinite(value) and value > 0, name
    sum(losses.values()).backward()
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    assert frozen and all(n.startswith(("backbone.body.conv1", "backbone.body.bn1", "backbone.body.layer1"))
                          for n in frozen)
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and torch.isfinite(p.grad).all(), name
            assert p.grad.abs().sum() > 0, name
        else:
            assert p.grad is None, name


def test_mixed_sizes_and_empty_image(tiny_cpu_cfg):
    torch.manual_seed(0)
    model = build_model(tiny_cpu_cfg).train()
    img, target = shapes_image()
    small = torch.randint(0, 255, (3, 70, 100), dtype=torch.uint8)
    floaty = torch.rand(3, 150, 90)  # float images are taken as 0..1
    empty = {"boxes": torch.zeros(0, 4), "labels": torch.zeros(0, dtype=torch.int64)}
    tgt2 = {"boxes": torch.tensor([[5.0, 5.0, 40.0, 30.0]]), "labels": torch.tensor([3])}
    losses = model([img, small, floaty], [target, empty, tgt2])
    assert all(torch.isfinite(v) for v in losses.values())
    sum(losses.values()).backward()
    # Only negatives: all four losses still defined (box losses zero); [0] boxes accepted.
    losses = model([small], [{"boxes": torch.zeros(0), "labels": torch.zeros(0, dtype=torch.int64)}])
    assert losses["loss_rpn_box"].item() == 0.0 and losses["loss_roi_box"].item() == 0.0
    assert losses["loss_rpn_cls"] > 0 and losses["loss_roi_cls"] > 0
    model.eval()
    with torch.no_grad():
        out = model([img, small, floaty])
        batched = model(torch.stack([img, img]))
    assert len(out) == 3 and len(batched) == 2
    for o, (h, w) in zip(out, [(128, 128), (70, 100), (150, 90)]):
        assert set(o) == {"boxes", "scores", "labels"}
        assert o["boxes"].shape[1] == 4 and len(o["boxes"]) <= tiny_cpu_cfg.roi_heads.detections_per_img
        assert (o["boxes"][:, 2] <= w).all() and (o["boxes"][:, 3] <= h).all()
        assert ((o["labels"] >= 1) & (o["labels"] <= 3)).all()
        assert (o["scores"][:-1] >= o["scores"][1:]).all()


@pytest.fixture
def one_thread():
    """The tiny model gains little from intra-op threads; on a shared CPU one thread
    avoids oversubscription (several times faster under load)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.slow
def test_overfit_one_image(tiny_cpu_cfg, one_thread):
    torch.manual_seed(0)
    model = build_model(tiny_cpu_cfg).train()
    img, target = shapes_image()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=0.04, momentum=0.9, weight_decay=1e-4)
    first = None
    for it in range(150):
        # 10 warm-up steps, then 0.04, then 0.004 for the last 40 steps to settle the boxes
        # (min IoU 0.78..0.91 over seeds 0..4).
        for group in opt.param_groups:
            group["lr"] = 0.04 * min(1.0, (it + 1) / 10) * (0.1 if it >= 110 else 1.0)
        loss = sum(model([img], [target]).values())
        opt.zero_grad()
        loss.backward()
        opt.step()
        first = loss.item() if first is None else first
    with torch.no_grad():
        final = sum(model([img], [target]).values()).item()
        model.eval()
        out = model([img])[0]
    assert final < first / 5, (first, final)
    for box, label in zip(target["boxes"], target["labels"]):
        same = out["labels"] == label
        assert same.any(), f"no detection with label {int(label)}"
        assert box_iou(box[None], out["boxes"][same]).max() >= 0.7, int(label)


@pytest.mark.parametrize("case,match", [
    ("x2<=x1", r"image 1: field 'boxes'.*x2 > x1"),
    ("nan", r"image 1: field 'boxes'.*non-finite"),
    ("label0", r"image 1: field 'labels'.*outside 1\.\.3"),
    ("label4", r"image 1: field 'labels'.*outside 1\.\.3"),
    ("gray", r"image 1: field 'image'.*\[3, H, W\]"),
    ("rgba", r"image 1: field 'image'.*\[3, H, W\]"),
])
def test_bad_input_names_image_and_field(tiny_cpu_cfg, case, match):
    model = build_model(tiny_cpu_cfg).train()
    img, target = shapes_image(64, 64)
    bad_img = img
    bad = {"boxes": target["boxes"].clone() / 2, "labels": target["labels"].clone()}
    if case == "x2<=x1":
        bad["boxes"][2, 2] = bad["boxes"][2, 0]
    elif case == "nan":
        bad["boxes"][1, 3] = float("nan")
    elif case == "label0":
        bad["labels"][0] = 0
    elif case == "label4":
        bad["labels"][2] = 4
    elif case == "gray":
        bad_img = img[:1]
    elif case == "rgba":
        bad_img = torch.cat((img, img[:1]))
    with pytest.raises(ValueError, match=match):
        model([img, bad_img], [{"boxes": target["boxes"] / 2, "labels": target["labels"]}, bad])
    if case in ("gray", "rgba"):
        model.eval()
        with pytest.raises(ValueError, match=match):
            model([img, bad_img])


def test_train_mode_needs_targets(tiny_cpu_cfg):
    model = build_model(tiny_cpu_cfg).train()
    with pytest.raises(ValueError, match="targets"):
        model([torch.zeros(3, 32, 32)])


# ---------------------------------------------------------------- backbones


@pytest.mark.parametrize("name,channels", [("resnet18", [64, 128, 256, 512]), ("resnet34", [64, 128, 256, 512]),
                                           ("resnet50", [256, 512, 1024, 2048])])
def test_backbone_channels_and_strides(name, channels):
    bb = build_resnet_fpn(name, norm="frozen_bn", fpn_channels=16)
    assert [blk[0].in_channels for blk in bb.fpn.inner_blocks] == channels
    out = bb(torch.zeros(1, 3, 64, 96))
    assert list(out) == ["0", "1", "2", "3", "pool"]
    assert [tuple(v.shape[-2:]) for v in out.values()] == [(16, 24), (8, 12), (4, 6), (2, 3), (1, 2)]
    assert all(v.shape[1] == 16 for v in out.values())
    assert bb.strides == [4, 8, 16, 32, 64]


@pytest.mark.parametrize("shape", [(2, 3, 7, 9), (1, 2, 8, 8), (1, 1, 1, 1), (1, 1, 2, 3), (2, 4, 33, 50)])
def test_stem_max_pool_equals_max_pool2d(shape):
    torch.manual_seed(0)
    x = torch.randn(shape)
    x[0, 0, 0, 0] = float("nan")  # propagates like max_pool2d's
    x[-1, -1, -1, -1] = float("-inf")
    x[-1, -1, 0] = -1e30  # all-negative rows: padding must not win
    out, ref = stem_max_pool(x), torch.nn.functional.max_pool2d(x, 3, 2, 1)
    assert out.shape == ref.shape
    assert torch.equal(torch.isnan(out), torch.isnan(ref))
    assert torch.equal(out.nan_to_num(0.0), ref.nan_to_num(0.0))


def test_backbone_stem_pool_by_views_only_without_gradient(monkeypatch):
    """The views' pool serves frozen stems and inference; a gradient keeps nn.MaxPool2d
    (whose backward gives a tie to one element). Outputs equal either way."""
    torch.manual_seed(0)
    bb = build_resnet_fpn("resnet18", norm="bn", freeze_at=0, fpn_channels=16).eval()
    x = torch.randn(2, 3, 64, 96)
    calls = []
    monkeypatch.setattr(bb.body.maxpool, "forward", lambda t: calls.append(1) or torch.nn.functional.max_pool2d(t, 3, 2, 1))
    with torch.no_grad():
        fast = bb(x)
    assert calls == []
    slow = bb(x)  # parameters require a gradient: the module's pool
    assert calls == [1]
    for a, b in zip(fast.values(), slow.values()):
        assert torch.equal(a, b)


def test_return_stages_subset():
    bb = build_resnet_fpn("resnet18", norm="frozen_bn", return_stages=[2, 3, 4], fpn_channels=16)
    assert bb.strides == [8, 16, 32, 64] and bb.pooled_levels == ["0", "1", "2"]
    out = bb(torch.zeros(1, 3, 64, 64))
    assert [v.shape[-1] for v in out.values()] == [8, 4, 2, 1]


@pytest.mark.parametrize("norm", ["frozen_bn", "bn", "syncbn", "gn"])
def test_norms_and_conv_bias(norm):
    bb = build_resnet_fpn("resnet18", norm=norm, norm_eps=1e-3, gn_groups=8, freeze_at=2, fpn_channels=32)
    kinds = {type(m) for m in bb.modules()}
    if norm == "frozen_bn":
        assert nn.BatchNorm2d not in kinds
        assert isinstance(bb.body.bn1, FrozenBatchNorm2d) and isinstance(bb.body.layer4[1].bn2, FrozenBatchNorm2d)
        assert bb.body.layer4[1].bn2.eps == 1e-3
        assert all(blk[0].bias is not None for blk in bb.fpn.inner_blocks)  # torchvision layout
    elif norm in ("bn", "syncbn"):
        assert nn.BatchNorm2d in kinds
        # Frozen stages use frozen statistics, trainable ones BatchNorm.
        assert isinstance(bb.body.bn1, FrozenBatchNorm2d) and isinstance(bb.body.layer1[0].bn1, FrozenBatchNorm2d)
        assert isinstance(bb.body.layer2[0].bn1, nn.BatchNorm2d) and bb.body.layer2[0].bn1.eps == 1e-3
        assert isinstance(bb.fpn.inner_blocks[0][1], nn.BatchNorm2d)
        if norm == "syncbn":
            converted = nn.SyncBatchNorm.convert_sync_batchnorm(bb)
            assert any(isinstance(m, nn.SyncBatchNorm) for m in converted.modules())
    else:
        assert nn.GroupNorm in kinds and nn.BatchNorm2d not in kinds
        assert bb.body.layer2[0].bn1.num_groups == 8
    # Every conv directly followed by a norm layer has no bias.
    for seq in list(bb.fpn.inner_blocks) + list(bb.fpn.layer_blocks):
        if len(seq) > 1:
            assert seq[0].bias is None
    for m in bb.body.modules():
        if isinstance(m, nn.Conv2d):
            assert m.bias is None
    trainable = {n.split(".")[1] for n, p in bb.named_parameters() if p.requires_grad and n.startswith("body.")}
    assert trainable == {"layer2", "layer3", "layer4"}


def test_bad_backbone_settings():
    with pytest.raises(ValueError, match="model.norm"):
        build_resnet_fpn("resnet18", norm="ln")
    with pytest.raises(ValueError, match="model.backbone"):
        build_resnet_fpn("resnet7")
    with pytest.raises(ValueError, match="model.freeze_at"):
        build_resnet_fpn("resnet18", freeze_at=6)
    cfg = load_config(None, ["model.backbone=resnet18", "model.fpn_channels=16"])
    cfg.model.return_stages = [3, 4]  # set after loading: build_model checks it too
    with pytest.raises(ValueError, match="model.anchors.sizes"):
        build_model(cfg)


@pytest.mark.parametrize("norm", ["frozen_bn", "gn"])
def test_backbone_weights_by_torchvision_name(monkeypatch, norm):
    """The ImageNet-weights path, with torchvision's download replaced by a local state dict."""
    import torchvision

    torch.manual_seed(0)
    reference = torchvision.models.resnet18()
    with torch.no_grad():
        reference.bn1.running_var.fill_(2.0)

    class FakeWeights:
        def get_state_dict(self, progress=True, check_hash=False):
            return reference.state_dict()

    import detector.modeling.weights as weights_module

    names = []
    monkeypatch.setattr(weights_module, "get_weight", lambda name: names.append(name) or FakeWeights())
    bb = build_resnet_fpn("resnet18", norm=norm, fpn_channels=16, backbone_weights="ResNet18_Weights.IMAGENET1K_V1")
    assert names == ["ResNet18_Weights.IMAGENET1K_V1"]
    torch.testing.assert_close(bb.body.layer3[1].conv2.weight, reference.layer3[1].conv2.weight)
    torch.testing.assert_close(bb.body.layer4[0].bn1.weight, reference.layer4[0].bn1.weight)
    if norm == "frozen_bn":
        assert torch.equal(bb.body.bn1.running_var, torch.full((64,), 2.0))


@pytest.mark.gpu
def test_cuda_train_step_amp_and_eval(tiny_cpu_cfg):
    """CPU inputs to a CUDA model: moved by the model; float16 autocast losses finite;
    eval detections close to the CPU model's."""
    torch.manual_seed(0)
    model = build_model(tiny_cpu_cfg)
    img, target = shapes_image()
    device = torch.device("cuda")
    gpu = build_model(tiny_cpu_cfg)
    gpu.load_state_dict(model.state_dict())
    gpu.to(device).train()
    with torch.autocast("cuda", dtype=torch.float16):
        losses = gpu([img, img], [target, target])
    assert all(v.dtype == torch.float32 and torch.isfinite(v) for v in losses.values())
    sum(losses.values()).backward()
    model.eval()
    gpu.load_state_dict(model.state_dict())
    gpu.eval()
    with torch.no_grad():
        cpu_out = model([img])[0]
        gpu_out = gpu([img])[0]
    assert gpu_out["boxes"].device.type == "cuda"
    n = min(5, len(cpu_out["scores"]))
    torch.testing.assert_close(gpu_out["scores"][:n].cpu(), cpu_out["scores"][:n], atol=1e-3, rtol=0)
