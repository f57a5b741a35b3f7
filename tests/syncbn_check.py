"""SyncBatchNorm across ranks against BatchNorm on the joint batch, in float64.

A small conv net (two BatchNorm layers with non-default statistics) runs one forward and
backward pass on a joint batch of ``JOINT_BATCH`` images. Split over ``world_size``
ranks, each rank takes a contiguous slice of that batch; with synchronised batch
statistics, the ranks' outputs and input gradients concatenated, their parameter
gradients summed, and each rank's running statistics equal the joint batch's.

``rank_worker`` is the spawned process of the GPU test (``torch.multiprocessing.spawn``);
``run_ranks_in_process`` does the same split in one process without any
synchronisation, which is what the CPU tests use to check the bookkeeping.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Dict, List

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor, nn

JOINT_BATCH = 4
Result = Dict[str, Dict[str, Tensor]]


def make_net(seed: int = 0) -> nn.Sequential:
    """conv -> BN -> ReLU -> conv -> BN, float64, with non-trivial BN parameters and statistics.

    The convolutions have no bias: BatchNorm in training mode removes it, so its exact
    gradient is zero and what a backward pass gives for it is rounding noise, different in
    every kernel (on the first H200 runs its "relative difference" was 0.58 of noise)."""
    g = torch.Generator().manual_seed(seed)
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                        nn.Conv2d(8, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4)).double()
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.5)
        for m in net.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.weight.add_(1.0)
                m.running_mean.copy_(torch.rand(m.num_features, generator=g, dtype=torch.float64))
                m.running_var.copy_(0.5 + torch.rand(m.num_features, generator=g, dtype=torch.float64))
    return net.train()


def joint_batch(seed: int = 1) -> tuple[Tensor, Tensor]:
    """Inputs ``[JOINT_BATCH, 3, 10, 12]`` (per-image offsets, so the slices' statistics
    differ from the joint ones) and loss weights ``[JOINT_BATCH, 4, 10, 12]``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(JOINT_BATCH, 3, 10, 12, generator=g, dtype=torch.float64)
    x = x + torch.arange(JOINT_BATCH, dtype=torch.float64).view(-1, 1, 1, 1)
    w = torch.randn(JOINT_BATCH, 4, 10, 12, generator=g, dtype=torch.float64)
    return x, w


def rank_slice(t: Tensor, rank: int, world_size: int) -> Tensor:
    n = t.shape[0] // world_size
    return t[rank * n:(rank + 1) * n]


def forward_backward(net: nn.Module, x: Tensor, w: Tensor) -> Result:
    """One training-mode pass with loss ``sum(net(x) * w)``: the output, the input gradient,
    parameter gradients and BatchNorm running statistics (all detached)."""
    x = x.clone().requires_grad_(True)
    out = net(x)
    (out * w).sum().backward()
    return {
        "features": {"out": out.detach()},
        "input_grad": {"x": x.grad.detach()},
        "grads": {n: p.grad.detach().clone() for n, p in net.named_parameters()},
        "running": {n: b.detach().clone() for n, b in net.named_buffers() if n.endswith(("running_mean", "running_var"))},
    }


def combine(ranks: List[Result]) -> Result:
    """The joint-batch view of per-rank results: features and input gradients concatenated in
    rank order, parameter gradients summed, running statistics of rank 0."""
    return {
        "features": {k: torch.cat([r["features"][k] for r in ranks]) for k in ranks[0]["features"]},
        "input_grad": {k: torch.cat([r["input_grad"][k] for r in ranks]) for k in ranks[0]["input_grad"]},
        "grads": {k: sum(r["grads"][k] for r in ranks) for k in ranks[0]["grads"]},
        "running": dict(ranks[0]["running"]),
    }


def max_relative_difference(got: Result, ref: Result) -> Dict[str, float]:
    """Per group, the worst tensor's ``max|got - ref| / max|ref|``."""
    out = {}
    for group, tensors in ref.items():
        assert got[group].keys() == tensors.keys(), group
        out[group] = max(float((got[group][k].cpu() - t.cpu()).abs().max() / t.abs().max().clamp_min(1e-300))
                         for k, t in tensors.items())
    return out


def run_ranks_in_process(net: nn.Module, world_size: int) -> List[Result]:
    """Each "rank" a copy of ``net`` on its slice of the joint batch, with nothing
    synchronised between them (plain BatchNorm statistics are per slice)."""
    x, w = joint_batch()
    return [forward_backward(copy.deepcopy(net), rank_slice(x, r, world_size), rank_slice(w, r, world_size))
            for r in range(world_size)]


def joint_reference(device: torch.device | str = "cpu") -> Result:
    """BatchNorm on the joint batch, one process."""
    x, w = joint_batch()
    return forward_backward(make_net().to(device), x.to(device), w.to(device))


def rank_worker(rank: int, world_size: int, backend: str, init_file: str, out_dir: str, sync: bool) -> None:
    """One spawned rank: process group from ``init_file``, the net (SyncBatchNorm when
    ``sync``) on ``cuda:(rank mod GPU count)`` (CPU when there is no GPU), its slice of the
    joint batch, parameter gradients all-reduced (summed); writes ``rank<r>.pt``."""
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        if torch.cuda.is_available():
            device = torch.device("cuda", rank % torch.cuda.device_count())
            torch.cuda.set_device(device)
        else:
            device = torch.device("cpu")
        net = make_net()
        if sync:
            net = nn.SyncBatchNorm.convert_sync_batchnorm(net)
        net.to(device)
        x, w = joint_batch()
        result = forward_backward(net, rank_slice(x, rank, world_size).to(device), rank_slice(w, rank, world_size).to(device))
        for g in result["grads"].values():
            dist.all_reduce(g)
        result = {group: {k: t.cpu() for k, t in tensors.items()} for group, tensors in result.items()}
        result["meta"] = {"sync_layers": torch.tensor(sum(isinstance(m, nn.SyncBatchNorm) for m in net.modules())),
                          "device_index": torch.tensor(-1 if device.index is None else device.index)}
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def spawn_ranks(tmp_path: Path, world_size: int, backend: str, sync: bool) -> List[dict]:
    """Run ``rank_worker`` on ``world_size`` spawned processes; their results in rank order.
    (Spawned, not forked: a forked child can use neither CUDA nor, after the parent has
    started its OpenMP threads, the CPU kernels.)"""
    mp.spawn(rank_worker, args=(world_size, backend, str(tmp_path / "store"), str(tmp_path), sync),
             nprocs=world_size, join=True)
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(world_size)]
