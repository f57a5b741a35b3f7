"""A skipped non-finite step leaves the whole training state bit-identical: parameters,
buffers (BatchNorm's running statistics, already updated by the poisoned forward pass),
optimizer state and the AMP scaler. With BN, FrozenBN, GroupNorm and SyncBN, in one
process and across two gloo ranks; and end to end on the tiny BN detector."""

from __future__ import annotations

import logging
import math

import pytest
import torch

import skip_state_check as sc
from detector.engine.amp import AmpSettings
from detector.engine.buffer_guard import BufferSnapshot
from detector.engine.checkpointing import load_checkpoint
from detector.engine.hooks import NonFiniteLossError
from detector.engine.log import read_jsonl
from detector.engine.trainer import build_trainer
from conftest import tiny_config


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    return tmp_path_factory.mktemp("shapes") / "data"  # generated on first use


def assert_same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("kind", ["bn", "frozenbn", "gn", "syncbn"])
def test_skipped_step_leaves_state_bit_identical(kind):
    """SyncBN in one process runs as BatchNorm (no process group), buffers included."""
    torch.manual_seed(0)
    model = sc.NormNet(kind)
    step = sc.make_step(model)
    step(*sc.batch(0))  # momentum buffers exist, the statistics moved
    before = sc.training_state(step)
    model.poison = True
    out = step(*sc.batch(1))
    assert out.skipped and out.nonfinite
    assert_same_state(sc.training_state(step), before)
    model.poison = False
    out = step(*sc.batch(2))
    assert not out.skipped and torch.isfinite(out.losses).all()
    state = sc.training_state(step)
    assert all(torch.isfinite(v).all() for v in state.values() if v.is_floating_point())
    if kind in ("bn", "syncbn"):  # the good step after the skip moved the statistics, once
        assert int(state["model.body.1.num_batches_tracked"]) == 2
        assert not torch.equal(state["model.body.1.running_var"], before["model.body.1.running_var"])


def test_without_the_snapshot_the_poisoned_forward_spoils_batchnorm():
    """Not vacuous: the poisoned forward pass does write NaN into the running statistics."""
    model = sc.NormNet("bn")
    model.poison = True
    model(*sc.batch(0))
    assert torch.isnan(model.body[1].running_var).all() and int(model.body[1].num_batches_tracked) == 1


@pytest.mark.parametrize("bad", [True, False])
def test_restore_where_decides_on_the_device(bad):
    model = sc.NormNet("bn")
    snap = BufferSnapshot(model)
    snap.take()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model(*sc.batch(0))
    after = {k: v.clone() for k, v in model.state_dict().items()}
    snap.restore_where(torch.tensor(bad))
    expected = before if bad else after
    assert all(torch.equal(v, expected[k]) for k, v in model.state_dict().items())


def test_float16_nonfinite_loss_keeps_the_scaler_state():
    """A non-finite loss is not the scaler's overflow: scale and growth count stay; an
    overflow of the gradients alone lowers the scale (GradScaler's calibration)."""
    torch.manual_seed(0)
    model = sc.NormNet("bn")
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=100)
    step = sc.make_step(model, AmpSettings(True, torch.float16), scaler=scaler)
    step(*sc.batch(0))
    step(*sc.batch(1))
    before = sc.training_state(step)
    assert int(before["scaler._growth_tracker"]) == 2
    model.poison = True
    out = step(*sc.batch(2))
    assert out.skipped and out.nonfinite
    assert_same_state(sc.training_state(step), before)
    model.poison = False
    scaler.update(new_scale=2.0**60)  # the float16 gradients overflow
    out = step(*sc.batch(3))
    assert out.skipped and not out.nonfinite and scaler.get_scale() == 2.0**59
    assert int(scaler.state_dict()["_growth_tracker"]) == 0


@pytest.mark.dist
@pytest.mark.parametrize("kind", ["bn", "frozenbn"])
def test_two_gloo_ranks_skip_together_and_keep_state(tmp_path, kind):
    """Rank 1's batch is NaN: both ranks skip, both keep their state bit-identical."""
    ranks = sc.spawn_ranks(tmp_path, kind)
    for r in ranks:
        assert bool(r["skipped"]) and bool(r["nonfinite"])
        assert_same_state(r["after"], r["before"])
        assert not bool(r["then_skipped"]) and bool(r["then_finite"])


@pytest.mark.gpu
@pytest.mark.dist
def test_two_ranks_syncbn_skip_keeps_state(tmp_path):
    """PyTorch's SyncBatchNorm refuses CPU tensors in a process group, so the SyncBN
    ranks run on CUDA (gloo backend, one GPU is enough)."""
    ranks = sc.spawn_ranks(tmp_path, "syncbn")
    for r in ranks:
        assert bool(r["skipped"]) and bool(r["nonfinite"])
        assert_same_state(r["after"], r["before"])
        assert not bool(r["then_skipped"]) and bool(r["then_finite"])


def _nan_images_at(model: torch.nn.Module, bad_iterations: set) -> None:
    """NaN input images at the given (1-based) training iterations: the forward pass
    itself goes NaN, BatchNorm's statistics first."""
    forward, calls = model.forward, {"n": 0}

    def poisoned(images, targets=None):
        if model.training:
            calls["n"] += 1
            if calls["n"] in bad_iterations:
                images = [im.float() * float("nan") for im in images]
        return forward(images, targets)

    model.forward = poisoned


def _all_finite(checkpoint_model: dict) -> bool:
    return all(torch.isfinite(v).all() for v in checkpoint_model.values() if v.is_floating_point())


def test_bn_detector_continues_after_a_skip_with_finite_checkpoints(data_root, tmp_path, caplog):
    cfg = tiny_config(data_root, tmp_path / "n", "solver.max_iter=5", "train.checkpoint_period=3",
                      "train.max_nonfinite_steps=3")
    t = build_trainer(cfg)
    _nan_images_at(t.model_without_ddp, {2})
    with caplog.at_level(logging.WARNING, logger="detector.engine"):
        res = t.train()
    t.close()
    assert res.status == "finished" and "iteration 2: non-finite loss" in caplog.text
    recs = read_jsonl(tmp_path / "n" / "metrics.jsonl")
    assert [r["nonfinite_skipped"] for r in recs if r.get("type", "train") == "train"] == [0, 1, 0, 0, 0]
    losses = [r["total_loss"] for r in recs if r.get("type", "train") == "train"]
    assert losses[1] is None and all(math.isfinite(x) for i, x in enumerate(losses) if i != 1)
    for name in ("iter_0000003.pth", "last.pth"):
        ck = load_checkpoint(tmp_path / "n" / "checkpoints" / name)
        assert _all_finite(ck["model"]), name
        assert any(k.endswith("running_var") for k in ck["model"])  # a model that trains BatchNorm


def test_issue_reproduction_stops_with_a_finite_checkpoint(data_root, tmp_path):
    """issue 24 item 7: lr 1e6 without warm-up on the BN detector. The loss explodes,
    the steps go non-finite and are skipped; the guard stops naming a finite checkpoint
    (before the fix: "no finite checkpoint was written", running_var NaN)."""
    cfg = tiny_config(data_root, tmp_path / "x", "solver.lr=1e6", "solver.warmup_iters=0", "solver.max_iter=30",
                      "train.checkpoint_period=3", "train.max_nonfinite_steps=3")
    t = build_trainer(cfg)
    with pytest.raises(NonFiniteLossError) as e:
        t.train()
    t.close()
    msg = str(e.value)
    assert "no finite checkpoint" not in msg
    path = msg.split(" (iteration ")[0].rsplit(" ", 1)[1]
    ck = load_checkpoint(path)
    assert _all_finite(ck["model"])
    assert any(k.endswith("running_var") for k in ck["model"])  # a model that trains BatchNorm
