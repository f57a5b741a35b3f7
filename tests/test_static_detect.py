"""Inference with fixed shapes (``eval.static``, ``modeling.static_detect``,
``evaluation.static_inference``): the eager forward's detections to the bit, no host
read inside a batch, the candidate cut flagged, the config's refusals, and (CUDA) the
captured graphs."""

from __future__ import annotations

import logging

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.static_check import SyncCounter
from detector.config import ConfigError, load_config
from detector.evaluation.inference import run_inference
from detector.evaluation.static_inference import StaticDetector, StaticSettings
from detector.modeling import build_model
from detector.modeling.static_detect import detections_list, static_detect

from conftest import TINY_CONFIG
from test_static_step import random_batch

CANVAS = "model.canvas_sizes=[[96,96]]"


def eval_model(*overrides: str, logit_scale: float = 200.0):
    """The tiny model in eval mode; its class logits scaled so that the random weights
    give scores on both sides of the threshold (a random head scores every class ~1/4)."""
    cfg = load_config(TINY_CONFIG, ["model.num_classes=3", CANVAS, *overrides])
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    with torch.no_grad():
        model.roi_heads.box_predictor.cls_score.weight.mul_(logit_scale)
    return model


def static_of(model, images, max_candidates: int = 4096):
    with torch.no_grad():
        batch, sizes = model.preprocess(images)
        return static_detect(model, batch, torch.tensor(sizes, device=batch.device), max_candidates)


def assert_equal_detections(eager, static, prefix: bool = False, tol: float = 0.0):
    """The same detections per image (all of them, or ``static``'s as a prefix of
    ``eager``'s); boxes and scores equal, or within ``tol`` relative."""
    assert len(eager) == len(static)
    for e, s in zip(eager, static):
        n = len(s["boxes"]) if prefix else len(e["boxes"])
        assert len(s["boxes"]) == n and torch.equal(e["labels"][:n], s["labels"])
        for key in ("boxes", "scores"):
            torch.testing.assert_close(e[key][:n], s[key], rtol=tol, atol=tol, msg=key)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("seed,thresh", [(1, 0.05), (2, 0.3), (3, 0.7)])
def test_static_detections_equal_the_eager_forward(seed, thresh, device):
    model = eval_model(f"roi_heads.score_thresh={thresh}").to(device)
    images, _ = random_batch(seed, images=3)
    with torch.no_grad():
        eager = model(images)
    dets = static_of(model, images)
    assert_equal_detections(eager, detections_list(dets))
    counts = [len(e["boxes"]) for e in eager]
    assert 0 < max(counts) < model.roi_heads.detections_per_img, counts  # the threshold decided
    assert not dets.truncated.any() and not dets.nms_unconverged.any()


def test_cut_candidates_keep_the_eager_prefix_and_flag_the_image():
    model = eval_model("roi_heads.score_thresh=0.01", logit_scale=1.0)
    images, _ = random_batch(4, images=3)
    with torch.no_grad():
        eager = model(images)
    full = static_of(model, images)
    cut = static_of(model, images, max_candidates=60)  # 200 proposals x 3 classes pass the threshold
    assert_equal_detections(eager, detections_list(cut), prefix=True)
    kept = cut.valid.sum(1)
    assert torch.equal(cut.truncated, kept < model.roi_heads.detections_per_img)
    assert cut.truncated.any() and not full.truncated.any()
    generous = static_of(model, images, max_candidates=150)  # the cut lands after the 50th kept box
    assert_equal_detections(eager, detections_list(generous))


class HostData(TorchDispatchMode):
    """Names the operators that bring host data into a tensor (``torch.tensor`` of Python
    values, a copy to another device): on CUDA each is a host-to-device copy, which a
    CUDA graph cannot capture."""

    def __init__(self) -> None:
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default) or (
                func == torch.ops.aten._to_copy.default and "device" in kwargs):
            self.names.append(str(func))
        return func(*args, **kwargs)


def test_a_batch_reads_nothing_on_the_host_and_copies_nothing_to_the_device():
    model = eval_model()
    images, _ = random_batch(5, images=2)
    with torch.no_grad():
        batch, sizes = model.preprocess(images)
        sizes = torch.tensor(sizes)
        with SyncCounter() as eager, HostData() as eager_data:
            model(images)
        with SyncCounter() as static, HostData() as static_data:
            static_detect(model, batch, sizes, 4096)
    assert eager.count > 0 and eager_data.names  # the counters see the eager forward's
    assert static.count == 0, static.names
    assert not static_data.names


def test_run_inference_with_eval_static_scores_as_eager(caplog):
    model = eval_model("roi_heads.score_thresh=0.01", logit_scale=1.0)
    loader = []
    for seed in (8, 9):
        images, targets = random_batch(seed, images=2)
        loader.append((images, [{"image_id": t["image_id"] + 10 * seed, "orig_size": im.shape[-2:], "scale": (1.0, 1.0)}
                                for t, im in zip(targets, images)]))
    ids = {1: 1, 2: 2, 3: 3}
    eager = run_inference(model, loader, ids, progress=False)
    static = run_inference(model, loader, ids, progress=False, static=StaticSettings())
    assert eager.image_ids == static.image_ids
    for field in ("image_id", "bbox", "score", "category_id"):
        assert (getattr(eager.detections, field) == getattr(static.detections, field)).all(), field
    assert len(eager.detections.score) == 4 * model.roi_heads.detections_per_img
    with caplog.at_level(logging.WARNING):
        run_inference(model, loader, ids, progress=False, static=StaticSettings(max_candidates=60))
    assert "4 image(s) had more than eval.static_candidates=60 candidates" in caplog.text


@pytest.mark.parametrize("overrides,key", [
    (["eval.static=true"], "'eval.static' needs 'model.canvas_sizes'"),
    ([CANVAS, "eval.cuda_graphs=true"], "'eval.cuda_graphs' needs 'eval.static: true'"),
    ([CANVAS, "eval.static=true", "roi_heads.nms.type=soft"], "roi_heads.nms.type=soft"),
    ([CANVAS, "eval.static=true", "eval.tta.sizes=[96]"], "eval.tta.sizes"),
    (["eval.static_candidates=0"], "eval.static_candidates"),
])
def test_config_refuses_what_static_inference_cannot_do(overrides, key):
    with pytest.raises(ConfigError, match=key.replace("[", r"\[")):
        load_config(TINY_CONFIG, ["model.num_classes=3", *overrides])


def test_cuda_graphs_need_a_cuda_device():
    with pytest.raises(ValueError, match="'eval.cuda_graphs' needs a CUDA device, got cpu"):
        StaticDetector(eval_model(), StaticSettings(capture=True))


@pytest.mark.gpu
@pytest.mark.parametrize("amp", [False, True])
def test_captured_graphs_give_the_eager_static_detections(amp):
    """Each batch shape's graph replays the eager static batch (bfloat16 autocast too),
    in any order over graphs that share one memory pool, and a replay leaves the
    detections handed out before it untouched; a batch that fits no canvas runs uncaptured."""
    model = eval_model().cuda()
    eager_detector = StaticDetector(model, StaticSettings())
    graphed = StaticDetector(model, StaticSettings(capture=True))
    sizes = (2, 1, 2, 1, 1, 2)  # two graphs (2 images, 1 image), replayed alternately
    batches = [[im.cuda() for im in random_batch(10 + i, images=n)[0]] for i, n in enumerate(sizes)]
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
        first = graphed(batches[0])
        kept = [{k: v.clone() for k, v in d.items()} for d in first]
        for images in batches:  # (the same kernels: equal but for atomics' order, if any)
            assert_equal_detections(eager_detector(images), graphed(images), tol=1e-5)
        large = [torch.randint(0, 256, (3, 120, 100), dtype=torch.uint8, device="cuda")]  # fits no canvas
        assert_equal_detections(eager_detector(large), graphed(large), tol=1e-5)
    assert_equal_detections(kept, first)
    assert len(graphed.graphs) == 2 and graphed.uncaptured_shapes == {(128, 128)}
