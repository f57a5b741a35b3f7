"""Choosing ``model.canvas_sizes`` (``detector.data.canvas_choice``, ``tools/canvas_sizes.py``):
the padding figures against the model's own ``batch_shape``, the drawn batches against
the loader's sampler and resize, and the chosen sets."""

from __future__ import annotations


import numpy as np
import pytest

from conftest import ROOT, TINY_CONFIG, load_tool, tiny_overrides
from detector.config import load_config
from detector.data.canvas_choice import choose_canvases, draw_batch_shapes, evaluate_canvases
from detector.data.canvases import canvases_that_hold, largest_batches
from detector.data.samplers import GroupedBatchSampler, TrainingSampler, aspect_ratio_group_ids
from detector.data.transforms import resized_shape
from detector.modeling.faster_rcnn import batch_shape

R50 = ROOT / "configs" / "faster_rcnn_r50_fpn_1x_coco.yaml"


def _sizes(seed: int, n: int = 60):
    rng = np.random.default_rng(seed)
    return rng.integers(100, 1500, n), rng.integers(100, 1500, n)


@pytest.mark.parametrize("seed", range(3))
def test_padding_is_the_models_canvas_pixels_over_its_own(seed):
    """For each batch shape the canvas is what ``batch_shape`` picks (the smallest that
    holds it; the shape itself where none does)."""
    rng = np.random.default_rng(seed)
    shapes = rng.integers(1, 40, (500, 2)) * 32
    canvases = [tuple(int(v) for v in c) for c in rng.integers(10, 45, (3, 2)) * 32]
    own = sum(int(h) * int(w) for h, w in shapes)
    picked = [batch_shape([(int(h), int(w))], 32, canvases) for h, w in shapes]
    expected = sum(h * w for h, w in picked) / own - 1
    got = evaluate_canvases(shapes, canvases)
    assert got.padding == pytest.approx(expected, rel=1e-12)
    unheld = np.mean([not any(ch >= h and cw >= w for ch, cw in canvases) for h, w in shapes])
    assert got.unheld == pytest.approx(unheld)


@pytest.mark.parametrize("per_gpu,grouping", [(1, True), (2, True), (3, False)])
def test_drawn_batches_are_the_loaders_batches_padded_to_their_own_shape(per_gpu, grouping):
    """One training scale, so the draw is deterministic: each drawn shape is
    ``batch_shape`` of ``resized_shape`` of the images the loader's sampler batches."""
    heights, widths = _sizes(per_gpu)
    cfg = load_config(R50, [f"solver.images_per_gpu={per_gpu}", f"data.aspect_ratio_grouping={grouping}",
                            "input.min_size_train=[608]"])
    shapes = draw_batch_shapes(heights, widths, cfg, max_batches=150, seed=4)
    groups = aspect_ratio_group_ids((widths / heights).tolist()) if grouping else [0] * len(heights)
    sampler = GroupedBatchSampler(TrainingSampler(len(heights), seed=4), groups, per_gpu)
    expected = []
    epoch = 0
    while len(expected) < 150:
        sampler.set_epoch(epoch)
        expected += [batch_shape([resized_shape(int(heights[k.index]), int(widths[k.index]), 608, 1333)
                                  for k in keys], 32) for keys in sampler]
        epoch += 1
    assert [tuple(s) for s in shapes.tolist()] == expected[:150]


def test_the_chosen_sets_hold_every_batch_and_pad_less_with_each_canvas():
    heights, widths = _sizes(7, 200)
    cfg = load_config(R50, [])
    choices = choose_canvases(heights, widths, cfg, max_canvases=5, max_batches=3000)
    assert choices[0].canvases == [tuple(c) for c in canvases_that_hold(largest_batches(heights, widths, cfg))]
    assert [len(c.canvases) for c in choices] == list(range(len(choices[0].canvases), 6))
    assert all(c.unheld == 0 for c in choices)
    paddings = [c.padding for c in choices]
    assert all(b < a for a, b in zip(paddings, paddings[1:])), paddings
    assert paddings[0] > 0.05  # multi-scale 640..800 into 800 x 1344: much padding to cut


def test_the_tool_prints_the_sets_and_the_configs_own(tiny_data, capsys):
    tool = load_tool("canvas_sizes")
    status = tool.main(["--config", str(TINY_CONFIG), "--max-canvases", "3", "--batches", "500",
                        *tiny_overrides(tiny_data), "model.canvas_sizes=[[64,96]]"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "largest batches (height x width): portrait 96x64, landscape or square 64x96" in out
    assert "[[64, 96], [96, 64]]" in out
    assert "this config's [[64, 96]]: padding" in out and "fit none: train.static_step would stop" in out
    assert out.rstrip().endswith("model.canvas_sizes=[[64,96],[96,64]]")
