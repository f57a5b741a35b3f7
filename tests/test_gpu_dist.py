"""The distributed GPU paths: SyncBatchNorm across ranks, and DDP + SyncBN + AMP training
with an exact resume, on one GPU (gloo, ranks sharing it) and, where a machine has two
or more GPUs, with NCCL. These need CUDA (marker ``gpu``); the CPU tests at the top check
the bookkeeping that the SyncBN test relies on, with plain BatchNorm."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import syncbn_check as sc
from detector.data.shapes import ensure_shapes

from conftest import ROOT, descendants  # noqa: E402
TOL = 1e-10

BACKENDS = [
    "gloo",
    pytest.param("nccl", marks=pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs 2 GPUs")),
]


# ----------------------------------------------------------------- CPU: the check's bookkeeping


def test_split_without_batch_statistics_equals_joint_batch():
    """BatchNorm in eval mode has no batch dependence: slices concatenated (features,
    input gradients) and summed (parameter gradients) give the joint batch's numbers, so
    the check's split and recombination are right."""
    net = sc.make_net().eval()
    x, w = sc.joint_batch()
    joint = sc.forward_backward(sc.make_net().eval(), x, w)
    diff = sc.max_relative_difference(sc.combine(sc.run_ranks_in_process(net, 2)), joint)
    assert diff["features"] == 0.0 and diff["input_grad"] == 0.0 and diff["running"] == 0.0
    assert diff["grads"] < 1e-14


def test_unsynchronised_batchnorm_fails_the_check():
    """Plain BatchNorm per rank (training mode) is far from the joint batch: the 1e-10
    tolerance of the GPU test can fail. One rank is the joint batch itself."""
    diff = sc.max_relative_difference(sc.combine(sc.run_ranks_in_process(sc.make_net(), 2)), sc.joint_reference())
    assert all(d > 1e-3 for d in diff.values()), diff
    one = sc.max_relative_difference(sc.combine(sc.run_ranks_in_process(sc.make_net(), 1)), sc.joint_reference())
    assert all(d == 0.0 for d in one.values()), one


def test_the_tolerance_holds_for_another_summation_order():
    """The joint batch computed another way (channels-last memory: other reduction orders)
    stays within the GPU test's 1e-10 in every group: no tensor of the check is rounding
    noise (a conv bias before BatchNorm was: its exact gradient is zero)."""
    x, w = sc.joint_batch()
    other = sc.forward_backward(sc.make_net().to(memory_format=torch.channels_last),
                                x.to(memory_format=torch.channels_last), w)
    diff = sc.max_relative_difference(other, sc.joint_reference())
    assert all(d < TOL for d in diff.values()), diff
    assert all(float(g.abs().max()) > 1e-3 for g in other["grads"].values())


@pytest.mark.dist
@pytest.mark.slow
def test_spawned_ranks_on_cpu_match_in_process_split(tmp_path):
    """The GPU test's worker, run on the CPU with gloo and plain BatchNorm (SyncBatchNorm
    needs a GPU): its per-rank results and all-reduced gradients are the in-process split's."""
    ranks = sc.spawn_ranks(tmp_path, 2, "gloo", sync=False)
    expected = sc.run_ranks_in_process(sc.make_net(), 2)
    summed = sc.combine(expected)["grads"]
    for r, (got, exp) in enumerate(zip(ranks, expected)):
        assert int(got["meta"]["sync_layers"]) == 0
        for group in ("features", "input_grad", "running"):
            for k, t in exp[group].items():
                assert torch.equal(got[group][k], t), (r, group, k)
        for k, t in summed.items():
            torch.testing.assert_close(got["grads"][k], t, rtol=1e-15, atol=0.0)


# ----------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.dist
@pytest.mark.parametrize("backend", BACKENDS)
def test_syncbn_two_ranks_equals_batchnorm_on_joint_batch_float64(tmp_path, backend):
    ranks = sc.spawn_ranks(tmp_path, 2, backend, sync=True)
    assert [int(r["meta"]["sync_layers"]) for r in ranks] == [2, 2]
    expected_gpu = [0, 0] if backend == "gloo" and torch.cuda.device_count() == 1 else [0, 1]
    assert [int(r["meta"]["device_index"]) for r in ranks] == expected_gpu
    ref = sc.joint_reference(torch.device("cuda", 0))
    # Each rank's gradients are already all-reduced (summed over ranks) by the worker:
    # they are the joint batch's on every rank, not to be summed again.
    for k, g in ranks[0]["grads"].items():
        assert torch.equal(g, ranks[1]["grads"][k]), k
    diff = sc.max_relative_difference({**sc.combine(ranks), "grads": ranks[0]["grads"]}, ref)
    assert all(d < TOL for d in diff.values()), diff
    for r in ranks:  # every rank's running statistics are the joint batch's
        running = sc.max_relative_difference({"running": r["running"]}, {"running": ref["running"]})
        assert running["running"] < TOL, running
    # Not vacuous: the ranks' batch statistics differ from the joint batch's.
    unsynced = sc.max_relative_difference(sc.combine(sc.run_ranks_in_process(sc.make_net(), 2)), sc.joint_reference())
    assert unsynced["features"] > 1e-3


def train_command(nproc: int, out: Path, data: Path, backend: str, *extra: str) -> list:
    """``torchrun`` on ``tools/train.py``: the tiny model, 2 images per rank, SyncBN, AMP
    float16, deterministic, on CUDA with ``backend``."""
    overrides = [
        f"train.output_dir={out}", f"data.train.root={data}", f"data.val.root={data}",
        "data.shapes.num_train=16", "data.shapes.num_val=4", "data.shapes.min_side=64", "data.shapes.max_side=96",
        "data.num_workers=0", "input.min_size_train=[64,80]", "input.max_size_train=112", "input.hflip_prob=0.5",
        "model.norm=syncbn", "model.freeze_at=1", "model.fpn_channels=32", "roi_heads.representation_size=64",
        "rpn.batch_size_per_image=64", "roi_heads.batch_size_per_image=32",
        "rpn.pre_nms_topk_train=200", "rpn.post_nms_topk_train=100",
        "solver.images_per_gpu=2", "solver.reference_batch_size=4", "solver.lr=0.01",
        "solver.warmup_iters=2", "solver.steps=[7]",
        "train.device=auto", f"train.dist_backend={backend}", "train.amp.enabled=true", "train.amp.dtype=float16",
        "train.seed=5", "train.deterministic=true", "train.log_period=1", "train.eval_period=-1",
        "train.checkpoint_period=0", "train.tensorboard=false",
    ]
    # configs/tiny_cpu.yaml with every setting that matters given above: the GPU runs these
    # tests compare were made so; tests/configs/tiny.yaml would differ in test-time sizes
    # and proposal counts, which this machine-less check cannot rerun.
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            str(ROOT / "tools" / "train.py"), "--config", str(ROOT / "configs" / "tiny_cpu.yaml"), *overrides, *extra]


# One launch's limit. With train.deterministic on CUDA, torchvision's RoIAlign runs its
# deterministic Python version through torch.compile, compiled in each rank at its first
# call: the first launch on a fresh machine (beside other tests) took over 60 s on an H200.
LAUNCH_TIMEOUT_S = 200.0


def start(cmd: list) -> subprocess.Popen:
    """``cmd`` in a session of its own, its output piped."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", NO_ALBUMENTATIONS_UPDATE="1",
               PYTHONFAULTHANDLER="1")
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def signal_launch(proc: subprocess.Popen, sig: int) -> None:
    """``sig`` to every process under ``proc`` (a launch's ranks and their workers, which
    run in sessions of their own), the deepest first."""
    for pid in reversed(descendants(proc.pid)):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def finish(proc: subprocess.Popen, timeout_s: float = LAUNCH_TIMEOUT_S) -> str:
    """``proc``'s output; it must exit 0 within ``timeout_s``. A launch still running then
    fails the test with every process's Python stacks: its workers (in sessions of their
    own under torchrun) get SIGABRT, which faulthandler turns into a dump of their threads."""
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        signal_launch(proc, signal.SIGABRT)
        try:
            out, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
        pytest.fail(f"still running after {timeout_s:.0f} s: {' '.join(map(str, proc.args[-3:]))}\n{out[-12000:]}")
    assert proc.returncode == 0, out[-8000:]
    return out


@pytest.mark.gpu
@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_ddp_syncbn_amp_resume_equals_straight_run(tmp_path, backend):
    data = tmp_path / "shapes"
    ensure_shapes(data, 16, 4, 0, 64, 96)  # once, before the ranks start
    # The straight run and the resumed run's first half side by side (separate folders).
    straight_proc = start(train_command(2, tmp_path / "straight", data, backend, "solver.max_iter=10"))
    try:
        first = finish(start(train_command(2, tmp_path / "resumed", data, backend, "solver.max_iter=5")))
        straight = finish(straight_proc)
    finally:
        signal_launch(straight_proc, signal.SIGKILL)  # a failed first half: no orphaned ranks
        if straight_proc.poll() is None:
            straight_proc.kill()
            straight_proc.communicate()
    assert "finished at iteration 10" in straight
    if backend == "gloo" and torch.cuda.device_count() == 1:
        assert "2 ranks per node share 1 GPU(s)" in straight
    assert "Traceback" not in straight
    assert "finished at iteration 5" in first
    second = finish(start(train_command(2, tmp_path / "resumed", data, backend, "solver.max_iter=10", "--resume")))
    assert "finished at iteration 10" in second

    a = torch.load(tmp_path / "straight" / "checkpoints" / "last.pth", weights_only=True, map_location="cpu")
    b = torch.load(tmp_path / "resumed" / "checkpoints" / "last.pth", weights_only=True, map_location="cpu")
    assert a["iteration"] == b["iteration"] == 10 and a["world_size"] == b["world_size"] == 2
    # SyncBN layers trained: running statistics moved from their initial values.
    assert any(k.endswith("running_var") and not torch.equal(v, torch.ones_like(v)) for k, v in a["model"].items())
    assert a["model"].keys() == b["model"].keys()
    differ = [k for k in a["model"] if not torch.equal(a["model"][k], b["model"][k])]
    assert differ == []  # bit-identical, as the CPU resume tests require
    assert a["scaler"] == b["scaler"]


@pytest.mark.gpu
@pytest.mark.dist
def test_more_nccl_ranks_than_gpus_stops_with_one_line(tmp_path):
    n = torch.cuda.device_count()
    cmd = train_command(n + 1, tmp_path / "run", tmp_path / "shapes", "auto", "solver.max_iter=2")
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", NO_ALBUMENTATIONS_UPDATE="1")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    lines = [line for line in out.splitlines() if "has no GPU" in line]
    assert lines == [f"error: LOCAL_RANK {n} has no GPU: {n} GPU(s) seen but --nproc_per_node {n + 1} asked for; "
                     f"run at most {n} processes per node (--nproc_per_node {n}), "
                     "or set train.dist_backend=gloo to let ranks share GPUs (for testing)"], out[-3000:]
    assert "invalid device ordinal" not in out
