"""Test-time augmentation (detector/evaluation/tta.py, eval.tta): box mapping, merging,
plain-inference equality, and the tools."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn

from conftest import TINY_CONFIG
from detector.config import ConfigError, load_config
from detector.data.transforms import build_transforms
from detector.evaluation.inference import predict_image
from detector.evaluation.tta import TTASettings, flip_boxes, merge_detections, tta_forward, tta_settings
from detector.modeling import build_model
from detector.modeling.roi_heads import SoftNMSSettings

ROOT = Path(__file__).resolve().parents[1]


class BrightBlobDetector(nn.Module):
    """A detector with a known answer: one box around the pixels of channel 0 above 128
    (score 0.9, label 1), in the pixels of the image it is given; the post-processing
    settings TTA reads from ``roi_heads``."""

    def __init__(self):
        super().__init__()
        self.roi_heads = nn.Module()
        self.roi_heads.nms_thresh, self.roi_heads.soft_nms, self.roi_heads.detections_per_img = 0.5, None, 100

    def forward(self, images):
        outs = []
        for img in images:
            ys, xs = torch.where(img[0] > 128)
            box = torch.stack([xs.min(), ys.min(), xs.max() + 1, ys.max() + 1]).float()[None]
            outs.append({"boxes": box, "scores": torch.tensor([0.9]), "labels": torch.tensor([1])})
        return outs


def blob_image(h, w, x1, y1, x2, y2):
    img = torch.zeros(3, h, w, dtype=torch.uint8)
    img[:, y1:y2, x1:x2] = 255
    return img


def test_flip_boxes_and_merge_with_known_boxes():
    torch.testing.assert_close(flip_boxes(torch.tensor([[10.0, 20, 30, 40]]), 100.0), torch.tensor([[70.0, 20, 90, 40]]))
    plain = {"boxes": torch.tensor([[10.0, 10, 50, 50], [60.0, 60, 90, 90]]), "scores": torch.tensor([0.9, 0.4]),
             "labels": torch.tensor([1, 2])}
    # The flipped pass on a 100 px wide image, as the model gave it, mapped back by flip_boxes.
    flipped = {"boxes": flip_boxes(torch.tensor([[49.0, 10, 89, 50], [10.0, 60, 40, 90]]), 100.0),
               "scores": torch.tensor([0.8, 0.7]), "labels": torch.tensor([1, 1])}
    torch.testing.assert_close(flipped["boxes"], torch.tensor([[11.0, 10, 51, 50], [60.0, 60, 90, 90]]))
    merged = merge_detections([plain, flipped], nms_thresh=0.5, soft=None, top_k=10)
    # Class 1: the flipped copy of the first box (IoU 0.9) is suppressed; the box at 60..90 of class 1 stays
    # (NMS is per class: the class-2 box at the same place does not suppress it).
    assert merged["labels"].tolist() == [1, 1, 2]
    torch.testing.assert_close(merged["scores"], torch.tensor([0.9, 0.7, 0.4]))
    torch.testing.assert_close(merged["boxes"], torch.tensor([[10.0, 10, 50, 50], [60.0, 60, 90, 90], [60.0, 60, 90, 90]]))
    assert merge_detections([plain, flipped], 0.5, None, top_k=2)["scores"].tolist() == pytest.approx([0.9, 0.7])
    soft = merge_detections([plain, flipped], 0.5, SoftNMSSettings("linear", 0.5, 0.001), top_k=10)
    assert len(soft["scores"]) == 4  # the overlapping copy stays, its score decayed by 1 - IoU
    iou = (39 * 40) / (40 * 40 + 40 * 40 - 39 * 40)
    assert sorted(soft["scores"].tolist(), reverse=True) == pytest.approx([0.9, 0.7, 0.4, 0.8 * (1 - iou)])


@pytest.mark.parametrize("blob", [(10, 20, 30, 40), (25, 10, 55, 50)])  # off-centre, and symmetric in an 80 px width
def test_flip_and_sizes_map_boxes_back(blob):
    net = BrightBlobDetector()
    img = blob_image(60, 80, *blob)
    plain = net([img])[0]["boxes"]
    torch.testing.assert_close(plain, torch.tensor([blob], dtype=torch.float32))
    flip_only = tta_forward(net, [img], [(60, 80)], TTASettings((60,), True, 1000))[0]
    assert len(flip_only["boxes"]) == 1  # the flipped pass's box lands on the plain one, NMS keeps one
    torch.testing.assert_close(flip_only["boxes"], plain)
    # At twice the size the blob is found at twice the coordinates, mapped back to these pixels.
    for size in (120, 30):
        out = tta_forward(net, [img], [(60, 80)], TTASettings((size,), True, 1000))[0]
        torch.testing.assert_close(out["boxes"], plain, atol=1.0 * 60 / size, rtol=0)
    # Given the original image's size, sizes are those of the original: the given image is 1/2 of a 120x160 one.
    out = tta_forward(net, [img], [(120, 160)], TTASettings((120,), False, 1000))[0]
    torch.testing.assert_close(out["boxes"], plain)


def test_one_size_without_flip_equals_plain_inference_and_flip_is_consistent():
    cfg = load_config(TINY_CONFIG, ["roi_heads.score_thresh=0.01"])
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    rng = np.random.default_rng(0)
    half = rng.integers(0, 255, (70, 45, 3), dtype=np.uint8)
    image = np.concatenate([half, half[:, ::-1]], axis=1)  # mirror-symmetric, 70 x 90
    transform = build_transforms(cfg, is_train=False, seed=0)
    plain = predict_image(model, image, transform, score_thresh=0.0)
    assert len(plain["boxes"]) > 0
    # With TTA the eval transform keeps the original size; each pass resizes it.
    keep_size = build_transforms(load_config(TINY_CONFIG, ["eval.tta.sizes=[64]"]), is_train=False, seed=0)
    same = predict_image(model, image, keep_size, 0.0, TTASettings((cfg.input.min_size_test,), False, 96))
    for k in ("boxes", "scores", "labels"):
        assert torch.equal(plain[k], same[k]), k
    flipped = predict_image(model, image, keep_size, 0.0, TTASettings((cfg.input.min_size_test,), True, 96))
    # The flipped input equals the input: the flipped pass's boxes are the plain ones mirrored. Every merged
    # box is a plain box or a mirrored one, with its score and label.
    width = image.shape[1]
    mirrored = flip_boxes(plain["boxes"], float(width))
    candidates = torch.cat([plain["boxes"], mirrored])
    cand_scores = torch.cat([plain["scores"], plain["scores"]])
    cand_labels = torch.cat([plain["labels"], plain["labels"]])
    assert len(flipped["boxes"]) >= len(plain["boxes"]) // 2
    for box, score, label in zip(flipped["boxes"], flipped["scores"], flipped["labels"]):
        hit = ((candidates - box).abs().max(dim=1).values < 1e-3) & (cand_labels == label)
        assert hit.any() and torch.isclose(cand_scores[hit], score, atol=1e-6).any()


def test_a_pass_resizes_the_decoded_image_once():
    """A pass at size s resizes the original image once, with the eval transform's own
    resize: it equals plain inference with input.min_size_test=s exactly, for s above and
    below input.min_size_test (a resize of the eval transform's 64 px output would not).
    A transform that resized the image first is refused, naming eval.tta."""
    torch.manual_seed(0)
    model = build_model(load_config(TINY_CONFIG, ["roi_heads.score_thresh=0.01"])).eval()
    image = np.random.default_rng(1).integers(0, 255, (70, 90, 3), dtype=np.uint8)
    for size in (48, 80):
        plain_cfg = load_config(TINY_CONFIG, [f"input.min_size_test={size}"])
        plain = predict_image(model, image, build_transforms(plain_cfg, is_train=False, seed=0), score_thresh=0.0)
        tta_cfg = load_config(TINY_CONFIG, [f"eval.tta.sizes=[{size}]"])  # input.min_size_test stays 64
        tta = predict_image(model, image, build_transforms(tta_cfg, is_train=False, seed=0), 0.0, tta_settings(tta_cfg))
        assert len(plain["boxes"]) > 0
        for k in ("boxes", "scores", "labels"):
            assert torch.equal(plain[k], tta[k]), (size, k)
    resized_first = build_transforms(load_config(TINY_CONFIG, []), is_train=False, seed=0)
    with pytest.raises(ValueError, match=r"eval.tta: an image of 70x90 arrives resized to 64x82; build the data set"):
        predict_image(model, image, resized_first, 0.0, TTASettings((48,), False, 96))


def test_tta_config_keys():
    assert tta_settings(load_config(None, [])) is None
    cfg = load_config(None, ["eval.tta.sizes=[600,800]", "eval.tta.flip=true", "input.max_size_test=1000"])
    assert tta_settings(cfg) == TTASettings((600, 800), True, 1000)
    with pytest.raises(ConfigError, match=r"config key 'eval.tta.sizes' takes shorter-side sizes >= 1"):
        load_config(None, ["eval.tta.sizes=[0]"])
    with pytest.raises(ConfigError, match=r"config key 'eval.compute_val_loss' cannot be true with eval.tta.sizes"):
        load_config(None, ["eval.tta.sizes=[600]", "eval.compute_val_loss=true"])


def test_infer_tool_with_tta(tmp_path):
    cfg_args = ["roi_heads.score_thresh=0.01", "eval.tta.sizes=[48,64]", "eval.tta.flip=true"]
    torch.manual_seed(0)
    model = build_model(load_config(TINY_CONFIG, cfg_args))
    torch.save(model.state_dict(), tmp_path / "w.pth")
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (70, 90, 3), dtype=np.uint8)).save(tmp_path / "a.png")
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "infer.py"), "--config", str(TINY_CONFIG), "--weights",
                           str(tmp_path / "w.pth"), "--input", str(tmp_path / "a.png"), "--output-dir", str(out),
                           "--score-thresh", "0", *cfg_args], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    rec = json.loads((out / "detections.json").read_text())[0]
    boxes = np.array(rec["boxes"]).reshape(-1, 4)
    assert len(boxes) > 0 and (boxes[:, 2] <= 90 + 1e-6).all() and (boxes[:, 3] <= 70 + 1e-6).all()
    assert len(boxes) <= load_config(TINY_CONFIG, []).roi_heads.detections_per_img


def test_evaluate_with_tta(tmp_path):
    from conftest import tiny_overrides
    from detector.data import build_dataset
    from detector.evaluation import evaluate

    overrides = tiny_overrides(tmp_path / "data", None, "data.shapes.num_train=1", "data.shapes.num_val=3",
                               "roi_heads.score_thresh=0.01", "eval.score_thresh=0.2")
    cfg = load_config(TINY_CONFIG, overrides)
    dataset = build_dataset(cfg, "val", is_train=False)
    torch.manual_seed(0)
    model = build_model(cfg)
    plain = evaluate(model, dataset, cfg, output_dir=tmp_path / "plain")
    same_cfg = load_config(TINY_CONFIG, [*overrides, "eval.tta.sizes=[64]"])  # the data set keeps the original size
    same = evaluate(model, build_dataset(same_cfg, "val", is_train=False), same_cfg, output_dir=tmp_path / "same")
    assert (tmp_path / "plain" / "detections.json").read_text() == (tmp_path / "same" / "detections.json").read_text()
    assert plain["AP"] == same["AP"]
    tta_cfg = load_config(TINY_CONFIG, [*overrides, "eval.tta.sizes=[48,64]", "eval.tta.flip=true"])
    evaluate(model, build_dataset(tta_cfg, "val", is_train=False), tta_cfg, output_dir=tmp_path / "tta")
    dets = json.loads((tmp_path / "tta" / "detections.json").read_text())
    per_image = np.bincount([d["image_id"] for d in dets])
    assert len(dets) > 0 and per_image.max() <= cfg.roi_heads.detections_per_img
    assert dets != json.loads((tmp_path / "plain" / "detections.json").read_text())
