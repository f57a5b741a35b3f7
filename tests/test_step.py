"""TrainStep on its own: against a hand-written reference step, skipped non-finite
steps, clipping, float16 scaling, and the stop flag."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.profiler import ProfilerActivity, profile

from detector.engine.step import AmpSettings, TrainStep


class TwoLosses(nn.Module):
    """A tiny "detector": images ``[3, 4, 4]`` -> two scalar losses against the targets."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(48, 2)
        self.poison = 1.0  # multiply loss_b by this (NaN/Inf tests)

    def forward(self, images, targets):
        x = torch.stack([im.flatten() for im in images])
        y = torch.stack([t["y"] for t in targets])
        out = self.lin(x)
        return {"loss_b": (out - y).abs().mean() * self.poison, "loss_a": ((out - y) ** 2).mean()}


def batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    images = [torch.randn(3, 4, 4, generator=g) for _ in range(2)]
    targets = [{"y": torch.randn(2, generator=g)} for _ in range(2)]
    return images, targets


def make(clip: float = 0.0, amp: AmpSettings = AmpSettings(), seed: int = 0):
    torch.manual_seed(seed)
    model = TwoLosses()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    return model, opt, sched, TrainStep(model, opt, sched, amp, clip_grad_norm=clip)


def test_step_equals_reference_sgd_step():
    model, opt, sched, step = make()
    ref = TwoLosses()
    ref.load_state_dict(model.state_dict())
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for i in range(3):
        images, targets = batch(i)
        out = step(images, targets)
        losses = ref(images, targets)
        total = losses["loss_a"] + losses["loss_b"]
        ref_opt.zero_grad()
        total.backward()
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), float("inf"))
        ref_opt.step()
        for g in ref_opt.param_groups:
            g["lr"] *= 0.5
        assert out.loss_names == ("total_loss", "loss_a", "loss_b")
        torch.testing.assert_close(out.losses, torch.stack([total, losses["loss_a"], losses["loss_b"]]).detach())
        torch.testing.assert_close(out.grad_norm, norm)
        assert not out.skipped and not out.stop
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**3)


@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_nonfinite_step_is_skipped_without_touching_state(poison):
    model, opt, sched, step = make()
    step(*batch(0))  # a momentum buffer exists from now on
    before = {k: v.clone() for k, v in model.state_dict().items()}
    momentum = [opt.state[p]["momentum_buffer"].clone() for p in model.parameters()]
    lr = opt.param_groups[0]["lr"]
    model.poison = poison
    out = step(*batch(1))
    assert out.skipped and out.nonfinite and not torch.isfinite(out.losses[0])
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert all(torch.equal(opt.state[p]["momentum_buffer"], m) for p, m in zip(model.parameters(), momentum))
    assert all(p.grad is None for p in model.parameters())
    assert opt.param_groups[0]["lr"] == pytest.approx(lr * 0.5)  # the schedule follows the iteration count
    model.poison = 1.0
    assert not step(*batch(2)).skipped


def test_clipping_scales_gradients_to_the_limit():
    model, opt, sched, step = make(clip=0.01)
    ref = TwoLosses()
    ref.load_state_dict(model.state_dict())
    images, targets = batch(0)
    out = step(images, targets)
    losses = ref(images, targets)
    (losses["loss_a"] + losses["loss_b"]).backward()
    norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.01)
    assert norm > 0.01
    torch.testing.assert_close(out.grad_norm, norm)  # the norm before clipping is reported
    with torch.no_grad():
        for p in ref.parameters():
            p -= 0.1 * p.grad  # first SGD step: momentum buffer = grad
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q)


def test_a_limit_above_the_norm_changes_no_bit_and_multiplies_nothing():
    """Clipping runs only where it scales: under the limit the step is the unclipped one
    to the bit (torch's factor would be exactly 1), with no multiply of the gradients."""
    runs = {}
    for clip in (0.0, 1e6, 0.01):
        model, opt, sched, step = make(clip=clip)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            out = step(*batch(0))
        muls = sum(e.count for e in prof.key_averages() if e.key in ("aten::_foreach_mul_", "aten::mul_"))
        runs[clip] = ([p.detach().clone() for p in model.parameters()], muls, out.grad_norm)
    assert runs[1e6][1] == 0 and runs[0.01][1] > 0 and runs[0.01][2] > 0.01
    assert all(torch.equal(a, b) for a, b in zip(runs[0.0][0], runs[1e6][0]))
    assert not all(torch.equal(a, b) for a, b in zip(runs[0.0][0], runs[0.01][0]))


def test_float16_scaler_overflow_is_skipped_but_not_nonfinite():
    """A scale so large that the float16 gradients overflow: the scaler's normal
    calibration. The step is skipped and the scale lowered, but it is not a non-finite loss."""
    torch.manual_seed(0)
    model = TwoLosses()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40)
    step = TrainStep(model, opt, torch.optim.lr_scheduler.StepLR(opt, 1), AmpSettings(True, torch.float16), scaler=scaler)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    out = step(*batch(0))
    assert out.skipped and not out.nonfinite and torch.isfinite(out.losses).all()
    assert scaler.get_scale() == 2.0**39
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    scaler.update(new_scale=256.0)
    out = step(*batch(1))
    assert not out.skipped and any(not torch.equal(v, before[k]) for k, v in model.state_dict().items())
    model.poison = float("inf")  # a truly non-finite loss
    out = step(*batch(2))
    assert out.skipped and out.nonfinite


def test_bfloat16_autocast_keeps_float32_losses():
    model, opt, sched, step = make(amp=AmpSettings(True, torch.bfloat16))
    assert not step.scaler.is_enabled()
    out = step(*batch(0))
    assert out.losses.dtype == torch.float32 and not out.skipped


def test_stop_flag_is_passed_through():
    *_, step = make()
    assert step(*batch(0), stop_requested=True).stop
    assert not step(*batch(1)).stop


def test_no_trainable_parameters_is_an_error():
    model = TwoLosses()
    opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    opt.param_groups[0]["params"] = []
    with pytest.raises(ValueError, match="no parameters to train"):
        TrainStep(model, opt, torch.optim.lr_scheduler.StepLR(opt, 1))


class CountReadBacks(TorchFunctionMode):
    """Counts the Python-level ways a tensor's value reaches the host."""

    READ_BACKS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__float__,
                  torch.Tensor.__int__, torch.Tensor.__index__, torch.Tensor.numpy}

    def __init__(self) -> None:
        super().__init__()
        self.calls: list = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.READ_BACKS:
            self.calls.append(func.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("amp", [AmpSettings(), AmpSettings(True, torch.float16)])
def test_the_step_reads_back_one_value(amp):
    """The step's own code (optimizer, scaler and scheduler included) reads one tensor
    back per iteration: the flags."""
    torch.manual_seed(0)
    model = TwoLosses()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step = TrainStep(model, opt, torch.optim.lr_scheduler.StepLR(opt, 1), amp, clip_grad_norm=1.0,
                     scaler=torch.amp.GradScaler("cpu", init_scale=8.0, enabled=amp.uses_scaler))
    step(*batch(0))  # lazy state (momentum buffers)
    with CountReadBacks() as counter:
        out = step(*batch(1))
    assert not out.skipped and counter.calls == ["tolist"]


@pytest.mark.gpu
def test_one_host_sync_per_step_on_cuda():
    """CUDA's sync debug mode warns at each device-to-host synchronisation: one per step."""
    import warnings

    torch.manual_seed(0)
    model = TwoLosses().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step = TrainStep(model, opt, torch.optim.lr_scheduler.StepLR(opt, 1), AmpSettings(True, torch.float16))
    images, targets = batch(0)
    images = [im.cuda() for im in images]
    targets = [{"y": t["y"].cuda()} for t in targets]
    step(images, targets)  # warm-up (lazy state creation)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step(images, targets)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    assert len(syncs) == 1, [str(w.message) for w in syncs]


@pytest.mark.parametrize("poison", [float("nan"), 1.0])
def test_a_skipped_first_step_does_not_warn_of_the_scheduler_order(poison, recwarn):
    """A first iteration that is skipped (a NaN; a float16 scale that overflows, as the
    scaler's calibration often does at the start) still steps the schedule, without
    torch's warning that the first LR value was skipped (it was not). The warning stays
    for the real misuse, a scheduler stepped by hand first."""
    torch.manual_seed(0)
    model = TwoLosses()
    model.poison = poison
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40 if poison == 1.0 else 1.0,
                                  enabled=poison == 1.0)
    amp = AmpSettings(True, torch.float16) if poison == 1.0 else AmpSettings()
    out = TrainStep(model, opt, sched, amp, scaler=scaler)(*batch(0))
    assert out.skipped and sched.last_epoch == 1 and opt.param_groups[0]["lr"] == pytest.approx(0.05)
    assert not [w for w in recwarn if "lr_scheduler.step()" in str(w.message)]
    opt2 = torch.optim.SGD(TwoLosses().parameters(), lr=0.1)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=1)
    with pytest.warns(UserWarning, match="before `optimizer.step\\(\\)`"):
        sched2.step()
