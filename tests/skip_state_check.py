"""A small conv net with a chosen norm layer, trained by ``TrainStep``, whose forward pass
can be poisoned with NaN inputs: the poisoned forward pass updates BatchNorm's running
statistics with NaN before the step is known to be bad.

``rank_worker`` is the spawned process of the two-rank tests (gloo): each rank steps a
good batch, snapshots its whole training state, steps a batch that is NaN on rank 1
only (so SyncBN's all-reduced statistics and DDP's flags carry it to both ranks),
then writes both states to ``rank<r>.pt`` for the test to compare.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Tuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor, nn

from detector.engine.amp import AmpSettings
from detector.engine.step import TrainStep
from detector.modeling.backbone import FrozenBatchNorm2d


def norm_layer(kind: str, channels: int) -> nn.Module:
    if kind == "frozenbn":
        return FrozenBatchNorm2d(channels)
    if kind == "gn":
        return nn.GroupNorm(2, channels)
    return nn.BatchNorm2d(channels)  # "bn", and "syncbn" before conversion


class NormNet(nn.Module):
    """images ``[3, 8, 8]`` -> conv -> norm -> ReLU -> conv -> norm -> mean: one loss
    ``(out - y)^2`` per image, averaged."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), norm_layer(kind, 4), nn.ReLU(),
                                  nn.Conv2d(4, 4, 3, padding=1), norm_layer(kind, 4))
        if kind == "syncbn":
            self.body = nn.SyncBatchNorm.convert_sync_batchnorm(self.body)
        self.poison = False

    def forward(self, images: List[Tensor], targets: List[Dict[str, Tensor]]) -> Dict[str, Tensor]:
        x = torch.stack(images)
        if self.poison:
            x = x * float("nan")
        out = self.body(x).mean(dim=(1, 2, 3))
        y = torch.stack([t["y"] for t in targets])
        return {"loss": ((out - y) ** 2).mean()}


def batch(seed: int, device: torch.device = torch.device("cpu"), n: int = 2) -> Tuple[List[Tensor], List[dict]]:
    g = torch.Generator().manual_seed(seed)
    images = [torch.randn(3, 8, 8, generator=g).to(device) for _ in range(n)]
    targets = [{"y": torch.randn((), generator=g).to(device)} for _ in range(n)]
    return images, targets


def make_step(model: nn.Module, amp: AmpSettings = AmpSettings(), world_size: int = 1,
              scaler: torch.amp.GradScaler = None) -> TrainStep:
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    return TrainStep(model, opt, sched, amp, clip_grad_norm=1.0, world_size=world_size, scaler=scaler)


def training_state(step: TrainStep) -> Dict[str, Tensor]:
    """Every tensor of the training state but the scheduler: model parameters and buffers,
    optimizer state, scaler state; flat, cloned, on the CPU."""
    model = step.model.module if isinstance(step.model, nn.parallel.DistributedDataParallel) else step.model
    out = {f"model.{k}": v.detach().cpu().clone() for k, v in model.state_dict().items()}
    for i, s in step.optimizer.state_dict()["state"].items():
        for k, v in s.items():
            out[f"optim.{i}.{k}"] = torch.as_tensor(v).cpu().clone()
    for k, v in step.scaler.state_dict().items():
        out[f"scaler.{k}"] = torch.as_tensor(v).cpu().clone()
    return out


def rank_worker(rank: int, world_size: int, kind: str, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        device = torch.device("cuda", rank % torch.cuda.device_count()) if kind == "syncbn" else torch.device("cpu")
        torch.manual_seed(0)
        net = NormNet(kind).to(device)
        model = nn.parallel.DistributedDataParallel(net, device_ids=[device.index] if device.type == "cuda" else None)
        step = make_step(model, world_size=world_size)
        step(*batch(10 + rank, device))
        before = training_state(step)
        net.poison = rank == 1
        out = step(*batch(20 + rank, device))
        after = training_state(step)
        net.poison = False
        good = step(*batch(30 + rank, device))
        torch.save({"before": before, "after": after, "skipped": torch.tensor(out.skipped),
                    "nonfinite": torch.tensor(out.nonfinite), "then_skipped": torch.tensor(good.skipped),
                    "then_finite": torch.isfinite(good.losses).all()}, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def spawn_ranks(tmp_path: Path, kind: str, world_size: int = 2) -> List[dict]:
    """``rank_worker`` on ``world_size`` spawned processes; their results in rank order."""
    mp.spawn(rank_worker, args=(world_size, kind, str(tmp_path / "store"), str(tmp_path)), nprocs=world_size, join=True)
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(world_size)]
