"""The training loop on the real tiny model: exact resume, AMP, faults, SyncBN policy.

Everything runs on the CPU with 64-96 px images and a few iterations.
"""

from __future__ import annotations

import logging
import math
import multiprocessing
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from detector.config import load_config
from detector.data.shapes import ensure_shapes
from detector.engine.checkpointing import Checkpointer, find_resume_checkpoint, load_checkpoint
from detector.engine.hooks import NonFiniteLossError, PeriodicCheckpointer
from detector.engine.log import read_jsonl
from detector.engine.run_folder import RunFolderError
from detector.engine.setup import apply_norm_policy, configure_torch
from detector.engine.train_loop import HookBase, Trainer
from detector.engine.trainer import build_trainer
from detector.modeling import build_model
from conftest import TINY_CONFIG, load_tool, signal_train_run, tiny_config, tiny_overrides

from conftest import ROOT  # noqa: E402


@pytest.fixture(scope="module")
def data_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("shapes") / "data"  # generated on first use


def weights(trainer: Trainer) -> dict:
    return {k: v.clone() for k, v in trainer.model_without_ddp.state_dict().items()}


def checkpointer(trainer: Trainer) -> Checkpointer:
    return next(h.checkpointer for h in trainer.hooks if isinstance(h, PeriodicCheckpointer))


class SignalAt(HookBase):
    """Sends this process SIGTERM after iteration ``at``: the run stops one iteration
    later, as when a scheduler preempts it."""

    def __init__(self, at: int) -> None:
        self.at = at

    def after_step(self, state) -> None:
        if state.iteration == self.at:
            os.kill(os.getpid(), signal.SIGTERM)


def test_exact_resume_matches_straight_run(data_root, tmp_path):
    # Random flips and sizes: augmentation depends only on (seed, epoch, sample index).
    aug = ["input.hflip_prob=0.5", "input.min_size_train=[56,64,72]"]
    # Straight: 6 iterations (4 batches per epoch: crosses an epoch boundary).
    a = build_trainer(tiny_config(data_root, tmp_path / "a", *aug))
    res = a.train()
    a.close()
    assert res.status == "finished" and res.iteration == 6
    # Interrupted at 5 with a checkpoint at 3, resumed from iteration 3 (mid-epoch).
    cfg_b = tiny_config(data_root, tmp_path / "b", "train.checkpoint_period=3", *aug)
    b = build_trainer(cfg_b)
    b.hooks.append(SignalAt(4))
    res = b.train()
    b.close()
    assert res.status == "interrupted" and res.iteration == 5
    assert [r["iteration"] for r in read_jsonl(tmp_path / "b" / "metrics.jsonl")] == [1, 2, 3, 4, 5]
    b2 = build_trainer(cfg_b, resume=str(tmp_path / "b" / "checkpoints" / "iter_0000003.pth"))
    assert (b2.iteration, b2.epoch, b2.epoch_position) == (3, 0, 3)
    res = b2.train()
    b2.close()
    assert res.iteration == 6
    wa, wb = weights(a), weights(b2)
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], msg=k)
    ra = read_jsonl(tmp_path / "a" / "metrics.jsonl")
    rb = read_jsonl(tmp_path / "b" / "metrics.jsonl")
    assert [r["iteration"] for r in rb] == [1, 2, 3, 4, 5, 6]  # no gap, no duplicate
    for x, y in zip(ra, rb):
        assert x["total_loss"] == pytest.approx(y["total_loss"], rel=1e-5)
        assert x["lr"] == pytest.approx(y["lr"], rel=1e-12)
    # Every checkpoint loads with weights_only=True and knows where it stood.
    state = torch.load(tmp_path / "b" / "checkpoints" / "last.pth", weights_only=True)
    assert state["iteration"] == 6 and state["config"]["solver"]["max_iter"] == 6


def test_auto_resume_and_missing_checkpoint(data_root, tmp_path, caplog):
    cfg = tiny_config(data_root, tmp_path / "r", "solver.max_iter=2")
    with caplog.at_level(logging.INFO, logger="detector.engine"):
        t = build_trainer(cfg, resume=True)  # nothing to resume: starts fresh, and says so
    assert t.iteration == 0 and "no checkpoint to continue" in caplog.text and "starting a fresh run" in caplog.text
    t.train()
    t.close()
    cfg = tiny_config(data_root, tmp_path / "r", "solver.max_iter=3")
    t = build_trainer(cfg, resume=True)
    assert t.iteration == 2
    t.train()
    t.close()
    assert [r["iteration"] for r in read_jsonl(tmp_path / "r" / "metrics.jsonl")] == [1, 2, 3]
    with pytest.raises(RunFolderError, match="checkpoint not found: .*nope.pth"):
        build_trainer(cfg, resume=str(tmp_path / "nope.pth"))


def _inject_nan(model: nn.Module, bad_iterations: set) -> nn.Module:
    """Make the loss NaN at the given (1-based) training iterations."""
    forward = model.forward
    calls = {"n": 0}

    def nan_forward(images, targets=None):
        out = forward(images, targets)
        if model.training:
            calls["n"] += 1
            if calls["n"] in bad_iterations:
                out = dict(out)
                out["loss_roi_cls"] = out["loss_roi_cls"] * float("nan")
        return out

    model.forward = nan_forward
    return model


def test_nan_loss_is_skipped_and_logged(data_root, tmp_path, caplog):
    cfg = tiny_config(data_root, tmp_path / "n", "solver.max_iter=4")
    t = build_trainer(cfg)
    _inject_nan(t.model_without_ddp, {2})
    with caplog.at_level(logging.WARNING, logger="detector.engine"):
        res = t.train()
    t.close()
    assert res.status == "finished" and res.iteration == 4
    assert "iteration 2: non-finite loss" in caplog.text and "step skipped (1 in a row)" in caplog.text
    recs = read_jsonl(tmp_path / "n" / "metrics.jsonl")
    assert [r["nonfinite_skipped"] for r in recs] == [0, 1, 0, 0]
    assert recs[1]["total_loss"] is None and all(math.isfinite(r["total_loss"]) for r in recs if r is not recs[1])  # NaN: null


@pytest.mark.parametrize("period", [0, 2])
def test_k_nonfinite_in_a_row_stop_with_loadable_checkpoint(data_root, tmp_path, period):
    cfg = tiny_config(data_root, tmp_path / "k", "solver.max_iter=20", "train.max_nonfinite_steps=3",
                   f"train.checkpoint_period={period}")
    t = build_trainer(cfg)
    _inject_nan(t.model_without_ddp, set(range(4, 100)))
    with pytest.raises(NonFiniteLossError) as e:
        t.train()
    t.close()
    msg = str(e.value)
    assert "3 non-finite losses in a row" in msg and "at iteration 6" in msg and "\n" not in msg
    last = tmp_path / "k" / "checkpoints" / "last.pth"
    # With periodic checkpoints: the one at 2 (step 4 failed first, so resuming at 3 would
    # repeat it; step 4's skipped state was not saved). Without: the untouched weights at the stop.
    expected = 2 if period == 2 else 6
    assert f"{last} (iteration {expected})" in msg
    state = torch.load(last, weights_only=True)
    assert state["iteration"] == expected
    assert all(torch.isfinite(v).all() for v in state["model"].values() if v.is_floating_point())
    assert read_jsonl(tmp_path / "k" / "metrics.jsonl")[-1]["type"] == "stopped"


# float16 autocast is refused on a CPU device (tests/test_preflight.py), so its GradScaler runs on CUDA only.
@pytest.mark.parametrize("dtype", ["bfloat16", pytest.param("float16", marks=pytest.mark.gpu)])
def test_amp_steps_and_scaler_survives_resume(data_root, tmp_path, dtype):
    device = "train.device=cuda" if dtype == "float16" else "train.device=cpu"
    cfg = tiny_config(data_root, tmp_path / dtype, "solver.max_iter=2", "train.amp.enabled=true", f"train.amp.dtype={dtype}",
                      "solver.images_per_gpu=1", "solver.reference_batch_size=1", device)
    t = build_trainer(cfg)
    res = t.train()
    assert res.iteration == 2
    recs = read_jsonl(tmp_path / dtype / "metrics.jsonl")
    assert all(math.isfinite(r["total_loss"]) for r in recs)
    assert t.step.scaler.is_enabled() == (dtype == "float16")
    if dtype == "float16":
        assert "amp_scale" in recs[-1]
        t.step.scaler.update(new_scale=1234.0)  # a scale the default would never give
        checkpointer(t).save(["last.pth"], t.iteration)
        t.close()
        t2 = build_trainer(tiny_config(data_root, tmp_path / dtype, "solver.max_iter=3", "train.amp.enabled=true",
                                 "train.amp.dtype=float16", "solver.images_per_gpu=1", "solver.reference_batch_size=1",
                                 device),
                     resume=True)
        assert t2.step.scaler.get_scale() == 1234.0
        t2.train()
        t2.close()
    else:
        t.close()


def test_syncbn_on_cpu_falls_back_to_bn_with_warning(data_root, tmp_path, caplog):
    cfg = tiny_config(data_root, tmp_path / "s", "model.norm=syncbn", "model.freeze_at=1", "solver.max_iter=1")
    with caplog.at_level(logging.WARNING, logger="detector.engine"):
        t = build_trainer(cfg)
    assert "SyncBatchNorm needs CUDA" in caplog.text
    assert not any(isinstance(m, nn.SyncBatchNorm) for m in t.model.modules())
    assert any(isinstance(m, nn.BatchNorm2d) for m in t.model.modules())
    assert t.train().iteration == 1
    t.close()


def test_deterministic_on_cuda_says_roialign_is_compiled(caplog):
    """train.deterministic on CUDA makes torchvision compile its Python RoIAlign at the
    first step (over a minute per launch on an H200): the log says so, on CUDA only."""
    cfg = load_config(TINY_CONFIG, ["train.deterministic=true"])
    before = torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic
    try:
        with caplog.at_level(logging.INFO, logger="detector.engine"):
            configure_torch(cfg, torch.device("cpu"))
            assert "RoIAlign" not in caplog.text
            configure_torch(cfg, torch.device("cuda", 0))
        assert torch.are_deterministic_algorithms_enabled()
        assert caplog.text.count("torchvision's RoIAlign runs its deterministic version") == 1
    finally:
        torch.use_deterministic_algorithms(before[0])
        torch.backends.cudnn.deterministic = before[1]


def test_syncbn_conversion_keeps_frozen_bn(data_root, tmp_path):
    """The CUDA path of the policy (conversion only; no GPU needed to build the modules)."""
    from torchvision.ops import FrozenBatchNorm2d

    cfg = tiny_config(data_root, tmp_path / "c", "model.norm=syncbn", "model.freeze_at=2")
    model = build_model(cfg)
    n_frozen = sum(isinstance(m, FrozenBatchNorm2d) for m in model.modules())
    n_bn = sum(type(m) is nn.BatchNorm2d for m in model.modules())
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    out = apply_norm_policy(model, cfg, torch.device("cuda"), world_size=2)
    assert n_frozen > 0 and n_bn > 0
    assert sum(isinstance(m, nn.SyncBatchNorm) for m in out.modules()) == n_bn
    assert sum(isinstance(m, FrozenBatchNorm2d) for m in out.modules()) == n_frozen
    assert {n for n, p in out.named_parameters() if p.requires_grad} == trainable


# SyncBN is tested in tests/test_gpu_dist.py: two ranks against BatchNorm on the joint
# batch (float64), and DDP + SyncBN training under torchrun. At world size 1 no layer
# becomes SyncBatchNorm, and PyTorch's SyncBatchNorm refuses CPU tensors once a process
# group exists ("SyncBatchNorm expected input tensor to be on GPU ..."), so there is no
# CPU form of that test.


@pytest.mark.slow
def test_sigterm_mid_run_checkpoints_and_resumes(data_root, tmp_path):
    out = tmp_path / "sig"
    proc, stdout, args = signal_train_run(data_root, out, signal.SIGTERM, wait_s=120)
    metrics = out / "metrics.jsonl"
    assert proc.returncode == 128 + signal.SIGTERM, stdout  # 143: `train && eval` must not carry on
    assert "Traceback" not in stdout and "stopped by SIGTERM" in stdout
    assert "interrupted by SIGTERM" in stdout and "val metrics" not in stdout
    state = load_checkpoint(out / "checkpoints" / "last.pth")
    stopped = state["iteration"]
    assert 2 <= stopped < 1000
    assert [r["iteration"] for r in read_jsonl(metrics)] == list(range(1, stopped + 1))
    # Resume to two more iterations.
    proc = subprocess.run(args[:-2] + [f"solver.max_iter={stopped + 2}", "--resume"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"finished at iteration {stopped + 2}" in proc.stdout
    assert [r["iteration"] for r in read_jsonl(metrics)] == list(range(1, stopped + 3))


@pytest.mark.slow
def test_sigterm_to_the_process_group_with_loader_workers_checkpoints(data_root, tmp_path):
    """SIGTERM to the whole process group (SLURM's scancel, ``timeout``), loader workers
    included: the workers ignore it, so the main process stops at the iteration's end with
    its checkpoint and one line (a worker killed by it made the main process raise
    "DataLoader worker ... is killed by signal" mid-step: a traceback, no checkpoint)."""
    out = tmp_path / "group"
    proc, stdout, _ = signal_train_run(data_root, out, signal.SIGTERM, extra=["data.num_workers=2"], group=True)
    assert proc.returncode == 128 + signal.SIGTERM, stdout
    assert "Traceback" not in stdout and "killed by signal" not in stdout
    assert "interrupted by SIGTERM" in stdout
    assert 2 <= load_checkpoint(out / "checkpoints" / "last.pth")["iteration"] < 1000


@pytest.mark.slow
def test_cli_errors_are_one_line(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "train.py"), "--config", str(TINY_CONFIG),
                           f"train.output_dir={tmp_path}", "solver.lrr=0.1"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    err = proc.stderr.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: ")
    assert "unknown config key 'solver.lrr' (did you mean 'solver.lr'?)" in err


# --------------------------------------------------------------------------- the run folder and faults, end to end


@pytest.fixture
def cli(capsys):
    """``tools/train.py``'s ``main`` in this process: returns ``(exit status, stderr)``.
    The ``detector`` and ``py.warnings`` loggers are restored afterwards (main configures them)."""
    tool = load_tool("train")
    logs = [logging.getLogger(name) for name in ("detector", "py.warnings")]

    def run(*argv: str):
        saved = [(list(log.handlers), log.propagate, log.level) for log in logs]
        try:
            rc = tool.main([str(a) for a in argv])
        finally:
            logging.captureWarnings(False)
            for log, (handlers, propagate, level) in zip(logs, saved):
                for h in log.handlers:
                    if h not in handlers:
                        h.close()
                log.handlers[:], log.propagate, log.level = handlers, propagate, level
        return rc, capsys.readouterr().err

    return run


def cli_args(data_root: Path, out: Path, *extra: str) -> list:
    return ["--config", TINY_CONFIG, *tiny_overrides(data_root, out), *extra]


def assert_one_error_line(err: str, *parts: str) -> None:
    """One ``error:`` line holding ``parts``, no traceback (other stderr lines may be
    progress bars)."""
    lines = [line for line in err.strip().splitlines() if "error" in line.lower()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    for part in parts:
        assert part in lines[0], (part, lines[0])


def test_busy_folder_is_refused_and_the_first_run_finishes_untouched(data_root, tmp_path, cli):
    out = tmp_path / "run"
    first = build_trainer(tiny_config(data_root, out, "solver.max_iter=3"))
    config_text = (out / "config.yaml").read_text()
    rc, err = cli(*cli_args(data_root, out, "solver.max_iter=2"))
    assert rc == 1 and len(err.strip().splitlines()) == 1
    assert_one_error_line(err, f"run folder {out} is busy", f"pid {os.getpid()}")
    rc, err = cli(*cli_args(data_root, out, "solver.max_iter=2"), "--resume")  # nor may a restart join it
    assert rc == 1 and "busy" in err
    res = first.train()
    first.close()
    assert res.status == "finished" and res.iteration == 3
    assert [r["iteration"] for r in read_jsonl(out / "metrics.jsonl")] == [1, 2, 3]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["iter_0000003.pth", "last.pth"]
    assert (out / "config.yaml").read_text() == config_text and not (out / "log.txt").exists()
    # Now the folder holds a finished run: a fresh start is refused, --overwrite starts over.
    rc, err = cli(*cli_args(data_root, out, "solver.max_iter=1"))
    assert rc == 1 and len(err.strip().splitlines()) == 1
    assert_one_error_line(err, f"run folder {out} already holds checkpoints", "--resume", "--output-dir", "--overwrite")
    rc, err = cli(*cli_args(data_root, out, "solver.max_iter=1", "train.tensorboard=true"), "--overwrite")
    assert rc == 0, err
    assert [r["iteration"] for r in read_jsonl(out / "metrics.jsonl")] == [1]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["iter_0000001.pth", "last.pth"]


def test_val_images_removed_mid_run_cost_no_checkpoint(data_root, tmp_path, cli):
    """The final evaluation fails: one error line naming the checkpoint to evaluate
    later, exit status 1, and last.pth holds the final iteration."""
    val_root = tmp_path / "val_data"
    shapes = tiny_config(data_root).data.shapes  # the data, made here if this test runs first
    ensure_shapes(data_root, shapes.num_train, shapes.num_val, shapes.seed, shapes.min_side, shapes.max_side)
    shutil.copytree(data_root, val_root)
    out = tmp_path / "run"
    metrics = out / "metrics.jsonl"

    def remove_val_images_once_training_runs():
        deadline = time.time() + 120
        while not metrics.exists() and time.time() < deadline:
            time.sleep(0.01)
        for p in (val_root / "val").iterdir():
            p.unlink()

    remover = threading.Thread(target=remove_val_images_once_training_runs, daemon=True)
    remover.start()
    rc, err = cli(*cli_args(data_root, out, "solver.max_iter=4", f"data.val.root={val_root}", "train.eval_period=0"))
    remover.join()
    assert rc == 1
    last = out / "checkpoints" / "last.pth"
    assert_one_error_line(err, "evaluation at iteration 4 failed (FileNotFoundError: image file",
                          f"python tools/eval.py --config {out / 'config.yaml'} --weights {last}")
    assert torch.load(last, weights_only=True)["iteration"] == 4
    end = read_jsonl(metrics)[-1]  # the run failed: its record says why, as any failure's does
    assert end["type"] == "stopped" and end["reason"].startswith("evaluation at iteration 4 failed"), end


def test_diverged_run_names_a_finite_checkpoint_that_resumes(data_root, tmp_path):
    out = tmp_path / "lr"
    cfg = tiny_config(data_root, out, "solver.lr=1e6", "solver.max_iter=20", "solver.warmup_iters=2",
                   "train.checkpoint_period=1", "train.max_nonfinite_steps=3")
    t = build_trainer(cfg)
    with pytest.raises(NonFiniteLossError) as e:
        t.train()
    t.close()
    msg = str(e.value)
    named = re.search(r"checkpoint before the failing steps: (\S+) \(iteration (\d+)\)", msg)
    assert named and "\n" not in msg, msg
    state = torch.load(named.group(1), weights_only=True)
    assert state["iteration"] == int(named.group(2))
    tensors = [v for v in state["model"].values()] + [v for s in state["optimizer"]["state"].values() for v in s.values()]
    assert all(torch.isfinite(v).all() for v in tensors if v.is_floating_point())
    # Resume from it with a sane LR: it trains on, with finite losses.
    start = state["iteration"]
    t = build_trainer(tiny_config(data_root, out, "solver.lr=0.02", f"solver.max_iter={start + 3}", "solver.warmup_iters=2",
                         "train.checkpoint_period=0"), resume=named.group(1))
    res = t.train()
    t.close()
    assert res.status == "finished" and res.iteration == start + 3
    resumed = [r for r in read_jsonl(out / "metrics.jsonl") if r["type"] == "train" and r["iteration"] > start]
    assert len(resumed) == 3 and all(r["lr/default"] <= 0.02 for r in resumed)
    assert all(math.isfinite(r["total_loss"]) and r["nonfinite_skipped"] == 0 for r in resumed)


@pytest.mark.slow
def test_bad_resume_checkpoints_are_one_line(data_root, tmp_path, cli):
    """Empty, truncated, random bytes, a non-weights pickle, weights without training
    state, another architecture: each one line naming the file, no traceback."""
    good = tmp_path / "good.pth"
    model = build_model(tiny_config(data_root, tmp_path / "x"))
    torch.save({"model": model.state_dict(), "optimizer": {}, "scheduler": {}, "iteration": 1}, good)
    data = good.read_bytes()
    other = build_model(tiny_config(data_root, tmp_path / "x", "model.fpn_channels=64"))

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    cases = {
        "empty.pth": (b"", ""),
        "truncated.pth": (data[: len(data) // 2], ""),
        "random.pth": (bytes(range(256)) * 64, ""),
        "evil.pth": (pickle.dumps({"model": Evil()}, protocol=2), ""),
        "weights.pth": (None, "not a training checkpoint"),
        "other_arch.pth": (None, "another architecture"),
    }
    torch.save(model.state_dict(), tmp_path / "weights.pth")
    torch.save({"model": other.state_dict(), "optimizer": {}, "scheduler": {}, "iteration": 1}, tmp_path / "other_arch.pth")
    for name, (content, what) in cases.items():
        path = tmp_path / name
        if content is not None:
            path.write_bytes(content)
        rc, err = cli(*cli_args(data_root, tmp_path / f"run_{name}", "solver.max_iter=1"), "--resume", path)
        assert rc == 1, (name, err)
        assert_one_error_line(err, str(path), what)
        assert "weights_only=False" not in err and "pwned" not in err
    _, err = cli(*cli_args(data_root, tmp_path / "run_other_arch.pth", "solver.max_iter=1"), "--resume",
                 tmp_path / "other_arch.pth")
    assert "backbone.fpn" in err and "[64," in err and "[32," in err  # the first mismatched keys and shapes


def test_an_unreadable_last_checkpoint_names_the_whole_one_beside_it(data_root, tmp_path, cli, caplog):
    """A truncated last.pth: the line names the intact iter_*.pth next to it. A last.pth
    that is a link to nothing: --resume said nothing and took the numbered one."""
    run = tmp_path / "run"
    rc, _ = cli(*cli_args(data_root, run, "solver.max_iter=2", "train.checkpoint_period=1"))
    ckpts = run / "checkpoints"
    assert rc == 0 and (ckpts / "iter_0000002.pth").is_file()
    last = ckpts / "last.pth"
    last.write_bytes(last.read_bytes()[:1000])
    rc, err = cli(*cli_args(data_root, run, "solver.max_iter=3"), "--resume")
    assert rc == 1
    assert_one_error_line(err, str(last), f"the folder also holds iter_0000002.pth: --resume {ckpts / 'iter_0000002.pth'}")
    last.unlink()
    last.symlink_to(ckpts / "gone.pth")
    with caplog.at_level(logging.WARNING, logger="detector"):
        assert find_resume_checkpoint(run) == ckpts / "iter_0000002.pth"
    assert f"{last} is a link to nothing (or a loop of links); resuming from iter_0000002.pth" in caplog.text


def test_resume_followed_by_an_override_keeps_the_override(tmp_path):
    """``--resume solver.lr=0.01``: the override stays an override; a real file stays CKPT."""
    tool = load_tool("train")
    args = tool.parse_args(["--config", "c.yaml", "--resume", "solver.lr=0.01", "train.max_iter=3"])
    assert args.resume is True and args.overrides == ["solver.lr=0.01", "train.max_iter=3"]
    ckpt = tmp_path / "a=b.pth"
    ckpt.write_bytes(b"")
    args = tool.parse_args(["--config", "c.yaml", "--resume", str(ckpt), "solver.lr=0.01"])
    assert args.resume == str(ckpt) and args.overrides == ["solver.lr=0.01"]
    args = tool.parse_args(["--config", "c.yaml", "--resume"])
    assert args.resume is True and args.overrides == []


def test_close_stops_the_loaders_persistent_workers(data_root, tmp_path):
    trainer = build_trainer(tiny_config(data_root, tmp_path / "run", "data.num_workers=1",
                                        "data.persistent_workers=true", "solver.max_iter=2"))
    try:
        assert trainer.train().status == "finished"
        workers = list(trainer.loader._iterator._workers)
        assert workers and all(w.is_alive() for w in workers)
    finally:
        trainer.close()
    assert not any(w.is_alive() for w in workers)
    assert not [p for p in multiprocessing.active_children() if p in workers]
