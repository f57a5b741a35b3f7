"""``model.canvas_sizes``: batches padded to a few fixed shapes (issue 15, fixed shapes)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from detector.config import ConfigError, load_config
from detector.data import build_dataset
from detector.data.canvases import (canvases_that_hold, check_canvases, evaluation_batches, largest_batches,
                                   warn_of_evaluation_canvases)
from detector.data.loader import build_test_loader
from detector.engine.trainer import build_trainer
from detector.data.samplers import GroupedBatchSampler, TrainingSampler, aspect_ratio_group_ids
from detector.data.transforms import resized_shape
from detector.modeling import build_model
from detector.modeling.faster_rcnn import batch_shape

from conftest import ROOT, TINY_CONFIG, load_tool, tiny_config, tiny_overrides

# configs/tiny_cpu.yaml on purpose: CANVASES and the batch shapes asserted below are set
# for its input sizes (min 128, max 224 px); tests/configs/tiny.yaml resizes to 64..96.
TINY = ROOT / "configs" / "tiny_cpu.yaml"
CANVASES = [[160, 224], [224, 160], [320, 320]]


def test_batch_shape_without_canvases_rounds_up_to_the_divisibility():
    assert batch_shape([(100, 150), (130, 90)], 32) == (160, 160)
    assert batch_shape([(64, 96)], 32) == (64, 96)


def test_batch_shape_takes_the_smallest_canvas_that_holds_the_batch():
    assert batch_shape([(150, 200)], 32, CANVASES) == (160, 224)  # landscape
    assert batch_shape([(200, 150)], 32, CANVASES) == (224, 160)  # portrait
    assert batch_shape([(200, 200)], 32, CANVASES) == (320, 320)  # fits neither 160-wide one
    assert batch_shape([(64, 64)], 32, [[320, 320], [160, 224]]) == (160, 224)  # smallest area, not first


def test_batch_shape_falls_back_to_its_own_size_when_no_canvas_holds_it():
    assert batch_shape([(400, 100)], 32, CANVASES) == (416, 128)


def test_compile_backbone_needs_canvases():
    """Compiling the backbone without fixed shapes recompiles for every new batch size
    and was slower than eager on both devices measured: refused in one line."""
    with pytest.raises(ConfigError, match="'train.compile_backbone' needs 'model.canvas_sizes'") as err:
        load_config(TINY, ["train.compile_backbone=true"])
    assert "\n" not in str(err.value)
    cfg = load_config(TINY, ["train.compile_backbone=true", f"model.canvas_sizes={CANVASES}"])
    assert cfg.train.compile_backbone


@pytest.mark.parametrize("bad", ["[[100, 224]]", "[[160]]", "[[0, 224]]"])
def test_canvas_sizes_must_be_multiples_of_the_divisibility(bad):
    with pytest.raises(ConfigError, match="model.canvas_sizes"):
        load_config(TINY, [f"model.canvas_sizes={bad}"])


def test_a_canvas_named_twice_is_refused():
    """[[96, 96], [96, 96]] with the static step compiled the one shape twice: a one-step
    tiny run with a cold compile cache took 175 s instead of 44 s on a 2-core CPU.
    Refused in one line naming the canvas."""
    with pytest.raises(ConfigError, match=r"^config key 'model.canvas_sizes' names \[96, 128\] twice$"):
        load_config(TINY, ["model.canvas_sizes=[[96, 128], [128, 96], [96, 128]]"])
    assert load_config(TINY, ["model.canvas_sizes=[[96, 128], [128, 96]]"]).model.canvas_sizes == [[96, 128], [128, 96]]


def _models():
    torch.manual_seed(0)
    plain = build_model(load_config(TINY)).eval()
    canvas = build_model(load_config(TINY, [f"model.canvas_sizes={CANVASES}"])).eval()
    canvas.load_state_dict(plain.state_dict())
    return plain, canvas


def test_canvas_batch_is_the_plain_batch_plus_zero_padding():
    plain, canvas = _models()
    images = [torch.randint(0, 256, (3, 120, 150), dtype=torch.uint8),
              torch.randint(0, 256, (3, 100, 190), dtype=torch.uint8)]
    a, sizes_a = plain.preprocess(images)
    b, sizes_b = canvas.preprocess(images)
    assert tuple(a.shape[-2:]) == (128, 192) and tuple(b.shape[-2:]) == (160, 224)
    assert sizes_a == sizes_b == [(120, 150), (100, 190)]
    assert torch.equal(b[..., :128, :192], a)
    assert b[..., 128:, :].abs().sum() == 0 and b[..., :, 192:].abs().sum() == 0


def test_canvas_detections_stay_inside_the_real_image_and_match_when_the_canvas_is_the_batch():
    plain, canvas = _models()
    torch.manual_seed(1)
    image = torch.rand(3, 150, 200)
    with torch.no_grad():
        det_plain = plain([image])[0]
        det_canvas = canvas([image])[0]
        exact = build_model(load_config(TINY, ["model.canvas_sizes=[[160, 224]]"])).eval()
        exact.load_state_dict(plain.state_dict())
        det_exact = exact([image])[0]  # the canvas is the batch's own padded shape
    boxes = det_canvas["boxes"]
    assert (boxes[:, 0::2] <= 200).all() and (boxes[:, 1::2] <= 150).all() and (boxes >= 0).all()
    for key in ("boxes", "scores", "labels"):
        assert torch.equal(det_exact[key], det_plain[key])


def test_training_on_a_canvas_gives_finite_losses_and_gradients():
    _, canvas = _models()
    canvas.train()
    images = [torch.randint(0, 256, (3, 96, 128), dtype=torch.uint8), torch.randint(0, 256, (3, 128, 96), dtype=torch.uint8)]
    targets = [{"boxes": torch.tensor([[10.0, 10.0, 60.0, 50.0]]), "labels": torch.tensor([1])},
               {"boxes": torch.tensor([[5.0, 20.0, 40.0, 90.0]]), "labels": torch.tensor([2])}]
    losses = canvas(images, targets)
    total = sum(losses.values())
    total.backward()
    assert torch.isfinite(total)
    assert all(torch.isfinite(p.grad).all() for p in canvas.parameters() if p.grad is not None)


# --------------------------------------------------------------------------- do the batches fit? (data.canvases)


@pytest.mark.parametrize("seed", range(6))
def test_the_largest_batches_bound_every_batch_the_loader_forms_and_are_reached(seed):
    """Random image sizes and settings; batches formed by the loader's own sampler
    (``GroupedBatchSampler`` over the aspect groups), each image resized at a random scale
    of ``input.min_size_train`` (``transforms.resized_shape``), padded by the model's
    ``batch_shape``: every batch fits ``canvases_that_hold``, and each largest shape is
    the batch of its named images at the largest scale (so no smaller canvas holds it)."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(3, 40))
    heights, widths = rng.integers(20, 2000, n), rng.integers(20, 2000, n)
    per_gpu, grouping = int(rng.integers(1, 4)), bool(rng.integers(0, 2))
    scales = sorted(rng.choice(np.arange(200, 900, 32), size=int(rng.integers(1, 4)), replace=False).tolist())
    cfg = load_config(TINY, [f"solver.images_per_gpu={per_gpu}", f"data.aspect_ratio_grouping={grouping}",
                             f"input.min_size_train={scales}", f"input.max_size_train={int(rng.integers(900, 1400))}"])
    d, inp = cfg.model.size_divisibility, cfg.input
    batches = largest_batches(heights, widths, cfg)
    canvases = canvases_that_hold(batches)
    groups = aspect_ratio_group_ids((widths / heights).tolist()) if grouping else [0] * n
    sampler = GroupedBatchSampler(TrainingSampler(n, seed=seed), groups, per_gpu)
    for epoch in range(4):
        sampler.set_epoch(epoch)
        for keys in sampler:
            sizes = [resized_shape(int(heights[k.index]), int(widths[k.index]), int(rng.choice(scales)),
                                   inp.max_size_train) for k in keys]
            h, w = batch_shape(sizes, d)
            assert any(ch >= h and cw >= w for ch, cw in canvases), (sizes, canvases)
    for _, h, w, images in batches:
        reached = batch_shape([resized_shape(int(heights[i]), int(widths[i]), max(scales), inp.max_size_train)
                               for i in images], d)
        assert reached == (h, w)


def test_lsj_batches_are_its_square():
    cfg = load_config(TINY, ["input.lsj.enabled=true", "input.lsj.size=200"])
    batches = largest_batches(np.array([30, 900, 500]), np.array([700, 40, 500]), cfg)
    assert canvases_that_hold(batches) == [[224, 224]]


def test_a_static_run_whose_batches_fit_no_canvas_stops_before_the_model_is_built(tiny_data, tmp_path, capsys):
    """The tiny data's images are 64..96 px, both portrait and landscape: a landscape canvas
    alone cannot hold a portrait batch. The run stops with one line naming the key, an
    image and the canvases that fit; with those canvases the check passes."""
    train_tool = load_tool("train")
    out = tmp_path / "run"
    status = train_tool.main(["--config", str(TINY_CONFIG), *tiny_overrides(tiny_data, out),
                              "train.static_step=true", "model.canvas_sizes=[[64,96]]"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert status == 1 and len(err) == 1, err
    line = err[0]
    assert line.startswith("error: model.canvas_sizes [[64, 96]] has no canvas for a batch of 2 images (portrait)")
    assert str(tiny_data / "train") in line and "the static step would stop" in line
    suggested = line.rsplit("model.canvas_sizes=", 1)[1]
    assert suggested == "[[64, 96], [96, 64]]"
    assert not (out / "checkpoints").exists() and not (out / "summary.txt").exists()
    cfg = tiny_config(tiny_data, out, "train.static_step=true", f"model.canvas_sizes={suggested}")
    check_canvases(cfg, build_dataset(cfg, "train", True))  # no error


def test_compile_backbone_with_canvases_that_miss_a_batch_warns(tiny_data, tmp_path, caplog):
    cfg = tiny_config(tiny_data, tmp_path, "train.compile_backbone=true", "model.canvas_sizes=[[64,96]]")
    with caplog.at_level("WARNING", logger="detector.data.canvases"):
        check_canvases(cfg, build_dataset(cfg, "train", True))
    assert "compiles the backbone again" in caplog.text and "model.canvas_sizes=[[64, 96], [96, 64]]" in caplog.text


@pytest.mark.parametrize("per_gpu", [1, 3])
def test_evaluation_batches_are_the_test_loaders_batches(tiny_data, tmp_path, per_gpu):
    """``evaluation_batches`` computes, from the records alone, the padded shape of each
    batch the evaluation loader makes (real images through the eval pipeline)."""
    cfg = tiny_config(tiny_data, tmp_path, f"eval.images_per_gpu={per_gpu}")
    val = build_dataset(cfg, "val", False)
    real = [batch_shape([tuple(img.shape[-2:]) for img in images], cfg.model.size_divisibility)
            for images, _ in build_test_loader(cfg, val, num_workers=0)]
    computed = evaluation_batches(val.records.arrays["heights"], val.records.arrays["widths"], cfg)
    assert [(h, w) for _, h, w, _ in computed] == real and len(real) == -(-len(val) // per_gpu)


def test_compiled_backbone_warns_of_evaluation_batches_that_fit_no_canvas(tiny_data, tmp_path, caplog):
    """Training batches of one orientation fit [[64, 96], [96, 64]], but evaluation
    batches mix portrait and landscape images (96x96): one warning line naming the images
    and canvases that hold them; nothing with those, with one image per batch, or without
    a compiled backbone."""
    two = ["train.compile_backbone=true", "model.canvas_sizes=[[64,96],[96,64]]", "eval.images_per_gpu=2"]
    cfg = tiny_config(tiny_data, tmp_path, *two)
    val = build_dataset(cfg, "val", False)
    with caplog.at_level("WARNING", logger="detector.data.canvases"):
        line = warn_of_evaluation_canvases(cfg, val)
    assert line is not None and "\n" not in line and line in caplog.text
    assert line.startswith("train.compile_backbone: model.canvas_sizes [[64, 96], [96, 64]] has no canvas for ")
    assert "e.g. 96x96 px from " in line and str(tiny_data / "val") in line
    suggested = line.split("Canvases that hold them all: model.canvas_sizes=", 1)[1].split(";", 1)[0]
    assert suggested == "[[64, 96], [96, 64], [96, 96]]"  # the training canvases kept
    assert warn_of_evaluation_canvases(tiny_config(tiny_data, tmp_path, *two[:1], "eval.images_per_gpu=2",
                                                   f"model.canvas_sizes={suggested}"), val) is None
    assert warn_of_evaluation_canvases(tiny_config(tiny_data, tmp_path, *two[:2], "eval.images_per_gpu=1"), val) is None
    assert warn_of_evaluation_canvases(tiny_config(tiny_data, tmp_path, *two[1:]), val) is None


def test_the_trainer_warns_of_evaluation_batches_before_training(tiny_data, tmp_path, caplog):
    cfg = tiny_config(tiny_data, tmp_path / "run", "train.compile_backbone=true", "train.eval_period=2",
                      "model.canvas_sizes=[[64,96],[96,64]]", "eval.images_per_gpu=2")
    with caplog.at_level("WARNING", logger="detector.data.canvases"):
        trainer = build_trainer(cfg)  # the backbone compiles at its first call: not here
    trainer.close()
    assert caplog.text.count("evaluation batches of ") == 1

