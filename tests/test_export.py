"""tools/export.py and detector.modeling.export: TorchScript and ONNX files give the eager
model's detections on images of two sizes; a tampered file fails the parity check."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
import warnings

import pytest
import torch
import torchvision

import detector.evaluation.export_command as EXPORT  # (its test_images is not a test: not imported by name)
from detector.config import load_config
from detector.modeling import build_model
from detector.modeling.box_coder import clip_boxes
from detector.modeling.export import (
    INSTALL_HINT,
    DetectorForExport,
    compare_detections,
    ExportError,
    export_model,
    require_onnx,
    verify_export,
)
from conftest import load_tool
from conftest import TINY_CONFIG  # noqa: E402

HAS_ORT = importlib.util.find_spec("onnxruntime") is not None and importlib.util.find_spec("onnx") is not None
needs_ort = pytest.mark.skipif(not HAS_ORT, reason=f"onnx/onnxruntime not installed ({INSTALL_HINT})")
OVERRIDES = ["roi_heads.score_thresh=0.35"]


TOOL = load_tool("export")


def tiny_model() -> torch.nn.Module:
    """The tiny test model, random init, with a predictor spread wide enough that a
    handful of detections (a different number per image) pass the 0.35 threshold."""
    torch.manual_seed(0)
    model = build_model(load_config(TINY_CONFIG, OVERRIDES))
    torch.nn.init.normal_(model.roi_heads.box_predictor.cls_score.weight, std=0.1)
    torch.nn.init.normal_(model.roi_heads.box_predictor.bbox_pred.weight, std=0.01)
    return model.eval()


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def images():
    """A generated scene at 64x96 and one at 72x48 (the tool's own test images)."""
    return EXPORT.test_images((64, 96), None)


def check_reports(reports):
    assert [r.image_size for r in reports] == [(64, 96), (72, 48)]
    for r in reports:
        assert r.ok, r.line()
        assert 0 < r.num_eager < 50  # detections survive, fewer than the cap: the count is not baked in
    assert reports[0].num_eager != reports[1].num_eager


def test_clip_boxes_equals_torchvision():
    boxes = torch.tensor([[-5.0, -1.0, 50.0, 30.0], [10.0, 20.0, 130.0, 90.5], [0.0, 0.0, 0.0, 0.0]])
    expected = torchvision.ops.clip_boxes_to_image(boxes, (64, 96))
    assert torch.equal(clip_boxes(boxes, (64, 96)), expected)
    assert torch.equal(clip_boxes(boxes, (torch.tensor(64), torch.tensor(96))), expected)  # as while tracing


def test_compare_detections_tolerances():
    """Boxes within 1e-3 px + 2e-5 x the longer image side, scores within 1e-4, same
    labels, same count; the order of near-equal scores does not matter."""
    boxes = torch.tensor([[10.0, 20.0, 50.0, 60.0], [900.0, 100.0, 1300.0, 700.0]])
    scores, labels = torch.tensor([0.9, 0.8]), torch.tensor([1, 2])
    eager = (boxes, scores, labels)

    def check(b, s=scores, lab=labels, size=(800, 1333)):
        return compare_detections(eager, (b, s, lab), size).ok

    assert check(boxes + 0.0276)  # 1e-3 + 2e-5 * 1333 = 0.02766 px allowed
    assert not check(boxes + 0.0277)
    assert not check(boxes + torch.tensor([[3e-3, 0, 0, 0], [0, 0, 0, 0]]), size=(64, 96))  # 2.92e-3 allowed
    assert check(boxes + torch.tensor([[2.9e-3, 0, 0, 0], [0, 0, 0, 0]]), size=(64, 96))
    assert not check(boxes, scores + torch.tensor([0.0, 2e-4]))
    assert not check(boxes, lab=torch.tensor([1, 3]))
    assert not check(boxes[:1], scores[:1], labels[:1])
    assert check(boxes.flip(0), scores.flip(0), labels.flip(0))  # paired, not row by row


def test_traced_roi_pooling_keeps_per_level_counts_dynamic():
    """Traced with exactly one box on a level, the pooler still takes 0 or 3 there (a
    traced ``out[idx] = pooled`` would bake that single box into the graph)."""
    from detector.modeling.roi_heads import MultiLevelRoIAlign

    pooler = MultiLevelRoIAlign([4, 8], output_size=2, sampling_ratio=2)
    features = [torch.rand(1, 3, 16, 16), torch.rand(1, 3, 8, 8)]
    small, large = [2.0, 2.0, 20.0, 20.0], [0.0, 0.0, 120.0, 120.0]  # levels 0 and 1

    def pool(boxes):
        return pooler(features, [boxes])

    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the deprecation of tracing, torchvision's shape asserts
        traced = torch.jit.trace(pool, (torch.tensor([small, large, small]),), check_trace=False)
        for boxes in ([small, small], [large, small, large, large], [large]):
            boxes = torch.tensor(boxes)
            assert torch.equal(traced(boxes), pool(boxes))


def test_wrapper_is_the_eager_model(model, images):
    """The traceable wrapper computes exactly what model([image]) does, uint8 and float."""
    wrapper = DetectorForExport(model)
    with torch.no_grad():
        for image in images + [images[0].float() / 255]:
            boxes, scores, labels = wrapper(image)
            det = model([image])[0]
            assert torch.equal(boxes, det["boxes"]) and torch.equal(scores, det["scores"])
            assert torch.equal(labels, det["labels"])


def test_torchscript_matches_eager_on_two_sizes(model, images, tmp_path):
    path = tmp_path / "tiny.pt"
    export_model(model, "torchscript", path, images[0])
    check_reports(verify_export(model, "torchscript", path, images))
    # The traced dtype branch: a float 0..1 image gives the same detections.
    scripted = torch.jit.load(str(path))
    with torch.no_grad():
        boxes, scores, _ = scripted(images[1].float() / 255)
        det = model([images[1].float() / 255])[0]
    torch.testing.assert_close(boxes, det["boxes"], atol=1e-3, rtol=0)
    torch.testing.assert_close(scores, det["scores"], atol=1e-4, rtol=0)


@pytest.fixture(scope="module")
def onnx_file(model, images, tmp_path_factory):
    path = tmp_path_factory.mktemp("onnx") / "tiny.onnx"
    export_model(model, "onnx", path, images[0])
    return path


@needs_ort
def test_onnx_matches_eager_on_two_sizes(model, images, onnx_file):
    check_reports(verify_export(model, "onnx", onnx_file, images))


@needs_ort
def test_tampered_onnx_weight_fails_parity(model, images, onnx_file, tmp_path):
    import numpy as np
    import onnx
    from onnx import numpy_helper

    path = tmp_path / "tampered.onnx"
    proto = onnx.load(str(onnx_file))
    (init,) = [i for i in proto.graph.initializer if i.name.endswith("box_predictor.cls_score.bias")]
    bias = numpy_helper.to_array(init).copy()
    bias[3] += np.float32(0.05)  # one class's logit: its scores change (a shift of all would not)
    init.CopyFrom(numpy_helper.from_array(bias, init.name))
    onnx.save(proto, str(path))
    reports = verify_export(model, "onnx", path, images)
    assert not any(r.ok for r in reports)
    assert "MISMATCH" in reports[0].line()


def test_tool_exports_then_rejects_a_tampered_file(model, tmp_path, capsys):
    """End to end: the tool exports and checks; after one weight of the file changes,
    --verify-only exits 1 with one line and no traceback."""
    weights, out = tmp_path / "w.pth", tmp_path / "model.pt"
    torch.save(model.state_dict(), weights)
    argv = ["--config", str(TINY_CONFIG), "--weights", str(weights), "--format",
            "torchscript", "--output", str(out), "--image-size", "64", "96", *OVERRIDES]
    assert TOOL.main([*argv, "--time", "2"]) == 0
    printed = capsys.readouterr().out
    assert "parity ok" in printed and "image 72x48" in printed
    assert "eager: median" in printed and "torchscript: median" in printed and "load average" in printed

    scripted = torch.jit.load(str(out))
    with torch.no_grad():
        scripted.model.roi_heads.box_predictor.cls_score.bias[3] += 0.05
    scripted.save(str(out))
    assert TOOL.main([*argv, "--verify-only"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "does not match the eager model" in err and "MISMATCH" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_one_line_errors(model, images, tmp_path, monkeypatch):
    with pytest.raises(ExportError, match="--format must be one of torchscript, onnx"):
        export_model(model, "tflite", tmp_path / "m", images[0])
    if HAS_ORT:
        with pytest.raises(ExportError, match="--opset must be >= 11"):
            export_model(model, "onnx", tmp_path / "m.onnx", images[0], opset=10)
        # An opset newer than torch's exporter knows (it raised a traceback).
        with pytest.raises(ExportError, match=r"^--opset 1000: torch \S+ cannot export it \(Unsupported "
                                              r"(?i:onnx[_ ]opset[_ ]version): 1000\); use a lower opset \(the "
                                              r"default is 17\)$"):  # torch's words vary by version
            export_model(model, "onnx", tmp_path / "m.onnx", images[0], opset=1000)
        assert not (tmp_path / "m.onnx").exists()
        # An opset the exporter writes but this onnxruntime may not run (RoiAlign(22) in
        # onnxruntime 1.32): the file is written; the check says why it cannot run it.
        try:
            export_model(model, "onnx", tmp_path / "m22.onnx", images[0], opset=22)
        except ExportError as exc:  # an exporter older than opset 22 (torch 2.6): the message above
            assert str(exc).startswith("--opset 22: torch ") and "cannot export it" in str(exc), str(exc)
        try:
            if (tmp_path / "m22.onnx").exists():
                assert all(r.ok for r in verify_export(model, "onnx", tmp_path / "m22.onnx", images))
        except ExportError as exc:
            assert re.fullmatch(rf"onnxruntime \S+ cannot run {re.escape(str(tmp_path))}/m22.onnx \(.*NOT_IMPLEMENTED.*"
                                r"RoiAlign\(22\).*\), so it is not checked: export with a lower --opset \(the default "
                                r"is 17\) to check it here", str(exc)), str(exc)
    with pytest.raises(ExportError, match="exported file not found"):
        verify_export(model, "torchscript", tmp_path / "absent.pt", images)
    (tmp_path / "junk.pt").write_bytes(b"not a model")
    with pytest.raises(ExportError, match="cannot load TorchScript file"):
        verify_export(model, "torchscript", tmp_path / "junk.pt", images)
    # Without the optional extra the message names the install command.
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "onnxruntime" else real_find_spec(name, *a))
    with pytest.raises(ExportError, match=r"needs onnxruntime: pip install -e \"\.\[export\]\""):
        require_onnx()


def test_tool_test_images_from_a_file(images, tmp_path):
    """--image FILE: the image and its top-left 3/4 crop; a missing file is one line."""
    from PIL import Image

    Image.fromarray(images[1].permute(1, 2, 0).numpy()).save(tmp_path / "scene.png")
    full, crop = EXPORT.test_images((1, 1), str(tmp_path / "scene.png"))
    assert torch.equal(full, images[1]) and torch.equal(crop, images[1][:, :54, :36])
    with pytest.raises(FileNotFoundError, match="missing.png"):
        EXPORT.test_images((1, 1), str(tmp_path / "missing.png"))


def test_tool_missing_weights_is_one_line(tmp_path, capsys):
    code = TOOL.main(["--config", str(TINY_CONFIG), "--weights", str(tmp_path / "none.pth"),
                      "--format", "onnx", "--output", str(tmp_path / "m.onnx")])
    err = capsys.readouterr().err
    assert code == 1 and err.startswith("error: ") and "none.pth" in err and len(err.strip().splitlines()) == 1


def test_tool_refuses_soft_nms_naming_the_key(model, tmp_path, capsys):
    """roi_heads.nms.type=soft: a trace would fix Soft-NMS's loop to the example image (the
    second test image then mismatches); export and --verify-only refuse with one line
    naming the key, and write nothing."""
    weights, out = tmp_path / "w.pth", tmp_path / "model.pt"
    torch.save(model.state_dict(), weights)
    argv = ["--config", str(TINY_CONFIG), "--weights", str(weights), "--format", "torchscript",
            "--output", str(out), "--image-size", "64", "96", *OVERRIDES, "roi_heads.nms.type=soft"]
    for extra in ([], ["--verify-only"]):
        assert TOOL.main([*argv, *extra]) == 1
        err = capsys.readouterr().err
        assert err.startswith("error: roi_heads.nms.type=soft cannot be exported") and "nms.type=hard" in err
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
        assert not out.exists()


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


@needs_ort
def test_tool_onnx_file_carries_class_names_and_input_sizes(model, tmp_path, capsys):
    """The ONNX file says what its labels are and how the images were resized (metadata_props)."""
    import onnxruntime

    weights, out = tmp_path / "w.pth", tmp_path / "model.onnx"
    torch.save(model.state_dict(), weights)
    argv = ["--config", str(TINY_CONFIG), "--weights", str(weights), "--format", "onnx", "--output", str(out),
            "--image-size", "64", "96", *OVERRIDES]
    assert TOOL.main(argv) == 0, capsys.readouterr()
    meta = onnxruntime.InferenceSession(str(out), providers=["CPUExecutionProvider"]).get_modelmeta()
    props = meta.custom_metadata_map
    assert json.loads(props["class_names"]) == ["circle", "rectangle", "triangle"] and props["num_classes"] == "3"
    sizes = load_config(TINY_CONFIG).input
    assert (props["min_size_test"], props["max_size_test"]) == (str(sizes.min_size_test), str(sizes.max_size_test))
    assert "uint8" in props["input"]


@pytest.mark.parametrize("args, words", [(["--time", "-1"], "--time must be >= 0, got -1"),
                                         (["--image-size", "0", "64"], "--image-size takes two sides in 1..8192")])
def test_tool_usage_errors_come_before_the_export(tmp_path, capsys, args, words):
    """Checked when the arguments are read: --time -1 was refused only after the export
    and its parity check had run."""
    with pytest.raises(SystemExit) as info:
        TOOL.parse_args(["--config", str(TINY_CONFIG), "--weights", "w.pth", "--format", "onnx",
                         "--output", str(tmp_path / "m.onnx"), *args])
    assert info.value.code == 2 and words in capsys.readouterr().err.strip().splitlines()[-1]


def test_a_parity_check_that_compares_nothing_is_no_pass(model, tmp_path, capsys):
    """No detection on either test image (a 1x1 image, a picture without objects, a score
    threshold nothing passes): 'parity ok' compared nothing; a tampered file passed."""
    weights, out = tmp_path / "w.pth", tmp_path / "model.pt"
    torch.save(model.state_dict(), weights)
    argv = ["--config", str(TINY_CONFIG), "--weights", str(weights), "--format", "torchscript", "--output", str(out),
            "--image-size", "64", "96", *OVERRIDES]
    assert TOOL.main([*argv, "roi_heads.score_thresh=0.999"]) == 1
    err = capsys.readouterr().err
    assert err.strip() == (f"error: {out}: no detections on the test images, so the parity check compared nothing: "
                           "give --image a picture with objects the model finds, or a larger --image-size"), err


@pytest.mark.parametrize("option,value", [("--box-tol", "-1"), ("--box-rtol", "nan"), ("--score-tol", "inf")])
def test_tolerances_are_finite_and_not_negative(option, value, capsys):
    """--box-tol -1 called a correct file a MISMATCH; --score-tol nan passed every score."""
    with pytest.raises(SystemExit) as info:
        TOOL.parse_args(["--config", "c.yaml", "--weights", "w.pth", "--format", "onnx", "--output", "m.onnx",
                         option, value])
    assert info.value.code == 2
    assert capsys.readouterr().err.strip().endswith(f"error: {option} must be a finite number >= 0, got {value}")
