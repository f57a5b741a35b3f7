"""Early stopping (``train.early_stop``): patience on ``train.best_metric``, built on the
best-checkpoint logic; a missing metric (pycocotools' -1, NaN, absent) is never an
improvement; the patience counter survives an exact resume."""

from __future__ import annotations

import logging
import os
import signal

import pytest
import torch

from detector.config import ConfigError, load_config
from detector.engine.checkpointing import Checkpointer
from detector.engine.early_stop import EarlyStopping, metric_value
from detector.engine.hooks import EvalHook
from detector.engine.log import EventWriters
from detector.engine.train_loop import HookBase, LoopState
from detector.engine.trainer import build_trainer
from conftest import TINY_CONFIG, tiny_config


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    return tmp_path_factory.mktemp("shapes") / "data"  # generated on first use


def test_metric_value_treats_minus_one_nan_and_absent_as_missing():
    assert metric_value({"AP": 0.25}, "AP") == 0.25 and metric_value({"AP": 0.0}, "AP") == 0.0
    assert metric_value({"AP": -1.0}, "AP") is None
    assert metric_value({"AP": float("nan")}, "AP") is None
    assert metric_value({"AP50": 0.5}, "AP") is None


def test_patience_counts_evaluations_without_an_improvement_above_min_delta():
    es = EarlyStopping("AP", patience=3, min_delta=0.01)
    assert es.update(0.1, 1) is None and es.update(0.3, 2) is None and es.wait == 0
    assert es.update(0.305, 3) is None and es.wait == 1  # +0.005 is below min_delta
    assert es.update(None, 4) is None and es.wait == 1  # missing: not counted either way
    assert es.update(0.2, 5) is None and es.wait == 2
    reason = es.update(0.31, 6)  # +0.01 is not more than min_delta
    assert reason is not None and "\n" not in reason
    assert "early stopping at iteration 6" in reason and "best AP 0.3000 at iteration 2" in reason
    off = EarlyStopping("AP", patience=0)
    assert all(off.update(0.1, i) is None for i in range(10)) and not off.exhausted


class Params(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.arange(4.0))


def drive(tmp_path, values, patience=2):
    """EvalHook every iteration with the scripted AP values; checkpoints every iteration."""
    module = Params()
    ck = Checkpointer(tmp_path, lambda: {"model": module.state_dict()})
    script = dict(enumerate(values, start=1))
    hook = EvalHook(lambda it: {"AP": script[it], "AP50": 0.5}, ck, period=1, best_metric="AP",
                    writers=EventWriters(), early_stopping=EarlyStopping("AP", patience))
    state = LoopState(max_iter=100)
    for _ in values:
        state.iteration += 1
        ck.save(["last.pth"], state.iteration)
        hook.after_step(state)
        if state.early_stop:
            break
    return hook, ck, state


def test_missing_metric_never_chooses_best_nor_counts(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="detector.engine"):
        hook, ck, state = drive(tmp_path, [-1.0, float("nan"), -1.0, 0.2, -1.0, -1.0, -1.0])
    assert ck.saved["best.pth"] == 4 and hook.best_value == 0.2
    assert state.early_stop is None and hook.early_stopping.wait == 0
    assert "AP is -1.0, not measured" in caplog.text


def test_patience_runs_out_and_sets_the_reason(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="detector.engine"):
        hook, ck, state = drive(tmp_path, [0.3, 0.5, 0.4, 0.45, 0.1, 0.1])
    assert state.iteration == 4 and state.early_stop.startswith("early stopping at iteration 4")
    assert ck.saved["best.pth"] == 2 and "best.pth and last.pth are kept" in caplog.text


def test_early_stop_needs_periodic_evaluation():
    with pytest.raises(ConfigError, match="'train.early_stop.patience' \\(3\\) needs periodic evaluation") as e:
        load_config(TINY_CONFIG, ["train.early_stop.patience=3", "train.eval_period=0"])
    assert "\n" not in str(e.value)


SCRIPT = {2: 0.5, 4: 0.4, 6: 0.45, 8: 0.3, 10: 0.2, 12: 0.1}


class SignalAt(HookBase):
    def __init__(self, at: int) -> None:
        self.at = at

    def after_step(self, state) -> None:
        if state.iteration == self.at:
            os.kill(os.getpid(), signal.SIGTERM)


def scripted(trainer):
    hook = next(h for h in trainer.hooks if isinstance(h, EvalHook))
    hook.evaluate = lambda it: {"AP": SCRIPT.get(it, 0.0)}
    return trainer


def test_early_stop_ends_the_run_and_an_exact_resume_keeps_the_patience(data_root, tmp_path, caplog):
    """Evaluations at 2, 4, 6, 8: AP 0.5 then lower; patience 3 stops at 8. A run stopped
    by SIGTERM after iteration 4 (count 1) resumes at 5 with its count and stops at 8 too;
    a count started afresh would take 0.45 at 6 as its best and train on to 12."""
    extra = ["solver.max_iter=12", "train.eval_period=2", "train.early_stop.patience=3"]
    a = scripted(build_trainer(tiny_config(data_root, tmp_path / "a", *extra)))
    with caplog.at_level(logging.WARNING, logger="detector.engine"):
        res = a.train()
    a.close()
    assert res.status == "finished" and res.iteration == 8
    assert "early stopping at iteration 8: AP has not improved" in caplog.text
    ckpts = tmp_path / "a" / "checkpoints"
    assert torch.load(ckpts / "best.pth", weights_only=True)["iteration"] == 2
    last = torch.load(ckpts / "last.pth", weights_only=True)
    assert last["iteration"] == 8 and last["early_stop"]["wait"] == 3
    # Interrupted after iteration 4's evaluation (stops at 5), resumed.
    cfg_b = tiny_config(data_root, tmp_path / "b", *extra)
    b = scripted(build_trainer(cfg_b))
    b.hooks.append(SignalAt(4))
    assert b.train().status == "interrupted"
    b.close()
    assert torch.load(tmp_path / "b" / "checkpoints" / "last.pth", weights_only=True)["early_stop"]["wait"] == 1
    b2 = scripted(build_trainer(cfg_b, resume=True))
    res = b2.train()
    b2.close()
    assert res.status == "finished" and res.iteration == 8
    wa, wb = a.model_without_ddp.state_dict(), b2.model_without_ddp.state_dict()
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], msg=k)
    # Resuming the run that stopped early does not train on.
    c = scripted(build_trainer(cfg_b, resume=True))
    assert c.train().iteration == 8
    c.close()


@pytest.mark.parametrize("name, words", [
    ("count_mae", "is 'count_mae', which is smaller when better; best.pth and train.early_stop keep the largest value"),
    ("val_loss", "is 'val_loss', which is smaller when better"),
    ("AP_50", "is 'AP_50', not a metric the evaluation writes: choose one of AP, AP50, AP75"),
])
def test_best_metric_must_be_written_and_larger_when_better(name, words, tmp_path):
    """An error measure as train.best_metric kept the worst checkpoint as best.pth, and an
    unknown name was a warning at the first evaluation (no best.pth): both refused before
    training; every metric of HIGHER_IS_BETTER is accepted."""
    from detector.config import ConfigError, load_config
    from detector.engine.early_stop import check_best_metric
    from detector.evaluation.report import HIGHER_IS_BETTER
    from conftest import TINY_CONFIG

    with pytest.raises(ConfigError) as info:
        check_best_metric(load_config(TINY_CONFIG, [f"train.best_metric={name}"]))
    assert str(info.value).startswith(f"config key 'train.best_metric' {words}"), str(info.value)
    for good in HIGHER_IS_BETTER:
        check_best_metric(load_config(TINY_CONFIG, [f"train.best_metric={good}"]))


def test_the_metric_lists_are_what_the_evaluation_writes():
    from cases import make_coco_case
    from detector.evaluation import score_detections
    from detector.evaluation.report import HIGHER_IS_BETTER, LOWER_IS_BETTER

    gt, dets = make_coco_case(num_images=4)
    written = set(score_detections(gt, dets).metrics)
    assert written == set(HIGHER_IS_BETTER) | {"count_mae"}
    assert set(LOWER_IS_BETTER) - {"count_mae"} == {"val_loss", "val_loss_rpn_cls", "val_loss_rpn_box",
                                                    "val_loss_roi_cls", "val_loss_roi_box"}
