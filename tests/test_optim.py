"""Parameter groups, differential LR, frozen parameters, LR schedule and scaling."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from torch import nn

from detector.config import load_config
from detector.engine.optim import (
    build_lr_scheduler,
    build_optimizer,
    build_param_groups,
    lr_factor,
    scaled_lr,
)
from detector.modeling import build_model

from conftest import TINY_CONFIG  # noqa: E402
RULES = "solver.param_groups=[{match: backbone.body, lr_mult: 0.1}, {match: roi_heads.box_predictor, lr_mult: 10, weight_decay_mult: 0}]"


def _cfg(*overrides: str):
    return load_config(TINY_CONFIG, [RULES, "model.freeze_at=2", "model.norm=bn", *overrides])


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return build_model(_cfg())


def test_groups_hold_exactly_the_trainable_parameters_once(model):
    cfg = _cfg("solver.weight_decay=0.01", "solver.weight_decay_norm=0.0", "solver.bias_lr_mult=2.0")
    opt = build_optimizer(model, cfg)
    in_opt = [p for g in opt.param_groups for p in g["params"]]
    assert len(in_opt) == len({id(p) for p in in_opt})  # each once
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    frozen = {id(p) for p in model.parameters() if not p.requires_grad}
    assert frozen, "freeze_at=2 must freeze the stem and layer1"
    assert {id(p) for p in in_opt} == trainable
    names = {id(p): n for n, p in model.named_parameters()}
    by_group = {g["name"]: g for g in opt.param_groups}
    for g in opt.param_groups:
        for p in g["params"]:
            n = names[id(p)]
            if "backbone.body" in n:
                assert g["name"].startswith("backbone.body")
            elif "roi_heads.box_predictor" in n:
                assert g["name"].startswith("roi_heads.box_predictor")
            else:
                assert g["name"].startswith("default")
    base = cfg.solver.lr
    assert by_group["backbone.body"]["lr"] == pytest.approx(0.1 * base)
    assert by_group["roi_heads.box_predictor"]["lr"] == pytest.approx(10 * base)
    assert by_group["roi_heads.box_predictor"]["weight_decay"] == 0.0
    assert by_group["default"]["lr"] == pytest.approx(base) and by_group["default"]["weight_decay"] == 0.01
    assert by_group["default/bias"]["lr"] == pytest.approx(2 * base)
    assert by_group["backbone.body/norm"]["weight_decay"] == 0.0


def test_frozen_parameters_bit_identical_after_10_steps(model):
    cfg = _cfg("solver.weight_decay=0.1", "solver.momentum=0.9")
    m = build_model(cfg)
    frozen = {n: p.detach().clone() for n, p in m.named_parameters() if not p.requires_grad}
    trainable = {n: p.detach().clone() for n, p in m.named_parameters() if p.requires_grad}
    opt = build_optimizer(m, cfg)
    sched = build_lr_scheduler(opt, cfg)
    g = torch.Generator().manual_seed(0)
    for _ in range(10):
        for p in m.parameters():  # a gradient on every parameter, frozen ones included
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
        sched.step()
    now = dict(m.named_parameters())
    assert all(torch.equal(now[n], v) for n, v in frozen.items())
    assert all(not torch.equal(now[n], v) for n, v in trainable.items())


def test_ddp_prefix_is_ignored_by_rules(model):
    class Wrapper(nn.Module):  # names like DistributedDataParallel's: "module.<name>"
        def __init__(self, m):
            super().__init__()
            self.module = m

    groups = build_param_groups(Wrapper(model), _cfg(), base_lr=1.0)
    assert {g["name"].split("/")[0] for g in groups} == {"backbone.body", "roi_heads.box_predictor", "default"}


def test_rule_matching_nothing_warns(model, caplog):
    cfg = _cfg("solver.param_groups=[{match: no_such_module, lr_mult: 3}]")
    with caplog.at_level(logging.WARNING, logger="detector.engine.optim"):
        build_param_groups(model, cfg, 1.0)
    assert "no_such_module" in caplog.text


@pytest.mark.parametrize("schedule", ["multistep", "cosine"])
def test_lr_ratios_hold_through_warmup_and_decay(model, schedule):
    cfg = _cfg(f"solver.schedule={schedule}", "solver.max_iter=100", "solver.warmup_iters=20",
               "solver.steps=[60,80]", "solver.warmup_factor=0.01", "solver.cosine_final_lr_factor=0.05")
    opt = build_optimizer(model, cfg)
    sched = build_lr_scheduler(opt, cfg)
    base = [g["initial_lr"] for g in opt.param_groups]
    assert base == [cfg.solver.lr * g["lr_mult"] for g in opt.param_groups]
    history = []
    for it in range(100):
        lrs = [g["lr"] for g in opt.param_groups]
        history.append(lrs[0] / base[0])
        for lr, b in zip(lrs, base):
            assert lr / b == pytest.approx(lrs[0] / base[0], rel=1e-9)
        opt.step()
        sched.step()
    assert history[0] == pytest.approx(0.01)  # warmup start
    decay10 = 1.0 if schedule == "multistep" else 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * 10 / 100))
    assert history[10] == pytest.approx((0.01 * 0.5 + 0.5) * decay10)  # half-way through warmup
    if schedule == "multistep":
        assert history[20] == pytest.approx(1.0) and history[59] == pytest.approx(1.0)
        assert history[60] == pytest.approx(0.1) and history[80] == pytest.approx(0.01)
    else:
        assert history[50] == pytest.approx(0.05 + 0.95 * 0.5)
        assert history[-1] < history[50] < history[20]
        assert lr_factor(100, 100, "cosine", final_factor=0.05) == pytest.approx(0.05)


@pytest.mark.parametrize("warmup,max_iter,warned", [(50, 20, True), (20, 20, True), (19, 20, False), (0, 20, False)])
def test_a_run_shorter_than_its_warmup_is_said(model, caplog, warmup, max_iter, warned):
    """solver.warmup_iters >= solver.max_iter: the LR never reaches solver.lr, which a
    short run's overrides leave unseen; one warning gives the fraction its last step takes."""
    cfg = _cfg(f"solver.max_iter={max_iter}", f"solver.warmup_iters={warmup}", "solver.steps=[]",
               "solver.warmup_factor=0.001")
    opt = build_optimizer(model, cfg)
    with caplog.at_level(logging.WARNING, logger="detector.engine.optim"):
        sched = build_lr_scheduler(opt, cfg)
    said = [r.getMessage() for r in caplog.records if "warmup_iters" in r.getMessage()]
    assert len(said) == int(warned), said
    if warned:
        for _ in range(max_iter - 1):
            opt.step()
            sched.step()
        last = opt.param_groups[0]["lr"] / opt.param_groups[0]["initial_lr"]
        assert last < 1 and f"its last step takes {last:.3g} of solver.lr" in said[0], (last, said)


def test_scheduler_state_resumes(model, tmp_path):
    cfg = _cfg("solver.max_iter=50", "solver.warmup_iters=10", "solver.steps=[30]")
    opt = build_optimizer(model, cfg)
    sched = build_lr_scheduler(opt, cfg)
    for _ in range(17):
        opt.step()
        sched.step()
    torch.save(sched.state_dict(), tmp_path / "s.pth")
    opt2 = build_optimizer(model, cfg)
    sched2 = build_lr_scheduler(opt2, cfg)
    sched2.load_state_dict(torch.load(tmp_path / "s.pth", weights_only=True))
    for _ in range(20):
        opt.step(), sched.step(), opt2.step(), sched2.step()
        assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in opt2.param_groups]


def test_linear_lr_scaling():
    cfg = _cfg("solver.lr=0.02", "solver.images_per_gpu=2", "solver.reference_batch_size=16")
    assert scaled_lr(cfg, world_size=8) == pytest.approx(0.02)
    assert scaled_lr(cfg, world_size=2) == pytest.approx(0.005)
    assert scaled_lr(_cfg("solver.lr=0.02", "solver.images_per_gpu=2", "solver.scale_lr=false"), 2) == 0.02


def test_adamw_and_bad_optimizer(model):
    opt = build_optimizer(model, _cfg("solver.optimizer=adamw", "solver.betas=[0.8,0.99]", "solver.lr=0.001",
                                      "solver.scale_lr=false"))
    assert isinstance(opt, torch.optim.AdamW) and opt.defaults["betas"] == (0.8, 0.99)
    cfg = _cfg()
    cfg.solver.optimizer = "adam"  # the config loader rejects it already; the builder checks too
    with pytest.raises(ValueError, match="solver.optimizer must be 'sgd' or 'adamw', got 'adam'"):
        build_optimizer(model, cfg)
    cfg = _cfg()
    cfg.solver.schedule = "poly"
    with pytest.raises(ValueError, match="solver.schedule must be 'multistep' or 'cosine', got 'poly'"):
        build_lr_scheduler(torch.optim.SGD(model.parameters(), lr=0.1), cfg)


def test_no_trainable_parameters_is_an_error():
    m = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        build_optimizer(m, _cfg())
