"""Fine-tuning: initial weights from our checkpoint of another class count, from a plain
state dict, and from a torchvision weights name (offline: one clear line)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import urllib.error
from pathlib import Path

import pytest
import torch

from detector.config import load_config
from detector.distributed import seed_everything
from detector.engine.optim import build_optimizer
from detector.engine.trainer import build_trainer
from detector.modeling.weights import WeightsError, load_initial_weights
from detector.modeling import build_model
from conftest import TINY_CONFIG, tiny_config

from conftest import ROOT  # noqa: E402
PRED = "roi_heads.box_predictor."


def _tiny(data: Path, out: Path, *extra: str):
    """The tests' tiny model, one iteration on 4 generated images."""
    return tiny_config(data, out, "data.shapes.num_train=4", "data.shapes.num_val=2", "solver.max_iter=1",
                       "solver.warmup_iters=1", "solver.steps=[100]", "train.deterministic=false", *extra)


def test_checkpoint_of_other_class_count_keeps_fresh_predictor(tmp_path, caplog):
    data = tmp_path / "shapes"
    # A source model of another class count: two of the shapes' three classes.
    src_cfg = _tiny(data, tmp_path / "src", "model.num_classes=2", "data.class_names=[circle,triangle]")
    src = build_trainer(src_cfg)
    src.train()
    src.close()
    ckpt = tmp_path / "src" / "checkpoints" / "last.pth"
    source = torch.load(ckpt, weights_only=True)["model"]

    cfg = _tiny(data, tmp_path / "ft", f"model.weights={ckpt}", "model.num_classes=3")
    with caplog.at_level(logging.INFO, logger="detector"):
        t = build_trainer(cfg)
    state = t.model_without_ddp.state_dict()
    body = [k for k in state if k.startswith(("backbone.", "rpn."))]
    assert body and all(torch.equal(state[k], source[k]) for k in body)
    assert state[PRED + "cls_score.weight"].shape[0] == 4 and source[PRED + "cls_score.weight"].shape[0] == 3
    # The predictor is the fresh initialisation a model built with the same seed has.
    seed_everything(cfg.train.seed, 0)
    fresh = build_model(_tiny(data, tmp_path / "x")).state_dict()
    assert all(torch.equal(state[k], fresh[k]) for k in state if k.startswith(PRED))
    # The log lists the skipped keys.
    for key in ("cls_score.weight", "cls_score.bias", "bbox_pred.weight", "bbox_pred.bias"):
        assert PRED + key in caplog.text
    assert t.train().iteration == 1
    t.close()


def test_plain_state_dict_loads_everything(tmp_path):
    cfg = load_config(TINY_CONFIG)
    torch.manual_seed(1)
    src = build_model(cfg)
    torch.save(src.state_dict(), tmp_path / "plain.pth")
    torch.manual_seed(2)
    dst = build_model(cfg)
    report = load_initial_weights(dst, str(tmp_path / "plain.pth"))
    assert not report.skipped and not report.missing and not report.unexpected
    assert all(torch.equal(a, b) for a, b in zip(src.state_dict().values(), dst.state_dict().values()))


def test_finetune_config_lowers_backbone_lr():
    cfg = load_config(ROOT / "configs" / "finetune_torchvision_coco.yaml", ["model.weights="])
    model = build_model(cfg)
    opt = build_optimizer(model, cfg)
    lrs = {g["name"]: g["lr"] for g in opt.param_groups}
    assert lrs["backbone.body"] == pytest.approx(0.1 * lrs["default"])
    assert not any(n.startswith("backbone.body.conv1") or n.startswith("backbone.body.layer1")
                   for n, p in model.named_parameters() if p.requires_grad)


def test_bad_weight_sources_are_one_line_errors(tmp_path):
    model = build_model(load_config(TINY_CONFIG, []))
    with pytest.raises(WeightsError, match=r"^model.weights: 'nope.pth' is neither an existing file nor a torchvision weights name"):
        load_initial_weights(model, "nope.pth")
    with pytest.raises(WeightsError, match=r"unknown torchvision weights name 'FasterRCNN_ResNet50_FPN_Weights.NOPE'"):
        load_initial_weights(model, "FasterRCNN_ResNet50_FPN_Weights.NOPE")
    (tmp_path / "junk.pth").write_bytes(b"not a checkpoint")
    with pytest.raises(WeightsError, match=r"^model.weights: .*junk.pth: not a PyTorch weights file"):
        load_initial_weights(model, str(tmp_path / "junk.pth"))


def test_torchvision_weights_offline_is_one_line(monkeypatch, tmp_path):
    import torchvision.models._api as api

    def no_network(url, *args, **kwargs):
        raise urllib.error.URLError("[Errno -3] Temporary failure in name resolution")

    monkeypatch.setattr(api, "load_state_dict_from_url", no_network)
    model = build_model(load_config(TINY_CONFIG, []))
    with pytest.raises(WeightsError) as e:
        load_initial_weights(model, "FasterRCNN_ResNet50_FPN_Weights.COCO_V1")
    msg = str(e.value)
    assert "\n" not in msg
    assert "cannot download torchvision weights 'FasterRCNN_ResNet50_FPN_Weights.COCO_V1'" in msg
    assert "URLError" in msg and "when offline" in msg


@pytest.mark.slow
def test_cli_offline_torchvision_weights(tmp_path):
    """The real download path with no way out (a proxy on a closed port): exit 1 and one line."""
    env = dict(os.environ, TORCH_HOME=str(tmp_path / "torch_home"), https_proxy="http://127.0.0.1:9",
               HTTPS_PROXY="http://127.0.0.1:9", http_proxy="http://127.0.0.1:9", HTTP_PROXY="http://127.0.0.1:9")
    env.pop("no_proxy", None), env.pop("NO_PROXY", None)
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "train.py"), "--config", str(TINY_CONFIG),
         "--output-dir", str(tmp_path / "run"), "--weights", "FasterRCNN_ResNet50_FPN_Weights.COCO_V1",
         f"data.train.root={tmp_path / 'shapes'}"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=180,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    err = proc.stderr.strip()
    assert "Traceback" not in proc.stderr and len(err.splitlines()) == 1, err
    assert err.startswith("error: model.weights: cannot download torchvision weights 'FasterRCNN_ResNet50_FPN_Weights.COCO_V1'")
