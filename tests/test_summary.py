"""tools/summary.py and detector.modeling.summary: parameter counts per module, FLOPs
against the hand formula, frozen counts following model.freeze_at."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from detector.config import load_config
from detector.modeling import build_model
from detector.modeling.summary import count_flops, count_parameters, model_parts, model_summary
from conftest import load_tool, tiny_config

from conftest import TINY_CONFIG  # noqa: E402


def tiny(*overrides: str) -> nn.Module:
    return build_model(load_config(TINY_CONFIG, list(overrides)))


@pytest.fixture(scope="module")
def summary_and_model():
    model = tiny()
    model.train()
    rng = torch.get_rng_state()
    summary = model_summary(model, (64, 96))
    assert torch.equal(torch.get_rng_state(), rng)  # a training run's random stream is untouched
    assert model.training  # the mode is restored
    return summary, model


def test_parameter_counts_equal_numel_per_module(summary_and_model):
    summary, model = summary_and_model
    assert list(summary.parts) == ["backbone.body", "backbone.fpn", "rpn", "roi_heads"]
    modules = dict(model_parts(model))
    for name, count in summary.parts.items():
        params = list(modules[name].parameters())
        assert count.total == sum(p.numel() for p in params) > 0
        assert count.trainable == sum(p.numel() for p in params if p.requires_grad)
        assert count.frozen == sum(p.numel() for p in params if not p.requires_grad)
    # The four parts are the whole model.
    assert summary.params_total == sum(p.numel() for p in model.parameters())
    assert summary.params_total == sum(c.total for c in summary.parts.values())
    assert summary.params_trainable + summary.params_frozen == summary.params_total


def test_flops_and_size(summary_and_model):
    summary, model = summary_and_model
    assert summary.gflops > 0 and summary.proposals > 0
    assert all(summary.part_gflops[name] > 0 for name in summary.parts)
    assert sum(summary.part_gflops.values()) == pytest.approx(summary.gflops, rel=1e-9)
    floats = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    assert floats < summary.checkpoint_bytes < floats * 1.05  # the tensors plus the pickle's names


@pytest.mark.parametrize("cin,cout,k,h,w", [(3, 8, 3, 10, 12), (16, 4, 1, 7, 5), (4, 6, 5, 9, 9)])
def test_conv_flops_equal_hand_formula(cin, cout, k, h, w):
    conv = nn.Conv2d(cin, cout, k, padding=k // 2)
    flops = count_flops(conv, torch.rand(1, cin, h, w))
    assert flops[""] == 2 * cin * cout * k * k * h * w


def test_frozen_count_follows_freeze_at():
    counts = {f: count_parameters(tiny(f"model.freeze_at={f}")) for f in (0, 2, 5)}
    assert counts[0].frozen == 0
    assert 0 < counts[2].frozen < counts[5].frozen
    body = tiny("model.freeze_at=5").backbone.body
    assert counts[5].frozen == sum(p.numel() for p in body.parameters())  # the whole body
    for c in counts.values():
        assert c.trainable + c.frozen == c.total
    # With model.norm=bn the frozen stages' BatchNorm becomes FrozenBatchNorm2d (buffers):
    # parameters plus frozen norm values stay the same.
    assert len({c.total + c.frozen_norm_values for c in counts.values()}) == 1
    assert counts[0].frozen_norm_values == 0 < counts[2].frozen_norm_values


def test_tool_writes_json(tmp_path, capsys):
    tool = load_tool("summary")
    out = tmp_path / "s.json"
    assert tool.main(["--config", str(TINY_CONFIG), "--image-size", "64", "96", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert {"params_total", "params_trainable", "params_frozen", "gflops"} <= set(data)
    assert data["params_total"] == sum(p.numel() for p in tiny().parameters())
    assert data["image_size"] == [64, 96]
    assert "backbone.body" in capsys.readouterr().out
    # Sizes outside 1..8192 (as the input.* sizes; 9000x9000 ran for minutes) and an empty --json: usage errors.
    for args, words in ((["--image-size", "0", "96"], "--image-size takes two sides in 1..8192 pixels"),
                        (["--image-size", "9000", "9000"], "got 9000 9000"), (["--json="], "argument --json: is empty: name the file to write")):
        with pytest.raises(SystemExit) as info:
            tool.main(["--config", str(TINY_CONFIG), *args])
        err = capsys.readouterr().err
        assert info.value.code == 2 and words in err.strip().splitlines()[-1], err


def test_training_writes_summary_next_to_config(tmp_path, caplog):
    """The trainer logs the summary once at set-up (rank 0) and writes summary.json next
    to config.yaml, with the numbers of the model it trains at the config's test size."""
    from detector.engine.trainer import build_trainer

    out = tmp_path / "run"
    cfg = tiny_config(tmp_path / "data", out, "solver.max_iter=1")
    with caplog.at_level("INFO", logger="detector.engine.trainer"):
        trainer = build_trainer(cfg)
    try:
        model = trainer.model_without_ddp
        data = json.loads((out / "summary.json").read_text())
        assert (out / "config.yaml").is_file()
        assert data["params_total"] == sum(p.numel() for p in model.parameters())
        assert data["params_frozen"] == sum(p.numel() for p in model.parameters() if not p.requires_grad) > 0
        assert data["image_size"] == [cfg.input.min_size_test, cfg.input.max_size_test] and data["gflops"] > 0
        logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("model summary")]
        assert len(logged) == 1 and "backbone.body" in logged[0]
        trainer.train()
    finally:
        trainer.close()
