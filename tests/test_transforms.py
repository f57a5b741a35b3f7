"""Transforms keep boxes on their objects; resize rule; dropped boxes; scale bookkeeping."""

from __future__ import annotations

import albumentations as A
import numpy as np
import pytest
import torch

from detector.config import load_config
from detector.data.transforms import DetectionTransform, ResizeShortestEdge, build_transforms, resized_shape

COLOURS = np.array([[255, 0, 0], [0, 255, 0], [0, 0, 255]], np.uint8)


def rectangles_image():
    """A 70x110 black image with three filled rectangles of distinct colours, their boxes
    (pixel-exact, continuous coordinates) and labels 1..3."""
    img = np.zeros((70, 110, 3), np.uint8)
    boxes = np.array([[5, 8, 30, 40], [40, 20, 100, 35], [70, 45, 90, 68]], np.float32)
    for (x1, y1, x2, y2), c in zip(boxes.astype(int), COLOURS):
        img[y1:y2, x1:x2] = c
    return img, boxes, np.array([1, 2, 3], np.int64)


def pixel_extent(image_chw: torch.Tensor, colour: np.ndarray) -> np.ndarray:
    """[x1, y1, x2, y2] (continuous) of the pixels that are mostly ``colour``."""
    img = image_chw.permute(1, 2, 0).numpy().astype(np.int32)
    close = np.abs(img - colour.astype(np.int32)).max(axis=2) < 100
    ys, xs = np.nonzero(close)
    return np.array([xs.min(), ys.min(), xs.max() + 1, ys.max() + 1], np.float32)


@pytest.mark.parametrize("min_size,max_size,flip", [(140, 1000, 1.0), (35, 1000, 1.0), (100, 120, 0.0), (64, 200, 1.0)])
def test_boxes_stay_on_their_rectangles(min_size, max_size, flip):
    img, boxes, labels = rectangles_image()
    cfg = load_config(None, [f"input.min_size_train=[{min_size}]", f"input.max_size_train={max_size}",
                             f"input.hflip_prob={flip}"])
    image_t, boxes_t, labels_t = build_transforms(cfg, is_train=True, seed=0)(img, boxes, labels)
    assert image_t.dtype == torch.uint8 and image_t.shape[0] == 3
    h, w = image_t.shape[1:]
    assert (h, w) == resized_shape(70, 110, min_size, max_size)
    assert labels_t.tolist() == [1, 2, 3]
    for box, lab in zip(boxes_t.numpy(), labels_t.tolist()):
        extent = pixel_extent(image_t, COLOURS[lab - 1])
        np.testing.assert_allclose(box, extent, atol=1.0)
    if flip:  # the red rectangle (left) ends up on the right
        assert boxes_t[0, 0] > w / 2


def test_resized_shape_rule():
    # shorter side to s unless the longer side would pass max_size
    assert resized_shape(480, 640, 800, 1333) == (800, 1067)
    assert resized_shape(400, 1000, 800, 1333) == (533, 1333)
    assert resized_shape(100, 100, 64, 1000) == (64, 64)
    assert resized_shape(640, 480, 800, 1333) == (1067, 800)


def test_random_min_size_choice_and_same_seed_same_output():
    img, boxes, labels = rectangles_image()
    cfg = load_config(None, ["input.min_size_train=[40,60,80]", "input.max_size_train=1000"])
    t1, t2 = build_transforms(cfg, True, seed=7), build_transforms(cfg, True, seed=7)
    shorts, flips = set(), set()
    for _ in range(30):
        a, b = t1(img, boxes, labels), t2(img, boxes, labels)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        shorts.add(min(a[0].shape[1:]))
        flips.add(bool(a[1][0, 0] > a[0].shape[2] / 2))
    assert shorts == {40, 60, 80}
    assert flips == {True, False}


def test_keyed_call_is_a_pure_function_of_seed_epoch_and_position():
    img, boxes, labels = rectangles_image()
    cfg = load_config(None, ["input.min_size_train=[40,60,80]", "input.max_size_train=1000", "input.hflip_prob=0.5",
                             "input.color_jitter=true"])
    t1, t2 = build_transforms(cfg, True, seed=11), build_transforms(cfg, True, seed=11)
    ref = t1(img, boxes, labels, key=(3, 17))
    for _ in range(5):  # the pipeline's running stream moves on; a keyed call does not see it
        t2(img, boxes, labels)
    for out in (t1(img, boxes, labels, key=(3, 17)), t2(img, boxes, labels, key=(3, 17))):
        assert all(torch.equal(a, b) for a, b in zip(ref, out))
    # Other epochs, positions or seeds draw anew; the size and the flip are independent draws.
    outs = [t1(img, boxes, labels, key=(e, p)) for e in range(2) for p in range(40)]
    combos = {(min(o[0].shape[1:]), bool(o[1][0, 0] > o[0].shape[2] / 2)) for o in outs}
    assert combos == {(s, f) for s in (40, 60, 80) for f in (True, False)}
    same_epoch_1 = sum(torch.equal(a[0], b[0]) for a, b in zip(outs[:40], outs[40:]))
    assert same_epoch_1 < 10  # colour jitter makes equal draws all but impossible
    t3 = build_transforms(cfg, True, seed=12)
    assert not torch.equal(t3(img, boxes, labels, key=(3, 17))[0], ref[0])


def test_eval_transform_is_deterministic_and_scale_maps_back():
    img, boxes, labels = rectangles_image()
    cfg = load_config(None, ["input.min_size_test=50", "input.max_size_test=1000", "input.hflip_prob=1.0"])
    t = build_transforms(cfg, is_train=False)
    outs = [t(img, boxes, labels) for _ in range(3)]
    for o in outs[1:]:
        assert torch.equal(o[0], outs[0][0]) and torch.equal(o[1], outs[0][1])
    image_t, boxes_t, _ = outs[0]
    h, w = image_t.shape[1:]
    sx, sy = w / 110, h / 70
    np.testing.assert_allclose(boxes_t.numpy() / np.array([sx, sy, sx, sy]), boxes, rtol=1e-5, atol=1e-4)


def test_box_pushed_out_is_dropped_with_its_label():
    img, boxes, labels = rectangles_image()
    # Keep x in [0, 60): the third rectangle (x 70..90) leaves the image.
    t = DetectionTransform([ResizeShortestEdge([70], 1000), A.Crop(x_min=0, y_min=0, x_max=60, y_max=70)])
    image_t, boxes_t, labels_t = t(img, boxes, labels)
    assert image_t.shape == (3, 70, 60)
    assert labels_t.tolist() == [1, 2]
    torch.testing.assert_close(boxes_t, torch.tensor([[5.0, 8.0, 30.0, 40.0], [40.0, 20.0, 60.0, 35.0]]))


def test_image_without_boxes():
    t = DetectionTransform([ResizeShortestEdge([20], 100), A.HorizontalFlip(p=1.0)])
    image_t, boxes_t, labels_t = t(np.zeros((10, 30, 3), np.uint8), np.zeros((0, 4), np.float32), np.zeros(0, np.int64))
    assert image_t.shape == (3, 20, 60) and boxes_t.shape == (0, 4) and labels_t.shape == (0,)


def test_bad_resize_arguments():
    with pytest.raises(ValueError, match=r"positive sizes, got min_sizes=\[0\], max_size=10"):
        ResizeShortestEdge([0], 10)


def test_color_jitter_changes_pixels_not_boxes():
    img, boxes, labels = rectangles_image()
    img = (img // 2 + 60).astype(np.uint8)  # leave room to brighten and darken
    cfg = load_config(None, ["input.min_size_train=[70]", "input.max_size_train=1000", "input.hflip_prob=0",
                             "input.color_jitter=true"])
    t = build_transforms(cfg, is_train=True, seed=3)
    changed = 0
    for _ in range(5):
        image_t, boxes_t, labels_t = t(img, boxes, labels)
        torch.testing.assert_close(boxes_t, torch.from_numpy(boxes))
        changed += int(not torch.equal(image_t, torch.from_numpy(img).permute(2, 0, 1)))
    assert changed >= 3  # p=0.8 per call
