"""Ranks and devices: ``train.dist_backend`` (auto | nccl | gloo), the GPU of each rank,
and the one-line stop when a node has fewer GPUs than NCCL ranks. CUDA is monkeypatched
where the code asks whether it is there and how many GPUs it has; no GPU is touched."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from detector.config import ConfigError, load_config
from detector import distributed
from detector.distributed import (
    DistInfo,
    LaunchError,
    cuda_index_for_rank,
    init_distributed,
    resolve_backend,
    resolve_device,
)

from conftest import TINY_CONFIG


@pytest.mark.parametrize("backend,device_type,expected", [
    ("auto", "cuda", "nccl"), ("auto", "cpu", "gloo"), ("gloo", "cuda", "gloo"),
    ("gloo", "cpu", "gloo"), ("nccl", "cuda", "nccl"),
])
def test_resolve_backend(backend, device_type, expected):
    assert resolve_backend(backend, device_type) == expected


def test_resolve_backend_errors():
    with pytest.raises(ValueError, match="train.dist_backend=nccl needs CUDA, but the device is cpu"):
        resolve_backend("nccl", "cpu")
    with pytest.raises(ValueError, match="'train.dist_backend' is 'mpi'; expected one of auto, nccl, gloo"):
        resolve_backend("mpi", "cuda")


def test_bad_dist_backend_is_a_config_error(repo_root):
    with pytest.raises(ConfigError) as err:
        load_config(TINY_CONFIG, ["train.dist_backend=ncl"])
    assert str(err.value) == "config key 'train.dist_backend' is 'ncl'; expected one of auto, nccl, gloo"
    assert load_config(TINY_CONFIG).train.dist_backend == "auto"


def test_gloo_ranks_share_gpus_round_robin():
    assert [cuda_index_for_rank(r, 5, 2, "gloo") for r in range(5)] == [0, 1, 0, 1, 0]
    assert [cuda_index_for_rank(r, 2, 1, "gloo") for r in range(2)] == [0, 0]


def test_nccl_rank_uses_its_own_gpu():
    assert [cuda_index_for_rank(r, 4, 4, "nccl") for r in range(4)] == [0, 1, 2, 3]
    assert [cuda_index_for_rank(r, 2, 8, "nccl") for r in range(2)] == [0, 1]


def test_more_nccl_ranks_than_gpus_stops_every_rank_one_reporter():
    errors = []
    for r in range(8):
        with pytest.raises(LaunchError) as err:
            cuda_index_for_rank(r, 8, 4, "nccl")
        errors.append(err.value)
    assert len({str(e) for e in errors}) == 1  # the same line on every rank
    assert [e.report for e in errors] == [r == 4 for r in range(8)]  # printed once, by LOCAL_RANK 4
    line = str(errors[0])
    assert "\n" not in line
    assert line == ("LOCAL_RANK 4..7 has no GPU: 4 GPU(s) seen but --nproc_per_node 8 asked for; "
                    "run at most 4 processes per node (--nproc_per_node 4), "
                    "or set train.dist_backend=gloo to let ranks share GPUs (for testing)")
    with pytest.raises(LaunchError, match=r"^LOCAL_RANK 1 has no GPU: 1 GPU\(s\) seen but --nproc_per_node 2 asked"):
        cuda_index_for_rank(0, 2, 1, "nccl")


def test_unknown_local_world_size_only_gpu_less_ranks_stop():
    """Without LOCAL_WORLD_SIZE (``local_world_size`` = local_rank + 1), a rank with a GPU
    cannot know about the others: only ranks without one stop."""
    assert cuda_index_for_rank(1, 2, 2, "nccl") == 1
    with pytest.raises(LaunchError) as err:
        cuda_index_for_rank(2, 3, 2, "nccl")
    assert err.value.report


@pytest.fixture
def fake_gpus(monkeypatch):
    """``torch.cuda`` reports ``n`` GPUs; ``set_device`` records instead of touching one."""
    chosen = []

    def set_count(n: int):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        monkeypatch.setattr(torch.cuda, "set_device", lambda d: chosen.append(torch.device(d)))
        return chosen

    return set_count


def test_resolve_device_with_gloo_shares(fake_gpus):
    chosen = fake_gpus(1)
    assert resolve_device("auto", local_rank=1, backend="gloo", local_world_size=2) == torch.device("cuda", 0)
    assert resolve_device("cuda", local_rank=3, backend="gloo", local_world_size=4) == torch.device("cuda", 0)
    assert chosen == [torch.device("cuda", 0)] * 2


def test_resolve_device_nccl_checks_before_touching_a_gpu(fake_gpus):
    chosen = fake_gpus(1)
    with pytest.raises(LaunchError, match="1 GPU\\(s\\) seen but --nproc_per_node 2 asked for"):
        resolve_device("auto", local_rank=0, backend="auto", local_world_size=2)
    assert chosen == []  # stopped before set_device
    assert resolve_device("cuda:0", local_rank=1, backend="nccl", local_world_size=2) == torch.device("cuda", 0)


def test_resolve_device_cpu_ignores_gpus(fake_gpus):
    fake_gpus(0)
    assert resolve_device("auto", local_rank=3, backend="auto", local_world_size=8) == torch.device("cpu")
    with pytest.raises(ConfigError, match="'train.device' is 'cuda' but CUDA is not available: this machine has cpu"):
        resolve_device("cuda", backend="gloo")


def test_init_distributed_non_reporting_rank_waits_then_stops(fake_gpus, monkeypatch):
    fake_gpus(2)
    slept = []
    monkeypatch.setattr(distributed.time, "sleep", slept.append)
    for k, v in {"RANK": "1", "WORLD_SIZE": "3", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "3"}.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(LaunchError) as err:
        init_distributed("auto", backend="nccl")
    assert not err.value.report and slept == [distributed.QUIET_STOP_WAIT_S]
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("LOCAL_RANK", "2")
    with pytest.raises(LaunchError) as err:
        init_distributed("auto", backend="auto")
    assert err.value.report and len(slept) == 1


def test_describe_says_how_ranks_share_gpus():
    info = DistInfo(rank=0, world_size=2, local_rank=0, device=torch.device("cuda", 0), backend="gloo",
                    local_world_size=2, shared_gpus=1)
    assert info.describe() == ("rank 0 of 2 on cuda:0 (backend gloo); 2 ranks per node share 1 GPU(s): "
                               "rank r uses cuda:(LOCAL_RANK mod 1)")
    assert DistInfo(0, 1, 0, torch.device("cpu")).describe() == "rank 0 of 1 on cpu"


# Started before anything else in each process of the launch below: this CPU machine
# reports one GPU. The check must stop the launch before anything touches that GPU.
ONE_FAKE_GPU = textwrap.dedent("""
    import torch
    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: 1
""")


@pytest.mark.dist
@pytest.mark.slow
def test_torchrun_two_nccl_ranks_on_one_gpu_stop_with_one_line(repo_root, tmp_path):
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(ONE_FAKE_GPU)
    env = dict(os.environ, PYTHONPATH=f"{tmp_path / 'site'}{os.pathsep}{repo_root}", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(repo_root / "tools" / "train.py"), "--config", str(TINY_CONFIG),
           f"train.output_dir={tmp_path / 'run'}", "train.device=auto"]
    proc = subprocess.run(cmd, cwd=repo_root, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    lines = [line for line in out.splitlines() if "has no GPU" in line]
    assert lines == ["error: LOCAL_RANK 1 has no GPU: 1 GPU(s) seen but --nproc_per_node 2 asked for; "
                     "run at most 1 processes per node (--nproc_per_node 1), "
                     "or set train.dist_backend=gloo to let ranks share GPUs (for testing)"], out[-3000:]
    assert "invalid device ordinal" not in out and "CUDA error" not in out
    assert not (tmp_path / "run").exists()  # stopped before any work
