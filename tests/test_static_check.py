"""The static step as one compiled graph (``benchmarks/static_check.py``) and in
``TrainStep``: no graph breaks, no recompiles, no host syncs, the eager static losses;
the sync counter itself counts what it should."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.static_check import SyncCounter, full_float32, synthetic_batches
from detector.config import load_config
from detector.engine.static_step import StaticForward
from detector.engine.step import TrainStep
from detector.modeling import build_model

from conftest import TINY_CONFIG, load_tool

STATIC = ["train.static_step=true", "model.canvas_sizes=[[96,96]]", "data.max_gt_per_image=6"]


def test_sync_counter_counts_item_nonzero_and_mask_indexing():
    x = torch.arange(6.0)
    with SyncCounter() as counter:
        x.sum().item()
        torch.nonzero(x > 2)
        x[x > 2]
        x[torch.tensor([0, 1])]  # integer indexing: no sync
    assert counter.count == 3


def test_sync_counter_sees_the_eager_models_syncs():
    cfg = load_config(TINY_CONFIG, STATIC)
    model = build_model(cfg).train()
    images, targets = synthetic_batches(cfg, 1)[0]
    with SyncCounter() as counter:
        model(images, targets)
    assert counter.count > 0


def test_static_check_task_one_graph_without_syncs(tmp_path):
    # tools/benchmark.py --task static-check on the tiny config. aot_eager traces the same
    # forward and backward graphs as inductor without code generation (about 8 s of
    # compilation instead of about 70 s on a CPU); few NMS iterations keep the graph small.
    out_file = tmp_path / "static.json"
    rc = load_tool("benchmark").main(["--config", str(TINY_CONFIG), "--task", "static-check", "--iters", "10",
                                      "--compile-backend", "aot_eager", *STATIC, "rpn.nms_max_iters=4",
                                      "--json", str(out_file)])
    assert rc == 0
    out = json.loads(out_file.read_text())
    assert out["graph_breaks"] == 0
    assert out["recompiles"] == 0
    assert out["host_syncs_per_step"] == 0, out["sync_ops"]
    assert out["max_loss_rel_diff"] < 1e-5
    assert out["max_loss_rel_diff"] == max(out["loss_rel_diff"].values())
    assert set(out["loss_rel_diff"]) == {"loss_rpn_cls", "loss_rpn_box", "loss_roi_cls", "loss_roi_box"}
    assert out["num_batches"] == 10
    assert out["nms_method"] == "blocks"  # on the CPU; CUDA with Triton runs ops.greedy_scan


def test_the_check_runs_without_tf32_and_restores_it():
    before = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = True
    try:
        with pytest.raises(RuntimeError), full_float32():
            assert not torch.backends.cudnn.allow_tf32 and not torch.backends.cuda.matmul.allow_tf32
            raise RuntimeError("restored even so")
        assert torch.backends.cudnn.allow_tf32 and torch.backends.cuda.matmul.allow_tf32
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = before


def test_static_check_task_refuses_an_eager_config(capsys):
    rc = load_tool("benchmark").main(["--config", str(TINY_CONFIG), "--task", "static-check"])
    assert rc == 1
    assert "'train.static_step'" in capsys.readouterr().err


def test_train_step_runs_the_static_forward():
    cfg = load_config(TINY_CONFIG, STATIC)
    torch.manual_seed(0)
    model = build_model(cfg).train()
    forward = StaticForward.from_config(model, cfg)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda it: 1.0)
    step = TrainStep(model, opt, sched, forward=forward)
    before = model.roi_heads.box_predictor.cls_score.weight.clone()
    for images, targets in synthetic_batches(cfg, 2):
        result = step(images, targets)
        assert not result.skipped and torch.isfinite(result.losses).all()
    assert result.loss_names == ("total_loss", "loss_roi_box", "loss_roi_cls", "loss_rpn_box", "loss_rpn_cls")
    assert not torch.equal(before, model.roi_heads.box_predictor.cls_score.weight)
    assert int(forward.nms_unconverged) >= 0
