"""The weighted SmoothL1 (design.md): reference values, continuity, gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from detector.modeling.losses import weighted_smooth_l1


def reference_loss(pred, target, inside, outside, sigma) -> float:
    """The formula of design.md, element by element in Python floats (float64)."""
    total = 0.0
    for p, t, wi, wo in zip(pred.flatten().tolist(), target.flatten().tolist(),
                            inside.flatten().tolist(), outside.flatten().tolist()):
        d = wi * (p - t)
        if abs(d) < 1.0 / sigma**2:
            f = 0.5 * sigma**2 * d * d
        else:
            f = abs(d) - 0.5 / sigma**2
        total += wo * f
    return total


@pytest.mark.parametrize("sigma", [0.5, 1.0, 3.0])
def test_unit_weights_equal_torch_smooth_l1(sigma):
    g = torch.Generator().manual_seed(0)
    pred = torch.randn(64, 4, generator=g) * 2
    target = torch.randn(64, 4, generator=g)
    expected = F.smooth_l1_loss(pred, target, beta=1.0 / sigma**2, reduction="sum")
    ones = torch.ones_like(pred)
    torch.testing.assert_close(weighted_smooth_l1(pred, target, sigma=sigma), expected)
    torch.testing.assert_close(weighted_smooth_l1(pred, target, ones, ones, sigma=sigma), expected)


@pytest.mark.parametrize("sigma", [0.5, 1.0, 3.0])
def test_random_weights_equal_float64_reference(sigma):
    g = torch.Generator().manual_seed(1)
    pred = torch.randn(30, 4, generator=g, dtype=torch.float64) * 1.5
    target = torch.randn(30, 4, generator=g, dtype=torch.float64)
    inside = torch.rand(30, 4, generator=g, dtype=torch.float64) * 2
    inside[::3] = 0.0
    outside = torch.rand(30, 4, generator=g, dtype=torch.float64)
    got = weighted_smooth_l1(pred, target, inside, outside, sigma=sigma)
    assert got.dtype == torch.float64
    assert got.item() == pytest.approx(reference_loss(pred, target, inside, outside, sigma), rel=1e-12, abs=1e-12)
    # Broadcast outside weights (one per row, as the RPN uses them) give the same value.
    row_w = torch.rand(30, 1, generator=g, dtype=torch.float64)
    got_row = weighted_smooth_l1(pred, target, inside, row_w, sigma=sigma)
    assert got_row.item() == pytest.approx(reference_loss(pred, target, inside, row_w.expand(-1, 4), sigma), rel=1e-12)


@pytest.mark.parametrize("sigma", [0.5, 1.0, 3.0])
def test_continuous_at_transition(sigma):
    knot = 1.0 / sigma**2
    zero = torch.zeros(1, dtype=torch.float64)
    for eps in (1e-6, 1e-9):
        below = weighted_smooth_l1(torch.tensor([knot - eps], dtype=torch.float64), zero, sigma=sigma)
        above = weighted_smooth_l1(torch.tensor([knot + eps], dtype=torch.float64), zero, sigma=sigma)
        at = weighted_smooth_l1(torch.tensor([knot], dtype=torch.float64), zero, sigma=sigma)
        assert abs(above.item() - below.item()) < 3 * eps
        assert at.item() == pytest.approx(0.5 / sigma**2, rel=1e-12)
    # The mis-printed form 0.5 * (sigma^2 * d)^2 would jump here unless sigma == 1.
    if sigma != 1.0:
        assert abs(0.5 * (sigma**2 * knot) ** 2 - (knot - 0.5 / sigma**2)) > 1e-3


def test_gradcheck_float64():
    g = torch.Generator().manual_seed(2)
    pred = (torch.randn(8, 4, generator=g, dtype=torch.float64) * 0.5).requires_grad_()
    target = torch.randn(8, 4, generator=g, dtype=torch.float64)
    inside = torch.rand(8, 4, generator=g, dtype=torch.float64)
    outside = torch.rand(8, 4, generator=g, dtype=torch.float64)
    # Keep every |d| away from the kink at 1/sigma^2, where the derivative is only C^0.
    for sigma in (1.0, 3.0):
        d = (inside * (pred - target)).abs().detach()
        assert ((d - 1 / sigma**2).abs() > 1e-3).all()
        assert torch.autograd.gradcheck(
            lambda p, s=sigma: weighted_smooth_l1(p, target, inside, outside, sigma=s), (pred,))


def test_zero_gradient_where_inside_weight_is_zero():
    pred = torch.randn(10, 4, requires_grad=True)
    target = torch.randn(10, 4)
    inside = torch.ones(10, 4)
    inside[3:7] = 0.0
    inside[:, 2] = 0.0
    weighted_smooth_l1(pred, target, inside, torch.full((10, 4), 0.1), sigma=3.0).backward()
    assert (pred.grad[inside == 0] == 0).all()
    assert (pred.grad[inside == 1] != 0).all()


def test_bad_sigma():
    with pytest.raises(ValueError, match="sigma"):
        weighted_smooth_l1(torch.zeros(1), torch.zeros(1), sigma=0.0)
