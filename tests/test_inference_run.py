"""``detector.evaluation.inference.inference_run``: with ``eval.amp`` a run of batches casts
each weight once (autocast's weight cache, held open over the run), gives the values of
casting per batch, and sees weights changed between runs (the trainer's evaluations); the
validation loss casts each weight once per loader too."""

from __future__ import annotations

from typing import List, Tuple

import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from detector.evaluation.inference import LOSS_NAMES, compute_val_loss, inference_run


class _Net(nn.Module):
    """Convolutions and a linear layer, one head shared by two levels (as the RPN's)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3)
        self.head = nn.Conv2d(8, 4, 1)
        self.fc = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> List[torch.Tensor]:
        f = torch.relu(self.stem(x))
        return [self.fc(self.head(level).mean((2, 3))) for level in (f, f[:, :, ::2, ::2])]


def _batch_casts(model: nn.Module, x: torch.Tensor, held: bool) -> Tuple[List[torch.Tensor], int]:
    """Outputs of the second of two batches and its count of ``aten::_to_copy``, each
    batch under its own bfloat16 autocast, inside ``inference_run`` or not."""
    with inference_run(torch.device("cpu"), amp=True) if held else torch.no_grad():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(x)
        with profile(activities=[ProfilerActivity.CPU]) as prof, torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
    return out, sum(e.count for e in prof.key_averages() if e.key == "aten::_to_copy")


def test_amp_run_casts_weights_once_with_the_same_outputs():
    torch.manual_seed(0)
    model = _Net().eval()
    x = torch.rand(2, 3, 24, 20)
    per_batch, casts_per_batch = _batch_casts(model, x, held=False)
    held, casts_held = _batch_casts(model, x, held=True)
    assert casts_per_batch - casts_held == len(list(model.parameters()))  # no parameter is cast again
    assert all(torch.equal(a, b) for a, b in zip(per_batch, held))


def test_weights_changed_between_runs_are_seen():
    """The cache lives for one run: a weight changed in place afterwards (a training step
    between two evaluations) is cast again in the next run."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(8, 4)
    x = torch.randn(3, 8)
    device = torch.device("cpu")

    def run() -> torch.Tensor:
        with inference_run(device, amp=True):
            outs = []
            for _ in range(2):
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    outs.append(layer(x))
        assert torch.equal(outs[0], outs[1])
        return outs[1]

    first = run()
    with torch.no_grad():
        layer.weight.mul_(-2.0)
    second = run()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected = layer(x)
    assert torch.equal(second, expected) and not torch.equal(second, first)


def test_without_amp_the_run_is_inference_mode():
    with inference_run(torch.device("cpu"), amp=False):
        assert torch.is_inference_mode_enabled()
    with inference_run(torch.device("cpu"), amp=True):
        assert not torch.is_grad_enabled() and not torch.is_inference_mode_enabled()
        assert not torch.is_autocast_enabled("cpu")  # held open, itself off: the loader's work is not autocast


class _LossNet(_Net):
    """``_Net`` as a detector in train mode: images and targets in, the four losses out."""

    def forward(self, images, targets):
        outs = super().forward(torch.stack(images))
        return dict(zip(LOSS_NAMES, (outs[0].mean(), outs[1].mean(), outs[0].abs().mean(), outs[1].abs().mean())))


def test_validation_loss_casts_each_weight_once_per_loader():
    torch.manual_seed(0)
    model = _LossNet()
    batch = ([torch.rand(3, 24, 20), torch.rand(3, 24, 20)], [{}, {}])
    with profile(activities=[ProfilerActivity.CPU]) as one:
        single = compute_val_loss(model, [batch], amp=True, amp_dtype=torch.bfloat16, progress=False)
    with profile(activities=[ProfilerActivity.CPU]) as three:
        triple = compute_val_loss(model, [batch] * 3, amp=True, amp_dtype=torch.bfloat16, progress=False)
    casts = [sum(e.count for e in p.key_averages() if e.key == "aten::_to_copy") for p in (one, three)]
    weights = len(list(model.parameters()))
    assert casts[0] >= weights
    assert casts[1] - casts[0] == 2 * (casts[0] - weights)  # later batches cast their inputs, not the weights
    assert triple["count"] == 3 * single["count"]
    for k in LOSS_NAMES:
        assert triple["sum"][k] == pytest.approx(3 * single["sum"][k], rel=1e-6)
