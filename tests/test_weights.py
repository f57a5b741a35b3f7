"""load_weights: prefixes, num_batches_tracked, pre-v2 names, class-count changes, reports."""

from __future__ import annotations

import pytest
import torch

from detector.config import load_config
from detector.modeling.weights import LoadReport, WeightsError, load_weights
from detector.modeling import build_model


def tiny(repo_root, *overrides):
    # configs/tiny_cpu.yaml on purpose: the mismatch cases below are written against its
    # 64-channel FPN (a 32-channel one is the "wrong architecture"; tests/configs/tiny.yaml
    # has 32 channels itself).
    return build_model(load_config(repo_root / "configs" / "tiny_cpu.yaml", list(overrides)))


def tiny_seeded(repo_root, seed, *overrides):
    torch.manual_seed(seed)
    return tiny(repo_root, *overrides)


def assert_same_weights(a, b, skip=()):
    sa, sb = a.state_dict(), b.state_dict()
    for k in sa:
        if not k.startswith(skip):
            torch.testing.assert_close(sa[k], sb[k], rtol=0, atol=0, msg=k)


def test_module_prefix_and_training_checkpoint_file(repo_root, tmp_path):
    torch.manual_seed(0)
    src = tiny(repo_root)
    torch.manual_seed(1)
    dst = tiny(repo_root)
    state = {"module." + k: v for k, v in src.state_dict().items()}
    path = tmp_path / "ckpt.pth"
    torch.save({"model": state, "iteration": 7}, path)
    report = load_weights(dst, path)
    assert isinstance(report, LoadReport)
    assert not report.missing and not report.unexpected and not report.skipped
    assert len(report.loaded) == len(src.state_dict())
    assert_same_weights(src, dst)
    # A plain state dict works too; build_model itself never loads model.weights.
    torch.save(src.state_dict(), tmp_path / "plain.pth")
    torch.manual_seed(1)
    built = tiny(repo_root, f"model.weights={tmp_path / 'plain.pth'}")
    assert_same_weights(tiny_seeded(repo_root, 1), built)
    load_weights(built, tmp_path / "plain.pth", strict=True)
    assert_same_weights(src, built)


def test_num_batches_tracked_tolerated(repo_root):
    bn = tiny(repo_root, "model.norm=bn")
    state = {k: v for k, v in bn.state_dict().items() if not k.endswith("num_batches_tracked")}
    assert len(state) < len(bn.state_dict())
    report = load_weights(tiny(repo_root, "model.norm=bn"), state)
    assert report.missing == []
    extra = dict(tiny(repo_root, "model.norm=frozen_bn").state_dict())
    extra["backbone.body.bn1.num_batches_tracked"] = torch.tensor(5)
    report = load_weights(tiny(repo_root, "model.norm=frozen_bn"), extra)
    assert report.unexpected == [] and report.missing == []


def test_pre_v2_names_are_renamed(repo_root):
    torch.manual_seed(0)
    src = tiny(repo_root, "model.norm=frozen_bn")
    old = {}
    for k, v in src.state_dict().items():
        k = k.replace("rpn.head.conv.0.0.", "rpn.head.conv.")
        for block in ("inner_blocks", "layer_blocks"):
            for i in range(4):
                k = k.replace(f"backbone.fpn.{block}.{i}.0.", f"backbone.fpn.{block}.{i}.")
        old[k] = v
    assert "rpn.head.conv.weight" in old and "backbone.fpn.inner_blocks.0.weight" in old
    torch.manual_seed(1)
    dst = tiny(repo_root, "model.norm=frozen_bn")
    report = load_weights(dst, old)
    assert len(report.renamed) == 2 + 2 * 4 * 2
    assert report.renamed["backbone.fpn.layer_blocks.3.bias"] == "backbone.fpn.layer_blocks.3.0.bias"
    assert not report.missing and not report.unexpected
    assert_same_weights(src, dst)


def test_other_class_count_keeps_fresh_predictor(repo_root):
    torch.manual_seed(0)
    src = tiny(repo_root, "model.num_classes=7")
    torch.manual_seed(1)
    dst = tiny(repo_root)
    fresh = {k: v.clone() for k, v in dst.state_dict().items() if k.startswith("roi_heads.box_predictor.")}
    report = load_weights(dst, src.state_dict())
    assert sorted(report.skipped) == sorted(fresh)
    assert any("8 classes" in n and "4" in n for n in report.notes)
    assert not report.missing and not report.unexpected
    assert_same_weights(src, dst, skip=("roi_heads.box_predictor.",))
    for k, v in fresh.items():
        assert torch.equal(dst.state_dict()[k], v)


def test_reports_missing_unexpected_and_shape_errors(repo_root, tmp_path):
    model = tiny(repo_root)
    state = dict(model.state_dict())
    del state["rpn.head.cls_logits.bias"]
    state["something.else"] = torch.zeros(2)
    report = load_weights(tiny(repo_root), state)
    assert report.missing == ["rpn.head.cls_logits.bias"]
    assert report.unexpected == ["something.else"]
    assert "1 missing" in report.summary()
    state = dict(model.state_dict())
    state["rpn.head.bbox_pred.weight"] = torch.zeros(4, 64, 1, 1)
    with pytest.raises(ValueError, match="rpn.head.bbox_pred.weight"):
        load_weights(tiny(repo_root), state)
    with pytest.raises(WeightsError, match="nope.pth: no such file"):
        load_weights(model, tmp_path / "nope.pth")
    torch.save([1, 2, 3], tmp_path / "list.pth")
    with pytest.raises(ValueError, match="not a state dict"):
        load_weights(model, tmp_path / "list.pth")


def test_strict_refuses_missing_unexpected_and_other_class_counts(repo_root):
    model = tiny(repo_root)
    state = dict(model.state_dict())
    del state["rpn.head.cls_logits.bias"]
    state["something.else"] = torch.zeros(2)
    with pytest.raises(WeightsError, match=r"^run.pth: does not fit the model .*1 model keys missing from the file, "
                                           r"e.g. \['rpn.head.cls_logits.bias'\].*1 file keys not in the model"):
        load_weights(tiny(repo_root), state, strict=True, name="run.pth")
    other = tiny(repo_root, "model.num_classes=7").state_dict()
    with pytest.raises(WeightsError, match="predictor has 8 classes .* the model 4; set model.num_classes"):
        load_weights(tiny(repo_root), other, strict=True)


def test_wrong_architecture_names_the_first_mismatched_keys_and_shapes(repo_root, tmp_path):
    wide = tiny(repo_root, "model.fpn_channels=32")
    torch.save({"model": wide.state_dict()}, tmp_path / "wide.pth")
    with pytest.raises(WeightsError) as e:
        load_weights(tiny(repo_root), tmp_path / "wide.pth")
    msg = str(e.value)
    assert msg.startswith(f"{tmp_path / 'wide.pth'}: does not fit the model") and "\n" not in msg
    assert "tensors differ in shape, e.g. backbone.fpn." in msg and "[32," in msg and "in the model" in msg
    torch.save({"conv.weight": torch.zeros(3, 3)}, tmp_path / "alien.pth")
    with pytest.raises(WeightsError, match="alien.pth: does not fit the model .*file keys not in the model"):
        load_weights(tiny(repo_root), tmp_path / "alien.pth")


def test_another_head_with_the_same_class_count_is_not_blamed_on_the_classes(repo_root, tmp_path):
    """A box head of another width (representation_size: an R50 state dict in a small
    config) changes cls_score's input size only: the message named the class counts,
    'the source predictor has 4 classes, the model 4; set model.num_classes'."""
    wide = tiny(repo_root, "roi_heads.representation_size=48")
    torch.save(wide.state_dict(), tmp_path / "head.pth")
    with pytest.raises(WeightsError) as e:
        load_weights(tiny(repo_root), tmp_path / "head.pth", strict=True)
    msg = str(e.value)
    assert "num_classes" not in msg and "differ in shape" in msg and "roi_heads.box_" in msg, msg


def test_weights_with_another_normalisation_say_that_theirs_is_used(repo_root, tmp_path, caplog):
    """model.pixel_mean / pixel_std of the config were replaced by the weights' buffers
    without a word (config.yaml then named values the model did not use)."""
    torch.save(tiny(repo_root).state_dict(), tmp_path / "w.pth")
    other = tiny(repo_root, "model.pixel_mean=[0.1,0.1,0.1]")
    with caplog.at_level("WARNING", logger="detector"):
        load_weights(other, tmp_path / "w.pth", strict=True)
    assert "the weights' pixel_mean [0.485, 0.456, 0.406] replace model.pixel_mean [0.1, 0.1, 0.1]" in caplog.text
    assert "pixel_std" not in caplog.text  # the same: nothing said
    assert torch.allclose(other.pixel_mean.flatten(), torch.tensor([0.485, 0.456, 0.406]))
