"""Large-scale jitter and copy-paste: boxes follow the pixels, a sample is a function of
its key (seed, epoch, position) whatever the number of workers, and a short LSJ +
copy-paste run resumes exactly."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from detector.config import ConfigError, load_config
from detector.data import build_dataset, build_train_loader
from detector.data.copy_paste import CopyPasteSettings, paste_objects
from detector.data.transforms import DetectionTransform, LargeScaleJitter
from detector.engine.trainer import build_trainer
from conftest import ROOT, tiny_config

LSJ_CONFIG = ROOT / "configs" / "faster_rcnn_r50_fpn_lsj_coco.yaml"
COLORS = {1: (255, 0, 0), 2: (0, 255, 0), 3: (0, 0, 255)}


def _picture(h: int, w: int, boxes, labels) -> np.ndarray:
    """A grey image with a filled rectangle of the label's colour per (integer) box."""
    img = np.full((h, w, 3), 128, np.uint8)
    for (x1, y1, x2, y2), lab in zip(boxes, labels):
        img[int(y1):int(y2), int(x1):int(x2)] = COLORS[lab]
    return img


def _pixels_of(image: torch.Tensor, label: int) -> np.ndarray:
    """Bool [H, W]: pixels of exactly the label's colour."""
    return (image.permute(1, 2, 0).numpy() == np.array(COLORS[label], np.uint8)).all(axis=-1)


def _assert_boxes_cover_their_pixels(image, boxes, labels, tol=1.5):
    """Every pixel of a label's colour lies in a box of that label (``tol`` px for the
    interpolated edges), and every box holds pixels of its colour."""
    for lab in COLORS:
        ys, xs = np.nonzero(_pixels_of(image, lab))
        own = boxes[labels == lab].numpy()
        for b in own:
            inside = (xs + 0.5 >= b[0] - tol) & (xs + 0.5 <= b[2] + tol) & (ys + 0.5 >= b[1] - tol) & (ys + 0.5 <= b[3] + tol)
            assert inside.any(), (lab, b)
        if len(xs):
            assert len(own), f"pixels of label {lab} without a box"
            covered = np.zeros(len(xs), bool)
            for b in own:
                covered |= (xs + 0.5 >= b[0] - tol) & (xs + 0.5 <= b[2] + tol) & (ys + 0.5 >= b[1] - tol) & (ys + 0.5 <= b[3] + tol)
            assert covered.all(), f"label {lab}: {int((~covered).sum())} pixels outside its boxes"


def test_lsj_boxes_follow_the_pixels_and_fall_out_with_their_labels():
    boxes = np.array([[30, 20, 70, 50], [4, 60, 20, 76]], np.float32)
    labels = np.array([1, 2])
    image = _picture(80, 120, boxes, labels)
    t = DetectionTransform([LargeScaleJitter(96, 0.3, 2.0)], seed=5)
    dropped = 0
    for position in range(40):
        img, out_boxes, out_labels = t(image, boxes, labels, key=(0, position))
        assert img.shape == (3, 96, 96)
        assert len(out_boxes) == len(out_labels) <= 2
        dropped += 2 - len(out_boxes)
        _assert_boxes_cover_their_pixels(img, out_boxes, out_labels)
    assert dropped > 0  # at scales near 2 the crop leaves boxes out: dropped, labels too
    # Small scales pad: the bottom-right is zeros.
    img, _, _ = DetectionTransform([LargeScaleJitter(96, 0.3, 0.3)], seed=5)(image, boxes, labels, key=(0, 0))
    assert (img[:, 40:, :] == 0).all() and (img[:, :, 40:] == 0).all()


def _source(n: int = 6, k: int = 1):
    """n pictures with k coloured rectangles each, as a copy-paste source."""
    rng = np.random.default_rng(0)
    items = []
    for _ in range(n):
        x1 = rng.integers(0, 60, k)
        y1 = rng.integers(0, 40, k)
        b = np.stack([x1, y1, x1 + rng.integers(10, 40, k), y1 + rng.integers(10, 30, k)], 1).astype(np.float32)
        lab = rng.integers(1, 4, k)
        items.append((_picture(80, 100, b, lab), b, lab))
    return items


def test_paste_adds_boxes_and_drops_or_shrinks_the_covered_ones():
    image = np.full((60, 60, 3), 128, np.uint8)
    boxes = np.array([[10, 10, 20, 20], [30, 10, 50, 30]], np.float32)
    src = np.full((60, 60, 3), 7, np.uint8)
    src_boxes = np.array([[8, 8, 22, 22], [30, 10, 40, 30]], np.float32)  # covers box 0, half of box 1
    out, b, lab = paste_objects(image, boxes, np.array([1, 2]), src, src_boxes, np.array([3, 3]),
                                np.random.default_rng(0), max_objects=2, min_visible=0.3)
    assert (out[8:22, 8:22] == 7).all() and (out[10:30, 30:40] == 7).all() and (out[10:30, 40:50] == 128).all()
    np.testing.assert_array_equal(lab, [2, 3, 3])  # box 0 hidden: dropped; box 1 shrunk
    np.testing.assert_allclose(b, [[40, 10, 50, 30], [8, 8, 22, 22], [30, 10, 40, 30]])


def test_copy_paste_keeps_boxes_on_their_pixels_and_is_a_function_of_the_key():
    """One rectangle per source image (so a pasted box region holds one object) and
    ``min_visible`` near 0 (so a box stays while any of it shows): then every pixel of a
    colour lies in a box of its label, and every box holds pixels of its colour."""
    items = _source()
    t = DetectionTransform([LargeScaleJitter(96, 0.5, 1.5)], seed=3,
                           copy_paste=CopyPasteSettings(prob=1.0, max_objects=3, min_visible=1e-3))
    t.set_source(lambda i: items[i], len(items))
    grew = 0
    for position in range(30):
        img, boxes, labels = t(*items[position % len(items)], key=(1, position))
        _assert_boxes_cover_their_pixels(img, boxes, labels)
        again = t(*items[position % len(items)], key=(1, position))
        assert torch.equal(img, again[0]) and torch.equal(boxes, again[1]) and torch.equal(labels, again[2])
        grew += len(boxes) > len(items[position % len(items)][1])
    assert grew > 0
    other = t(*items[0], key=(2, 0))
    assert not torch.equal(other[0], t(*items[0], key=(1, 0))[0])


@pytest.fixture(scope="module")
def data_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("shapes") / "data"


def _lsj_overrides(size: int = 64):
    """The LSJ recipe's augmentation keys (from its config), at a tiny size."""
    recipe = yaml.safe_load(LSJ_CONFIG.read_text())["input"]
    lsj, cp = recipe["lsj"], recipe["copy_paste"]
    assert lsj["enabled"] and cp["enabled"]
    return ["input.lsj.enabled=true", f"input.lsj.min_scale={lsj['min_scale']}", f"input.lsj.max_scale={lsj['max_scale']}",
            f"input.lsj.size={size}", "input.copy_paste.enabled=true", f"input.copy_paste.prob={cp['prob']}",
            f"input.copy_paste.max_objects={cp['max_objects']}"]


def test_lsj_config_loads_and_names_its_source():
    first = LSJ_CONFIG.read_text().splitlines()[0]
    assert first.startswith("#") and "torchvision" in first
    cfg = load_config(LSJ_CONFIG)
    assert cfg.input.lsj.enabled and cfg.input.copy_paste.enabled and cfg.input.lsj.size == 1024
    with pytest.raises(ConfigError, match="input.lsj.min_scale"):
        load_config(LSJ_CONFIG, ["input.lsj.min_scale=3.0"])
    with pytest.raises(ConfigError, match="input.copy_paste.prob"):
        load_config(LSJ_CONFIG, ["input.copy_paste.prob=1.5"])


def test_lsj_copy_paste_samples_do_not_depend_on_workers(data_root):
    cfg = tiny_config(data_root, None, *_lsj_overrides(), "data.aspect_ratio_grouping=false")
    ds = build_dataset(cfg, "train", True)
    batches = []
    for workers in (0, 2):
        loader = build_train_loader(cfg, ds, num_workers=workers)
        loader.batch_sampler.set_epoch(1)
        batches.append(list(loader))
    assert len(batches[0]) == len(batches[1]) > 0
    for (ia, ta), (ib, tb) in zip(*batches):
        for x, y in zip(ia, ib):
            assert x.shape == (3, 64, 64) and torch.equal(x, y)
        for x, y in zip(ta, tb):
            assert torch.equal(x["boxes"], y["boxes"]) and torch.equal(x["labels"], y["labels"])


@pytest.mark.slow
def test_lsj_copy_paste_run_trains_and_resumes_exactly(data_root, tmp_path):
    aug = _lsj_overrides()
    a = build_trainer(tiny_config(data_root, tmp_path / "a", *aug))
    res = a.train()
    a.close()
    assert res.status == "finished" and res.iteration == 6
    cfg_b = tiny_config(data_root, tmp_path / "b", "train.checkpoint_period=3", "solver.max_iter=6", *aug)
    b = build_trainer(cfg_b)
    b.train()
    b.close()
    b2 = build_trainer(cfg_b, resume=str(tmp_path / "b" / "checkpoints" / "iter_0000003.pth"))
    assert b2.iteration == 3
    b2.train()
    b2.close()
    wa = a.model_without_ddp.state_dict()
    wb = b2.model_without_ddp.state_dict()
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], msg=k)
