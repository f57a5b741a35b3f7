"""EMA of the weights (``train.ema``): the average against a hand-written reference,
skipped steps, checkpoints and exact resume, and both metrics at evaluation."""

from __future__ import annotations

import math
import os
import signal

import pytest
import torch
from torch import nn

from detector.engine.ema import ModelEMA
from detector.engine.hooks import EMAHook
from detector.engine.log import read_jsonl
from detector.engine.train_loop import HookBase, LoopState
from detector.engine.trainer import build_trainer
from conftest import tiny_config


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    return tmp_path_factory.mktemp("shapes") / "data"  # generated on first use


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))


def test_average_matches_the_formula_with_warmup():
    model = net()
    ema = ModelEMA(model, decay=0.9, warmup=2)
    ref = {k: v.clone() for k, v in model.state_dict().items()}
    for n in range(1, 4):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(float(n))
        model.train()(torch.randn(5, 3))  # BatchNorm statistics move
        d = 0.9 * (1 - math.exp(-n / 2))
        assert ema.decay_at(n) == pytest.approx(d)
        ema.update(model)
        for k, v in model.state_dict().items():
            ref[k] = d * ref[k] + (1 - d) * v if v.is_floating_point() else v.clone()
    for k, v in ema.module.state_dict().items():
        torch.testing.assert_close(v, ref[k], msg=k)
    assert int(ema.module[1].num_batches_tracked) == 3 and not any(p.requires_grad for p in ema.module.parameters())


def test_skipped_steps_leave_the_average():
    model = net()
    ema = ModelEMA(model, decay=0.5)
    hook, state = EMAHook(ema, model), LoopState(max_iter=10)
    with torch.no_grad():
        model[0].weight.add_(1.0)
    state.step = type("S", (), {"skipped": True})()
    before = {k: v.clone() for k, v in ema.module.state_dict().items()}
    hook.after_step(state)
    assert ema.updates == 0 and all(torch.equal(v, before[k]) for k, v in ema.module.state_dict().items())
    state.step = type("S", (), {"skipped": False})()
    hook.after_step(state)
    assert ema.updates == 1 and not torch.equal(ema.module[0].weight, before["0.weight"])


def test_bad_ema_settings_are_one_line():
    from detector.config import ConfigError, load_config
    from conftest import TINY_CONFIG
    with pytest.raises(ConfigError, match="'train.ema.decay' must be") as e:
        load_config(TINY_CONFIG, ["train.ema.decay=1.0"])
    assert "\n" not in str(e.value)


class SignalAt(HookBase):
    def __init__(self, at: int) -> None:
        self.at = at

    def after_step(self, state) -> None:
        if state.iteration == self.at:
            os.kill(os.getpid(), signal.SIGTERM)


def test_ema_is_checkpointed_and_resumes_exactly(data_root, tmp_path):
    extra = ["solver.max_iter=4", "train.ema.enabled=true", "train.ema.decay=0.8", "train.ema.warmup=1",
             "train.eval_period=-1"]
    a = build_trainer(tiny_config(data_root, tmp_path / "a", *extra))
    a.train()
    a.close()
    cfg_b = tiny_config(data_root, tmp_path / "b", *extra)
    b = build_trainer(cfg_b)
    b.hooks.append(SignalAt(1))
    assert b.train().iteration == 2
    b.close()
    assert torch.load(tmp_path / "b" / "checkpoints" / "last.pth", weights_only=True)["ema"]["updates"] == 2
    b2 = build_trainer(cfg_b, resume=True)
    b2.train()
    b2.close()
    ea = torch.load(tmp_path / "a" / "checkpoints" / "last.pth", weights_only=True)["ema"]
    eb = torch.load(tmp_path / "b" / "checkpoints" / "last.pth", weights_only=True)["ema"]
    assert ea["updates"] == eb["updates"] == 4
    raw = torch.load(tmp_path / "a" / "checkpoints" / "last.pth", weights_only=True)["model"]
    assert any(not torch.equal(ea["model"][k], raw[k]) for k in raw if raw[k].is_floating_point())
    for k in ea["model"]:
        torch.testing.assert_close(eb["model"][k], ea["model"][k], msg=k)


@pytest.mark.parametrize("use_ema, other", [("true", "raw"), ("false", "ema")])
def test_evaluation_reports_raw_and_ema_metrics(data_root, tmp_path, use_ema, other):
    cfg = tiny_config(data_root, tmp_path / "e", "solver.max_iter=2", "train.ema.enabled=true", "train.eval_period=1",
                      f"eval.use_ema={use_ema}")
    t = build_trainer(cfg)
    t.train()
    t.close()
    evals = [r for r in read_jsonl(tmp_path / "e" / "metrics.jsonl") if r.get("type") == "eval"]
    assert evals and all("AP" in r and f"{other}/AP" in r for r in evals)
    assert (tmp_path / "e" / f"eval_{other}" / "iter_0000001").is_dir()


def test_eval_loads_the_ema_weights_of_a_checkpoint(tmp_path):
    from detector.config import load_config
    from detector.modeling import build_model
    from detector.modeling.weights import WeightsError, load_model_weights
    from conftest import TINY_CONFIG

    cfg = load_config(TINY_CONFIG, [])
    model = build_model(cfg)
    raw = model.state_dict()
    averaged = {k: v + 1 if v.is_floating_point() else v for k, v in raw.items()}
    path = tmp_path / "c.pth"
    torch.save({"model": raw, "ema": {"model": averaged, "updates": 3}}, path)
    target = build_model(cfg)
    load_model_weights(target, str(path), use_ema=True)
    assert all(torch.equal(v, averaged[k]) for k, v in target.state_dict().items())
    load_model_weights(target, str(path))
    assert all(torch.equal(v, raw[k]) for k, v in target.state_dict().items())
    torch.save({"model": raw}, path)
    with pytest.raises(WeightsError, match="holds no EMA weights.*eval.use_ema=false") as e:
        load_model_weights(target, str(path), use_ema=True)
    assert "\n" not in str(e.value)
    # a torchvision weights name: nothing is downloaded, and the line says why it cannot serve
    with pytest.raises(WeightsError, match=r"^--weights FasterRCNN_ResNet50_FPN_Weights\.COCO_V1: torchvision's "
                                           r"weights hold no EMA weights .*set eval\.use_ema=false"):
        load_model_weights(target, "FasterRCNN_ResNet50_FPN_Weights.COCO_V1", use_ema=True)


def test_infer_and_export_use_the_weights_that_eval_measures(tmp_path, capsys):
    """A checkpoint of a run with ``train.ema.enabled``: tools/eval.py evaluates its EMA
    weights (``eval.use_ema``, the default), and so must infer.py and export.py, or the
    deployed model is not the measured one (they loaded the raw weights). The raw and
    EMA weights here are two models of different seeds: infer's detections equal those of
    the EMA weights saved alone, and the exported file passes the check against them only."""
    import json

    import numpy as np
    from PIL import Image

    from detector.config import load_config
    from detector.modeling import build_model
    from conftest import TINY_CONFIG, load_tool

    def model_state(seed):
        torch.manual_seed(seed)
        return build_model(load_config(TINY_CONFIG, [])).state_dict()

    raw, ema = model_state(1), model_state(2)
    torch.save({"model": raw, "ema": {"model": ema, "updates": 10}}, tmp_path / "last.pth")
    torch.save(ema, tmp_path / "ema.pth")
    torch.save(raw, tmp_path / "raw.pth")
    inputs = tmp_path / "in"
    inputs.mkdir()
    rng = np.random.default_rng(0)
    for i, (h, w) in enumerate([(90, 120), (140, 100)]):
        Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(inputs / f"im{i}.png")

    def infer(weights, *overrides):
        out = tmp_path / f"out_{weights}_{len(overrides)}"
        argv = ["--config", str(TINY_CONFIG), "--weights", str(tmp_path / weights), "--input", str(inputs),
                "--output-dir", str(out), "--score-thresh", "0.0", *overrides]
        assert load_tool("infer").main(argv) == 0, capsys.readouterr().err
        return [(r["boxes"], r["scores"]) for r in json.loads((out / "detections.json").read_text())]

    with_ema = infer("last.pth", "train.ema.enabled=true")
    assert with_ema == infer("ema.pth") and with_ema[0][0]  # boxes found, the EMA model's
    assert infer("last.pth", "train.ema.enabled=true", "eval.use_ema=false") == infer("raw.pth") != with_ema

    export = load_tool("export")
    exported = tmp_path / "model.pt"
    common = ["--config", str(TINY_CONFIG), "--format", "torchscript", "--output", str(exported),
              "--image-size", "64", "96"]
    assert export.main([*common, "--weights", str(tmp_path / "last.pth"), "train.ema.enabled=true"]) == 0
    assert export.main([*common, "--weights", str(tmp_path / "ema.pth"), "--verify-only"]) == 0
    assert export.main([*common, "--weights", str(tmp_path / "raw.pth"), "--verify-only"]) == 1
