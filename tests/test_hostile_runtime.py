"""Hostile input at run time: data loader workers, crafted checkpoints, a frozen rank
(issue 23, part 5). Each is one ``error:`` line from ``tools/train.py``.

One mechanism per class:
- a worker's exception is unwrapped where the loader is iterated
  (``detector.data.loader.unwrap_worker_error``): the same line at any worker count;
- a checkpoint's training state is validated before it is restored
  (``detector.engine.resume_checks``): types, ranges, consistency with the schedule and
  the data, RNG entries tried, optimizer type and parameter groups compared;
- ranks that stop answering end the run after ``train.dist_timeout_s``
  (``tests/test_hostile_dist.py``).
"""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest
import torch

from conftest import TINY_CONFIG, load_tool, tiny_config, tiny_overrides
from detector.config import load_config
from detector.data import DataError, build_dataset, build_train_loader
from detector.data.loader import unwrap_worker_error
from detector.data.shapes import ensure_shapes


@pytest.fixture(scope="module")
def train_tool():
    return load_tool("train")


def run_train(train_tool, capsys, *argv: str) -> str:
    """``tools/train.py argv``: asserts exit status 1 and one ``error:`` line; returns it."""
    status = train_tool.main(list(argv))
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert status == 1, err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    return lines[0]


# --------------------------------------------------------------------------- loader workers


@pytest.fixture(scope="module")
def shapes_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("broken") / "data"
    s = tiny_config(root).data.shapes
    ensure_shapes(root, s.num_train, s.num_val, s.seed, s.min_side, s.max_side)
    return root


@pytest.fixture(params=["truncated", "missing"])
def broken_image(request, shapes_root):
    """One training image truncated or deleted (restored afterwards)."""
    image = sorted(p for p in (shapes_root / "train").rglob("*") if p.suffix in (".jpg", ".png"))[3]
    data = image.read_bytes()
    if request.param == "truncated":
        image.write_bytes(data[: len(data) // 3])
    else:
        image.unlink()
    yield image
    image.write_bytes(data)


def first_error(cfg, num_workers: int) -> BaseException:
    ds = build_dataset(cfg, "train", True)
    loader = build_train_loader(cfg, ds, num_workers=num_workers)
    loader.batch_sampler.set_epoch(0)
    with pytest.raises(Exception) as err:
        for _ in loader:
            pass
    return err.value


def test_worker_error_is_the_same_line_as_without_workers(shapes_root, broken_image, tmp_path):
    cfg = tiny_config(shapes_root, tmp_path / "run", "data.persistent_workers=false")
    plain = first_error(cfg, 0)
    children = set(multiprocessing.active_children())
    workers = first_error(cfg, 2)
    # The workers stopped with the error (not when the exception is collected, 5 s each).
    assert set(multiprocessing.active_children()) <= children
    assert isinstance(plain, (DataError, FileNotFoundError)) and broken_image.name in str(plain)
    assert type(workers) is type(plain)
    assert str(workers) == str(plain) and "\n" not in str(workers)


@pytest.mark.parametrize("workers", [0, 2])
def test_train_tool_prints_the_same_line_at_any_worker_count(train_tool, capsys, shapes_root, broken_image, tmp_path,
                                                             workers):
    line = run_train(train_tool, capsys, "--config", str(TINY_CONFIG), "--output-dir", str(tmp_path / "run"),
                     *tiny_overrides(shapes_root, None, f"data.num_workers={workers}"))
    assert broken_image.name in line and "worker" not in line


def test_unwrap_keeps_other_errors():
    assert unwrap_worker_error(ValueError("plain")) is None
    text = ("Caught KeyError in DataLoader worker process 0.\nOriginal Traceback (most recent call last):\n"
            '  File "x.py", line 1, in f\n    g()\nKeyError: \'a\'\n')
    err = unwrap_worker_error(ValueError(text.replace("KeyError", "ValueError").replace("'a'", "bad value: one line")))
    assert type(err) is ValueError and str(err) == "bad value: one line"


# --------------------------------------------------------------------------- crafted checkpoints


@pytest.fixture(scope="module")
def checkpoint(train_tool, shapes_root, tmp_path_factory) -> Path:
    """``last.pth`` of a 2-iteration tiny run (SGD)."""
    out = tmp_path_factory.mktemp("ckpt") / "run"
    assert train_tool.main(["--config", str(TINY_CONFIG), "--output-dir", str(out),
                            *tiny_overrides(shapes_root, None, "solver.max_iter=2")]) == 0
    return out / "checkpoints" / "last.pth"


def _set(state, dotted: str, value) -> None:
    *parents, leaf = dotted.split(".")
    node = state
    for part in parents:
        node = node[int(part)] if isinstance(node, list) or (part.isdigit() and part not in node) else node[part]
    if isinstance(node, list) or (leaf.isdigit() and leaf not in node):
        leaf = int(leaf)
    if value is DELETE:
        del node[leaf]
    else:
        node[leaf] = value(node[leaf]) if callable(value) else value  # a callable makes it from the saved value


DELETE = object()

CRAFTED = {
    "iteration_negative": ("iteration", -100, "field 'iteration' is -100; it must be in 0..9223372036854775807"),
    "iteration_string": ("iteration", "2", "field 'iteration' must be an integer, got '2'"),
    "iteration_float": ("iteration", 2.0, "field 'iteration' must be an integer, got 2.0"),
    "epoch_position_huge": ("epoch_position", 10**6, "field 'epoch_position' is 1000000, past the 4 batches of an "
                            "epoch of this run's training set: has the training set changed since the checkpoint?"),
    "epoch_negative": ("epoch", -1, "field 'epoch' is -1; it must be in 0..2"),
    "schedule_disagrees": ("scheduler.last_epoch", 7, "field 'scheduler.last_epoch' is 7 but 'iteration' is 2"),
    "best_value_nan": ("best_value", float("nan"), "field 'best_value' must be a finite number or null, got nan"),
    "world_size_zero": ("world_size", 0, "field 'world_size' is 0; it must be in 1..2147483648"),
    "rng_list": ("rng", [1, 2], "field 'rng' must be {'per_rank': [one entry per rank]}"),
    "rng_torch_short": ("rng.per_rank.0.torch", torch.zeros(3, dtype=torch.uint8),
                        "field 'rng.per_rank[0]' does not restore: RuntimeError"),
    "rng_python_string": ("rng.per_rank.0.python", "abc", "field 'rng.per_rank[0]' does not restore:"),
    "rng_numpy_keys": ("rng.per_rank.0.numpy.keys", torch.zeros(5, dtype=torch.int64),
                       "field 'rng.per_rank[0]' does not restore:"),
    "rng_entry_missing_key": ("rng.per_rank.0.numpy", DELETE, "field 'rng.per_rank[0]' does not restore: KeyError"),
    "rng_entry_number": ("rng.per_rank.0", 5, "field 'rng.per_rank[0]' does not restore: TypeError"),
    "optimizer_groups_broken": ("optimizer.param_groups", "x", "field 'optimizer' must hold 'state' and 'param_groups'"),
    # torch copies optimizer state unchecked: a wrong shape crashed the process (SIGSEGV) at the first step.
    "momentum_shape": ("optimizer.state.0.momentum_buffer", torch.zeros(3),
                       "field 'optimizer.state[0].momentum_buffer' has shape [3], its parameter [128, 64, 3, 3]"),
    "momentum_nan": ("optimizer.state.1.momentum_buffer", lambda t: torch.full_like(t, float("nan")),
                     "field 'optimizer.state[1].momentum_buffer' holds NaN or Inf values"),
    "optimizer_state_entry": ("optimizer.state.0", "x", "field 'optimizer.state[0]' must be a dict, got 'x'"),
    "early_stop_string": ("early_stop", "x", "field 'early_stop' must be a dict, got 'x'"),
    "early_stop_wait": ("early_stop.wait", -1, "field 'early_stop.wait' must be an integer >= 0, got -1"),
    "early_stop_best": ("early_stop.best", "high", "field 'early_stop.best' must be a finite number or null, got 'high'"),
    "early_stop_iteration": ("early_stop.best_iteration", 1.5,
                             "field 'early_stop.best_iteration' must be an integer >= 0 or null, got 1.5"),
    "ema_string": ("ema", "x", "field 'ema' must hold 'model' (a state dict) and 'updates' (an integer >= 0)"),
    "ema_other_model": ("ema", {"model": {"pixel_mean": torch.zeros(3)}, "updates": 3},
                        "field 'ema.model' does not fit this model: 'pixel_mean' is of shape [3], the model's [3, 1, 1]"),
}


@pytest.mark.parametrize("case", sorted(CRAFTED))
def test_crafted_checkpoint_is_one_line(train_tool, capsys, checkpoint, shapes_root, tmp_path, case):
    field, value, expected = CRAFTED[case]
    state = torch.load(checkpoint, map_location="cpu", weights_only=True)
    _set(state, field, value)
    crafted = tmp_path / "crafted.pth"
    torch.save(state, crafted)
    line = run_train(train_tool, capsys, "--config", str(TINY_CONFIG), "--output-dir", str(tmp_path / "run"),
                     "--resume", str(crafted), *tiny_overrides(shapes_root, None, "solver.max_iter=4"))
    assert line.startswith(f"error: --resume: {crafted}") and expected in line, line
    metrics = tmp_path / "run" / "metrics.jsonl"
    assert not metrics.exists() or '"train"' not in metrics.read_text()  # refused before any step


def test_valid_checkpoint_still_resumes(train_tool, checkpoint, shapes_root, tmp_path):
    state = torch.load(checkpoint, map_location="cpu", weights_only=True)
    assert state["optimizer_type"] == "SGD" and state["iteration"] == 2
    out = tmp_path / "run"
    assert train_tool.main(["--config", str(TINY_CONFIG), "--output-dir", str(out), "--resume", str(checkpoint),
                            *tiny_overrides(shapes_root, None, "solver.max_iter=3")]) == 0
    assert torch.load(out / "checkpoints" / "last.pth", weights_only=True)["iteration"] == 3


@pytest.mark.parametrize("recorded", [True, False], ids=["recorded", "inferred"])
def test_sgd_checkpoint_under_adamw_names_the_mismatch(train_tool, capsys, checkpoint, shapes_root, tmp_path,
                                                       recorded):
    state = torch.load(checkpoint, map_location="cpu", weights_only=True)
    if not recorded:  # a file written before optimizer_type was recorded
        del state["optimizer_type"]
    crafted = tmp_path / "sgd.pth"
    torch.save(state, crafted)
    line = run_train(train_tool, capsys, "--config", str(TINY_CONFIG), "--output-dir", str(tmp_path / "run"),
                     "--resume", str(crafted), *tiny_overrides(shapes_root, None, "solver.max_iter=4",
                                                               "solver.optimizer=adamw"))
    assert (f"error: --resume: {crafted} holds the state of a SGD optimizer but this run's solver.optimizer=adamw "
            "builds AdamW; resume with solver.optimizer=sgd") in line


def test_other_parameter_groups_are_named(train_tool, capsys, checkpoint, shapes_root, tmp_path):
    line = run_train(train_tool, capsys, "--config", str(TINY_CONFIG), "--output-dir", str(tmp_path / "run"),
                     "--resume", str(checkpoint), *tiny_overrides(shapes_root, None, "solver.max_iter=4",
                                                                  "solver.param_groups=[{match: fpn, lr_mult: 2}]"))
    assert "its optimizer has 3 parameter group(s) of [30, 46, 7] parameters, this run's has 5" in line, line


def test_resume_past_max_iter_is_refused(train_tool, capsys, checkpoint, shapes_root, tmp_path):
    """A checkpoint at iteration 2 resumed with solver.max_iter=1 said 'start training at
    iteration 2 of 1', 'finished', exit 0, and wrote max_iter 1 into config.yaml."""
    line = run_train(train_tool, capsys, "--config", str(TINY_CONFIG), "--output-dir", str(tmp_path / "run"),
                     "--resume", str(checkpoint), *tiny_overrides(shapes_root, None, "solver.max_iter=1"))
    assert line == (f"error: --resume: {checkpoint} is at iteration 2, past solver.max_iter=1: raise solver.max_iter "
                    "to train on, or evaluate it with tools/eval.py")


# --------------------------------------------------------------------------- batch settings changed on resume


def _saved(ipg: int, world: int, position: int, per_epoch: int = 0, accumulate: int = 1) -> dict:
    return {"epoch_position": position, "world_size": world,
            "config": {"solver": {"images_per_gpu": ipg, "accumulate_steps": accumulate, "iters_per_epoch": per_epoch}}}


def test_the_epoch_position_is_kept_in_images_when_the_batch_changes(caplog):
    """The position was taken as batches: 3 images done at 1 a batch became 3 batches of
    2 (6 images): 2 of the epoch's 8 images were never trained, silently."""
    from detector.engine.resume_checks import batch_geometry_position

    cfg = load_config(TINY_CONFIG, ["solver.images_per_gpu=2"])
    with caplog.at_level("WARNING", logger="detector"):
        assert batch_geometry_position(_saved(1, 1, 3), Path("last.pth"), cfg, world_size=1) == 1
    assert "the epoch's 3 batches of 1 images done are 1 batches of 2 images (solver.images_per_gpu 1 -> 2)" \
        in caplog.text
    assert batch_geometry_position(_saved(2, 1, 3), Path("last.pth"), cfg, world_size=2) == 1  # 6 images, 4 a batch
    assert batch_geometry_position(_saved(2, 1, 3), Path("last.pth"), cfg, world_size=1) == 3  # unchanged
    assert batch_geometry_position({"epoch_position": 5}, Path("last.pth"), cfg, world_size=1) == 5  # older file


def test_an_epoch_schedule_with_other_steps_an_epoch_is_refused():
    """4 epochs at 4 steps an epoch, resumed on 2 ranks (2 steps an epoch): max_iter was
    recomputed as 8 and the run 'finished' after 2 of its 4 epochs, exit 0."""
    from detector.engine.resume_checks import CheckpointError, batch_geometry_position

    cfg = load_config(TINY_CONFIG, ["solver.max_iter=0", "solver.max_epochs=4", "solver.steps=[]"])
    cfg.solver.iters_per_epoch, cfg.solver.max_iter = 2, 8  # as resolve_epoch_schedule converts it
    with pytest.raises(CheckpointError) as e:
        batch_geometry_position(_saved(2, 1, 4, per_epoch=4), Path("last.pth"), cfg, world_size=2)
    assert str(e.value) == ("--resume: last.pth trains by epochs at 4 optimizer steps an epoch; this run makes 2 "
                            "(ranks 1 -> 2): its 4 epochs would end at iteration 8 instead of 16. Resume with the "
                            "checkpoint's batch settings and ranks")
    cfg.solver.iters_per_epoch, cfg.solver.max_iter = 4, 16
    assert batch_geometry_position(_saved(2, 1, 4, per_epoch=4), Path("last.pth"), cfg, world_size=1) == 4
