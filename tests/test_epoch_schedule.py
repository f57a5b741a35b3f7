"""Schedules in epochs: ``solver.max_epochs`` / ``solver.steps_epochs`` become
``solver.max_iter`` / ``solver.steps`` with the optimizer steps of an epoch, and the run's
config.yaml records both; iterations and epochs together are refused in one line."""

from __future__ import annotations

import pytest
import yaml

from detector.config import ConfigError, load_config
from detector.engine.trainer import build_trainer
from conftest import TINY_CONFIG, tiny_config


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    return tmp_path_factory.mktemp("shapes") / "data"  # generated on first use


@pytest.mark.parametrize("accumulate, per_epoch", [(1, 4), (2, 2), (3, 1)])
def test_epochs_convert_with_data_set_size_and_global_batch(data_root, tmp_path, accumulate, per_epoch):
    """8 training images, 2 a batch: 4 loader batches an epoch, 4 // accumulate steps."""
    cfg = tiny_config(data_root, tmp_path / "e", "solver.max_iter=0", "solver.max_epochs=3",
                      "solver.steps_epochs=[2]", f"solver.accumulate_steps={accumulate}", "solver.warmup_iters=0")
    t = build_trainer(cfg)
    try:
        assert len(t.loader) == 4
        assert t.state.max_iter == 3 * per_epoch
        assert t.step.scheduler.steps == [2 * per_epoch]
        written = yaml.safe_load((tmp_path / "e" / "config.yaml").read_text())["solver"]
        assert (written["max_iter"], written["steps"]) == (3 * per_epoch, [2 * per_epoch])
        assert (written["max_epochs"], written["steps_epochs"], written["iters_per_epoch"]) == (3, [2], per_epoch)
    finally:
        t.close()
    again = load_config(tmp_path / "e" / "config.yaml")  # the run's config.yaml loads (eval, resume)
    assert again.solver.max_iter == 3 * per_epoch


def test_epoch_run_trains_whole_epochs(data_root, tmp_path):
    cfg = tiny_config(data_root, tmp_path / "r", "solver.max_iter=0", "solver.max_epochs=2")
    t = build_trainer(cfg)
    res = t.train()
    t.close()
    assert res.iteration == 8 and (t.epoch, t.epoch_position) == (1, 4)


@pytest.mark.parametrize("overrides, match", [
    (["solver.max_epochs=12"], r"'solver.max_epochs' \(12\) and 'solver.max_iter' \(6\) are both set"),
    (["solver.max_iter=0"], "'solver.max_iter' is 0: set it"),
    (["solver.steps_epochs=[8]"], "'solver.steps_epochs' .* needs solver.max_epochs"),
    (["solver.max_iter=0", "solver.max_epochs=12", "solver.steps_epochs=[0]"], "takes epochs >= 1"),
    (["solver.max_epochs=-1"], "'solver.max_epochs' must be"),
])
def test_bad_schedules_are_one_line(overrides, match):
    with pytest.raises(ConfigError, match=match) as e:
        load_config(TINY_CONFIG, overrides)
    assert "\n" not in str(e.value)


def test_train_max_epochs_suggests_solver_max_epochs():
    with pytest.raises(ConfigError, match="did you mean 'solver.max_epochs'"):
        load_config(TINY_CONFIG, ["train.max_epochs=12"])
