"""``train.cuda_graphs`` in the trainer, proven on the CPU: ``build_trainer(...,
eager_static=True)`` runs the captured step's code path (``GraphedTrainStep`` over
``GuardedStaticStep``: tensor LRs the scheduler fills, device-side skips, the hooks'
device paths) with only the CUDA-graph capture left out. Compared with the eager
static step (``TrainStep``) on the tiny model: same losses, LRs and weights; an exact
resume; non-finite steps skipped and counted on the device; refusals. On CUDA the
capture itself is compared with the eager body (``gpu`` tests)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from detector.config import load_config
from detector.engine.graphed_train_step import GraphedTrainStep, check_graphed_config
from detector.engine.hooks import NonFiniteLossError
from detector.engine.log import read_jsonl
from detector.engine.optim import WarmupLRScheduler
from detector.engine.step import TrainStep
from detector.engine.trainer import build_trainer

from conftest import TINY_CONFIG, tiny_config

STATIC = ["train.static_step=true", "model.canvas_sizes=[[96,96]]", "data.max_gt_per_image=12",
          "rpn.nms_max_iters=4", "solver.max_iter=4", "solver.warmup_iters=3", "solver.steps=[3]"]
GRAPHS = ["train.cuda_graphs=true"]


@pytest.fixture(scope="module")
def data_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("shapes") / "data"  # generated on first use


def run(cfg, resume=None):
    trainer = build_trainer(cfg, resume=resume, eager_static=True)
    try:
        result = trainer.train()
    finally:
        trainer.close()
    return trainer, result


def weights(trainer) -> dict:
    return {k: v.clone() for k, v in trainer.model_without_ddp.state_dict().items()}


def ema_hook(trainer):
    return next(h for h in trainer.hooks if type(h).__name__ == "EMAHook")


def ema_weights(trainer) -> dict:
    return {k: v.clone() for k, v in ema_hook(trainer).ema.module.state_dict().items()}


def nan_backbone(trainer, iterations):
    """The backbone's features become NaN in the forward passes of ``iterations`` (1-based)."""
    calls = {"n": 0}

    def hook(module, inputs, output):
        calls["n"] += 1
        if calls["n"] in iterations:
            return {k: torch.full_like(v, float("nan")) for k, v in output.items()}
        return output

    trainer.model_without_ddp.backbone.register_forward_hook(hook)


def test_graphed_step_trains_like_the_eager_static_step(data_root, tmp_path):
    extra = ["solver.clip_grad_norm=0.5", "train.ema.enabled=true", "train.ema.decay=0.5"]
    eager, res_e = run(tiny_config(data_root, tmp_path / "eager", *STATIC, *extra))
    graphed, res_g = run(tiny_config(data_root, tmp_path / "graphed", *STATIC, *GRAPHS, *extra))
    assert isinstance(eager.step, TrainStep) and isinstance(graphed.step, GraphedTrainStep)
    assert res_e.iteration == res_g.iteration == 4
    re, rg = read_jsonl(tmp_path / "eager" / "metrics.jsonl"), read_jsonl(tmp_path / "graphed" / "metrics.jsonl")
    assert len(re) == len(rg) == 4
    for a, b in zip(re, rg):  # the warmup and the step at 3 change the LR every iteration
        for key in ("total_loss", "loss_rpn_cls", "loss_roi_cls", "grad_norm", "rpn/num_pos_anchors",
                    "roi/fg_fraction", "static/nms_unconverged"):  # losses, sampler statistics, counters
            assert b[key] == pytest.approx(a[key], rel=1e-5), (a["iteration"], key)
        assert b["lr"] == pytest.approx(a["lr"], rel=1e-6) and b["nonfinite_skipped"] == 0
    assert len({r["lr"] for r in rg}) == 4  # the LRs iterations 1-4 used: 3 of the warmup, then the step at 3
    we, wg = weights(eager), weights(graphed)
    for k in we:
        torch.testing.assert_close(wg[k], we[k], rtol=1e-5, atol=1e-6, msg=k)
    ema_e, ema_g = (ema_weights(t) for t in (eager, graphed))  # the EMA: a device-weighted update
    for k in ema_e:
        torch.testing.assert_close(ema_g[k], ema_e[k], rtol=1e-5, atol=1e-6, msg=k)
    lr = graphed.step.optimizer.param_groups[0]["lr"]  # the captured LR: one tensor, filled in place
    assert isinstance(lr, torch.Tensor) and float(lr) == pytest.approx(graphed.step.scheduler.get_last_lr()[0])
    assert float(graphed.step.nonfinite_steps) == 0


def test_graphed_step_resumes_exactly(data_root, tmp_path):
    straight, _ = run(tiny_config(data_root, tmp_path / "a", *STATIC, *GRAPHS))
    cfg = tiny_config(data_root, tmp_path / "b", *STATIC, *GRAPHS, "train.checkpoint_period=2", "solver.max_iter=2")
    run(cfg)
    cfg = tiny_config(data_root, tmp_path / "b", *STATIC, *GRAPHS, "train.checkpoint_period=2")
    resumed, res = run(cfg, resume=str(tmp_path / "b" / "checkpoints" / "iter_0000002.pth"))
    assert res.iteration == 4
    wa, wb = weights(straight), weights(resumed)
    assert all(torch.equal(wa[k], wb[k]) for k in wa), [k for k in wa if not torch.equal(wa[k], wb[k])]
    sa = straight.step.optimizer.state_dict()["state"]
    sb = resumed.step.optimizer.state_dict()["state"]
    assert all(torch.equal(sa[i]["momentum_buffer"], sb[i]["momentum_buffer"]) for i in sa)
    ra, rb = read_jsonl(tmp_path / "a" / "metrics.jsonl"), read_jsonl(tmp_path / "b" / "metrics.jsonl")
    assert [r["total_loss"] for r in ra] == [r["total_loss"] for r in rb]
    assert [r["lr"] for r in ra] == [r["lr"] for r in rb]


def test_a_nonfinite_step_is_skipped_and_counted_on_the_device(data_root, tmp_path):
    cfg = tiny_config(data_root, tmp_path / "n", *STATIC, *GRAPHS, "train.ema.enabled=true")
    trainer = build_trainer(cfg, eager_static=True)
    nan_backbone(trainer, {2})
    before = {}

    class Watch:  # the weights and the EMA before and after the skipped step
        def after_step(self, state):
            if state.iteration in (1, 2):
                before[state.iteration] = (weights(trainer), ema_weights(trainer))

        before_train = after_train = lambda self, state: None

    trainer.hooks.append(Watch())
    try:
        res = trainer.train()
    finally:
        trainer.close()
    assert res.status == "finished" and res.iteration == 4
    for a, b in zip(before[1], before[2]):
        assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]
    recs = read_jsonl(tmp_path / "n" / "metrics.jsonl")
    assert [r["nonfinite_skipped"] for r in recs] == [0, 1, 0, 0]
    assert recs[1]["total_loss"] is None and all(math.isfinite(r["total_loss"]) for r in recs if r is not recs[1])  # NaN: null
    assert float(trainer.step.nonfinite_steps) == 1


def test_nonfinite_steps_in_a_row_stop_at_a_logging_point(data_root, tmp_path):
    cfg = tiny_config(data_root, tmp_path / "k", *STATIC, *GRAPHS, "solver.max_iter=12", "train.log_period=4",
                      "train.max_nonfinite_steps=3")
    trainer = build_trainer(cfg, eager_static=True)
    nan_backbone(trainer, set(range(2, 100)))
    with pytest.raises(NonFiniteLossError) as err:
        trainer.train()
    trainer.close()
    msg = str(err.value)
    assert "3 non-finite losses in a row" in msg and "at iteration 4, seen at iteration 4" in msg, msg
    state = torch.load(tmp_path / "k" / "checkpoints" / "last.pth", weights_only=True)
    assert state["iteration"] == 4
    assert all(torch.isfinite(v).all() for v in state["model"].values() if v.is_floating_point())


def test_a_run_whose_every_step_was_skipped_does_not_finish(data_root, tmp_path):
    """Fewer steps than train.max_nonfinite_steps, all skipped (counted on the device):
    read at the last step, the run stops instead of ending as finished."""
    cfg = tiny_config(data_root, tmp_path / "a", *STATIC, *GRAPHS, "solver.max_iter=3", "train.log_period=10")
    trainer = build_trainer(cfg, eager_static=True)
    nan_backbone(trainer, {1, 2, 3})
    with pytest.raises(NonFiniteLossError, match="all 3 steps of this run .* at iteration 3"):
        trainer.train()
    trainer.close()


def test_scheduler_fills_a_tensor_lr_in_place():
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD([p], lr=0.1, fused=True)
    sched = WarmupLRScheduler(opt, max_iter=10, steps=[5], warmup_iters=2)
    lr = torch.tensor(0.0)
    opt.param_groups[0]["lr"] = lr
    opt.step()
    sched.step()
    assert opt.param_groups[0]["lr"] is lr and float(lr) == pytest.approx(0.1 * sched.factor(1))
    sched.continue_at(6)  # (a resume)
    assert opt.param_groups[0]["lr"] is lr and float(lr) == pytest.approx(0.01)


def test_refusals_name_the_key(data_root, tmp_path):
    cfg = load_config(TINY_CONFIG, STATIC + GRAPHS)
    cpu = torch.device("cpu")
    cases = [
        (dict(cfg=cfg, world_size=1, capture=True), "'train.cuda_graphs' needs a CUDA device"),
        (dict(cfg=cfg, world_size=2), "'train.cuda_graphs' runs on one process, got 2"),
        (dict(cfg=load_config(TINY_CONFIG, STATIC + GRAPHS + ["solver.accumulate_steps=2"]), world_size=1),
         "'solver.accumulate_steps' must be 1"),
        (dict(cfg=load_config(TINY_CONFIG, STATIC + GRAPHS + ["solver.optimizer=adamw"]), world_size=1),
         "'solver.optimizer' must be sgd"),
    ]
    for kwargs, message in cases:
        kwargs = {"device": cpu, "capture": False, **kwargs}
        with pytest.raises(ValueError, match=message):
            check_graphed_config(**kwargs)
    with pytest.raises(ValueError, match="'train.cuda_graphs' needs a CUDA device, got cpu"):
        build_trainer(tiny_config(data_root, tmp_path / "r", *STATIC, *GRAPHS))


@pytest.mark.gpu
def test_captured_trainer_matches_its_eager_run_on_cuda(data_root, tmp_path):
    # The real path (compiled static losses captured with the SGD step) against the same
    # step uncompiled and uncaptured: the same losses within float tolerance.
    cuda = ["train.device=cuda", "train.deterministic=false", "train.amp.enabled=false", "solver.max_iter=3"]
    records = []
    for name, eager in (("eager", True), ("captured", False)):
        trainer = build_trainer(tiny_config(data_root, tmp_path / name, *STATIC, *GRAPHS, *cuda), eager_static=eager)
        try:
            assert trainer.train().iteration == 3 and trainer.step.capture is not eager
        finally:
            trainer.close()
        records.append(read_jsonl(tmp_path / name / "metrics.jsonl"))
    for a, b in zip(*records):
        assert b["total_loss"] == pytest.approx(a["total_loss"], rel=1e-3) and b["nonfinite_skipped"] == 0
