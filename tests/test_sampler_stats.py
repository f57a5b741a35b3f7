"""The samplers' statistics (``detector.modeling.training_stats``): equal to references
computed here from torchvision's ``Matcher`` and from the sampled labels and class
logits recorded during the forward pass, for the eager and the static step; means
over micro-batches; written to ``metrics.jsonl`` and TensorBoard by a short training;
no host sync added to the static step; the static step's NMS count logged."""

from __future__ import annotations

import copy
import logging
import math

import pytest
import torch
from torchvision.models.detection._utils import Matcher
from torchvision.ops import box_iou

from benchmarks.static_check import SyncCounter, synthetic_batches
from detector.config import load_config
from detector.engine.hooks import MetricsWriter
from detector.engine.log import EventWriters, JSONLWriter, TensorBoardWriter, read_jsonl
from detector.engine.static_step import StaticForward
from detector.engine.step import TrainStep
from detector.engine.train_loop import LoopState
from detector.engine.trainer import build_trainer
from detector.modeling import build_model

from conftest import TINY_CONFIG

STATIC = ["train.static_step=true", "model.canvas_sizes=[[96,96]]", "data.max_gt_per_image=6"]
STAT_NAMES = ("roi/cls_accuracy", "roi/fg_cls_accuracy", "roi/fg_fraction", "rpn/num_neg_anchors",
              "rpn/num_pos_anchors")


def make_model(seed: int = 0):
    """The tiny model (static-step config) with class logits spread out (random
    weights of std 1), so that the accuracy is neither 0 nor 1."""
    cfg = load_config(TINY_CONFIG, STATIC)
    torch.manual_seed(seed)
    model = build_model(cfg).train()
    torch.nn.init.normal_(model.roi_heads.box_predictor.cls_score.weight, std=1.0)
    return cfg, model


class Recorder:
    """Records, during a training forward: the RPN's inputs (features, padded size,
    targets), the ROI heads' sampled labels and valid masks (``sample_padded``), and the
    class logits (``box_predictor``)."""

    def __init__(self, model) -> None:
        self.model, self.rpn_args, self.sampled, self.logits = model, None, None, None
        heads = model.roi_heads
        sample_padded = heads.sample_padded

        def record_sample(*args):
            out = sample_padded(*args)
            self.sampled = (args, out)
            return out

        heads.sample_padded = record_sample
        model.rpn.register_forward_pre_hook(lambda m, args: setattr(self, "rpn_args", args))
        heads.box_predictor.register_forward_hook(lambda m, args, out: setattr(self, "logits", out[0].detach()))


def reference_rpn_counts(model, features, image_size, targets):
    """Positive and negative anchors per image as the RPN samples them, from
    torchvision's ``Matcher`` (fg >= fg_iou_thresh, bg < bg_iou_thresh, low-quality
    matches) and the sampler's quotas: ``min(#fg, B * frac)`` and ``min(#bg, B - pos)``."""
    rpn = model.rpn
    anchors = torch.cat(rpn.anchor_generator(image_size, [f.shape[-2:] for f in features], features[0].device,
                                             torch.float32))
    matcher = Matcher(rpn.fg_iou_thresh, rpn.bg_iou_thresh, allow_low_quality_matches=True)
    pos, neg = [], []
    for t in targets:
        if t["boxes"].shape[0] == 0:
            fg, bg = 0, anchors.shape[0]
        else:
            matched = matcher(box_iou(t["boxes"], anchors))
            fg, bg = int((matched >= 0).sum()), int((matched == Matcher.BELOW_LOW_THRESHOLD).sum())
        p = min(fg, int(rpn.batch_size_per_image * rpn.positive_fraction))
        pos.append(p)
        neg.append(min(bg, rpn.batch_size_per_image - p))
    return sum(pos) / len(pos), sum(neg) / len(neg)


def reference_roi_stats(model, sampled, logits):
    """Foreground fraction from torchvision's IoU of each candidate (the image's valid
    proposals and its ground truth) and the sampler's quotas; accuracies from the
    recorded class logits and sampled labels, by boolean indexing."""
    (props, props_real, gt_boxes, gt_real, _), (_, labels, _, valid) = sampled
    heads = model.roi_heads
    fg_total = bg_total = 0
    for i in range(props.shape[0]):
        gt = gt_boxes[i][gt_real[i]]
        cand = torch.cat((props[i][props_real[i]], gt))
        best = box_iou(gt, cand).max(0).values if gt.shape[0] else torch.zeros(cand.shape[0])
        fg = int((best >= heads.fg_iou_thresh).sum())
        bg = int(((best >= heads.bg_iou_lo) & (best < heads.bg_iou_hi)).sum())
        f = min(fg, int(heads.batch_size_per_image * heads.positive_fraction))
        fg_total, bg_total = fg_total + f, bg_total + min(bg, heads.batch_size_per_image - f)
    right = logits.argmax(1) == labels
    fg_mask = valid & (labels > 0)
    return {"roi/fg_fraction": fg_total / (fg_total + bg_total),
            "roi/cls_accuracy": right[valid].float().mean().item(),
            "roi/fg_cls_accuracy": right[fg_mask].float().mean().item()}


def check_stats(stats, model, rec, targets):
    assert tuple(sorted(stats)) == STAT_NAMES
    assert all(v.dim() == 0 and not v.requires_grad for v in stats.values())
    features, image_size = rec.rpn_args[0], rec.rpn_args[1]
    pos, neg = reference_rpn_counts(model, features, image_size, targets)
    assert stats["rpn/num_pos_anchors"].item() == pytest.approx(pos)
    assert stats["rpn/num_neg_anchors"].item() == pytest.approx(neg)
    ref = reference_roi_stats(model, rec.sampled, rec.logits)
    for k, v in ref.items():
        assert stats[k].item() == pytest.approx(v, abs=1e-6), k
    assert 0.0 < ref["roi/cls_accuracy"] < 1.0  # (the reference is not trivial)


@pytest.mark.parametrize("seed", [0, 1])
def test_eager_stats_equal_torchvision_matcher_and_recorded_samples(seed):
    cfg, model = make_model(seed)
    rec = Recorder(model)
    images, targets = synthetic_batches(cfg, 1, seed=seed + 5)[0]
    out = model(images, targets)
    assert set(out) == {"loss_rpn_cls", "loss_rpn_box", "loss_roi_cls", "loss_roi_box"}  # the contract
    targets = [{"boxes": t["boxes"].float()} for t in targets]
    check_stats(out.stats, model, rec, targets)


def test_static_step_stats_equal_the_references_and_the_eager_counts():
    cfg, model = make_model(2)
    images, targets = synthetic_batches(cfg, 1, seed=7)[0]
    torch.manual_seed(3)
    eager = model(images, targets).stats
    rec = Recorder(model)
    features = {}
    model.backbone.register_forward_hook(lambda m, args, out: features.update(out=list(out.values()), x=args[0]))
    torch.manual_seed(3)
    static = StaticForward.from_config(model, cfg)(images, targets).stats
    rec.rpn_args = (features["out"], tuple(features["x"].shape[-2:]))  # the static step calls no rpn.forward
    check_stats(static, model, rec, [{"boxes": t["boxes"].float()} for t in targets])
    # Same seed, same samples: the counts agree with the eager model's.
    for k in ("rpn/num_pos_anchors", "rpn/num_neg_anchors", "roi/fg_fraction"):
        assert static[k].item() == eager[k].item(), k


def test_accumulated_stats_are_means_over_micro_batches():
    """Two micro-batches; the second has no ground truth, so its accuracy over the
    foreground is undefined (NaN) and the step's is the first one's."""
    cfg, model = make_model(4)
    ref = copy.deepcopy(model)
    first = synthetic_batches(cfg, 1, seed=11)[0]
    second = (synthetic_batches(cfg, 1, seed=12)[0][0],
              [{"boxes": torch.zeros(0, 4), "labels": torch.zeros(0, dtype=torch.int64)}] * 2)
    torch.manual_seed(9)
    expected = [ref(*first).stats, ref(*second).stats]
    assert math.isnan(expected[1]["roi/fg_cls_accuracy"]) and expected[1]["rpn/num_pos_anchors"] == 0
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    step = TrainStep(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda it: 1.0))
    torch.manual_seed(9)
    result = step.accumulate([first, second])
    assert result.stat_names == STAT_NAMES and result.stats.shape == (5,)
    got = dict(zip(result.stat_names, result.stats.tolist()))
    for k in STAT_NAMES:
        want = expected[0][k].item() if k == "roi/fg_cls_accuracy" else (expected[0][k] + expected[1][k]).item() / 2
        assert got[k] == pytest.approx(want, rel=1e-6), k


@pytest.mark.slow
def test_short_training_writes_stats_to_metrics_and_tensorboard(tiny_cfg, tmp_path):
    # bfloat16 AMP (float16 is refused on a CPU) and two micro-batches per step.
    cfg = tiny_cfg("solver.images_per_gpu=1", "solver.accumulate_steps=2", "solver.max_iter=2",
                   "train.tensorboard=true", "train.amp.enabled=true", "train.amp.dtype=bfloat16",
                   "train.deterministic=false")
    trainer = build_trainer(cfg)
    trainer.train()
    trainer.close()
    records = [r for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if r["type"] == "train"]
    assert [r["iteration"] for r in records] == [1, 2]
    for r in records:
        assert {"rpn/num_pos_anchors", "rpn/num_neg_anchors", "roi/fg_fraction", "roi/cls_accuracy"} <= set(r)
        assert 0 < r["rpn/num_pos_anchors"] and r["rpn/num_pos_anchors"] + r["rpn/num_neg_anchors"] <= 64
        assert 0 < r["roi/fg_fraction"] <= 0.25 and 0 <= r["roi/cls_accuracy"] <= 1
        assert "static/nms_unconverged" not in r  # the eager step has no such counter
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(tmp_path / "run" / "tb"), size_guidance={"scalars": 0})
    ea.Reload()
    for tag in ("rpn/num_pos_anchors", "rpn/num_neg_anchors", "roi/fg_fraction", "roi/cls_accuracy"):
        assert [e.value for e in ea.Scalars(tag)] == pytest.approx([r[tag] for r in records], rel=1e-6), tag


def test_static_step_adds_no_host_sync():
    """A TrainStep with the (eager) static forward over two micro-batches, then the
    metrics hook between logging points: the only host reads are the batches' host-side
    preparation and the step's one flags read-back."""
    cfg, model = make_model(5)
    forward = StaticForward.from_config(model, cfg)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    step = TrainStep(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda it: 1.0), forward=forward)
    hook = MetricsWriter(100, opt, EventWriters(), torch.device("cpu"), counters=forward.counters())
    state = LoopState(max_iter=100)
    batches = synthetic_batches(cfg, 2, seed=3)
    step.accumulate(batches)  # warm-up (first calls may set things up)
    with SyncCounter() as prep:
        for b in batches:
            forward.batch(*b)
    with SyncCounter() as flags:
        (torch.zeros(3) > 0).tolist()
    with SyncCounter() as total:
        state.step = step.accumulate(batches)
        state.iteration, state.batch_images = 1, 4
        hook.after_step(state)
    assert state.step.stat_names == STAT_NAMES
    assert total.count == prep.count + flags.count, (total.names, prep.names)


def test_static_step_logs_nms_unconverged(tmp_path, caplog):
    """With one NMS iteration the proposal NMS cannot converge: the records hold the
    growth of the device count, and each grown record warns naming rpn.nms_max_iters."""
    cfg = load_config(TINY_CONFIG, STATIC + ["rpn.nms_max_iters=1"])
    torch.manual_seed(0)
    model = build_model(cfg).train()
    forward = StaticForward.from_config(model, cfg)
    opt = torch.optim.SGD(model.parameters(), lr=0.001)
    step = TrainStep(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda it: 1.0), forward=forward)
    writers = EventWriters(JSONLWriter(tmp_path / "metrics.jsonl"), TensorBoardWriter(tmp_path / "tb"))
    hook = MetricsWriter(2, opt, writers, torch.device("cpu"), counters=forward.counters())
    state = LoopState(max_iter=4)
    hook.before_train(state)
    with caplog.at_level(logging.WARNING, logger="detector.engine"):
        for i, b in enumerate(synthetic_batches(cfg, 4, seed=1)):
            state.step, state.iteration, state.batch_images = step(*b), i + 1, 2
            hook.after_step(state)
    writers.close()
    records = read_jsonl(tmp_path / "metrics.jsonl")
    counts = [r["static/nms_unconverged"] for r in records]
    assert len(counts) == 2 and sum(counts) == int(forward.nms_unconverged) and all(c > 0 for c in counts)
    warnings = [r.getMessage() for r in caplog.records if "rpn.nms_max_iters" in r.getMessage()]
    assert len(warnings) == 2 and f"converge {counts[0]} times" in warnings[0] and "(now 1)" in warnings[0]
    assert all("\n" not in line for line in warnings)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0})
    ea.Reload()
    assert [e.value for e in ea.Scalars("static/nms_unconverged")] == counts
    assert [e.value for e in ea.Scalars("roi/fg_fraction")] == pytest.approx([r["roi/fg_fraction"] for r in records])


def test_trainer_gives_the_static_steps_counter_to_the_metrics(tiny_cfg):
    trainer = build_trainer(tiny_cfg(*STATIC))
    try:
        writer = next(h for h in trainer.hooks if isinstance(h, MetricsWriter))
        assert [c.name for c in writer.counters] == ["static/nms_unconverged"]
        assert writer.counters[0].value is trainer.step.forward.nms_unconverged
    finally:
        trainer.close()
