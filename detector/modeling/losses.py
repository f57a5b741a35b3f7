"""Losses: the weighted SmoothL1 of py-faster-rcnn."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor


def weighted_smooth_l1(
    pred: Tensor,
    target: Tensor,
    inside_weights: Optional[Tensor] = None,
    outside_weights: Optional[Tensor] = None,
    sigma: float = 1.0,
) -> Tensor:
    """Sum of the weighted SmoothL1 over all elements (py-faster-rcnn's ``smooth_l1``).

    ::

        d = inside_weights * (pred - target)
        f(d) = 0.5 * sigma^2 * d^2       if |d| < 1 / sigma^2
               |d| - 0.5 / sigma^2       otherwise
        loss = sum(outside_weights * f(d))

    With both weights 1 this equals
    ``F.smooth_l1_loss(pred, target, beta=1 / sigma**2, reduction="sum")``.

    Args:
        pred, target: tensors of the same shape, e.g. ``[N, 4]`` deltas.
        inside_weights: broadcastable to ``pred``; selects which coordinates are
            regressed (1 on the regressed ones, 0 elsewhere). None = 1.
        outside_weights: broadcastable to ``pred``; per-element loss weights
            (normalisation). None = 1.
        sigma: transition point ``1 / sigma^2`` between the quadratic and linear parts.

    Returns:
        a scalar tensor.
    """
    if sigma <= 0:
        raise ValueError(f"sigma must be > 0, got {sigma}")
    sigma2 = sigma * sigma
    diff = pred - target
    if inside_weights is not None:
        diff = inside_weights * diff
    abs_diff = diff.abs()
    loss = torch.where(abs_diff < 1.0 / sigma2, (0.5 * sigma2) * diff * diff, abs_diff - 0.5 / sigma2)
    if outside_weights is not None:
        loss = outside_weights * loss
    return loss.sum()
