"""``GuardedStaticStep``: a non-finite step changes nothing (parameters, BatchNorm
buffers, momentum) and is counted on the device; refusals; CUDA-graph capture (GPU)."""

from __future__ import annotations

import pytest
import torch

from detector.config import ConfigError, load_config
from detector.engine.amp import AmpSettings
from detector.engine.graphed_step import GuardedStaticStep, check_cuda_graphs, update_scale
from detector.engine.static_step import StaticForward, static_forward
from detector.modeling import build_model

from conftest import TINY_CONFIG
from test_static_step import random_batch

STATIC = ["train.static_step=true", "model.canvas_sizes=[[96,96]]", "data.max_gt_per_image=6"]


def setup(device: str = "cpu", capture: bool = False, scaler=None, amp: AmpSettings = AmpSettings()):
    cfg = load_config(TINY_CONFIG, STATIC + [f"train.device={device}"])
    torch.manual_seed(0)
    model = build_model(cfg).to(device).train()
    forward = StaticForward.from_config(model, cfg)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4, fused=True)
    return model, forward, opt, GuardedStaticStep(model, forward.losses_fn, opt, amp, capture=capture, scaler=scaler)


def snapshot(model, opt):
    state = [t.detach().clone() for t in list(model.parameters()) + list(model.buffers())]
    return state + [s["momentum_buffer"].clone() for s in opt.state.values()]


def assert_unchanged(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def run_guard(device: str, capture: bool, scaler=None, amp: AmpSettings = AmpSettings()):
    model, forward, opt, step = setup(device, capture, scaler, amp)
    good = [forward.batch(*random_batch(s)) for s in (1, 2, 3)]
    losses, _, _ = step(good[0])
    assert torch.isfinite(losses).all() and step.loss_names[0] == "total_loss"
    before = snapshot(model, opt)
    bad = good[1]._replace(images=torch.full_like(good[1].images, float("nan")))
    losses, _, _ = step(bad)
    assert not torch.isfinite(losses[0])
    assert_unchanged(before, snapshot(model, opt))
    assert float(step.nonfinite_steps) == 1.0
    step(good[2])
    after = snapshot(model, opt)
    assert not all(torch.equal(x, y) for x, y in zip(before, after))  # a finite step updates again
    assert float(step.nonfinite_steps) == 1.0


def test_a_nonfinite_step_changes_nothing_and_is_counted():
    run_guard("cpu", capture=False)


@pytest.mark.gpu
def test_captured_step_guards_on_the_device():
    run_guard("cuda", capture=True)


def test_refusals():
    with pytest.raises(ValueError, match="'train.cuda_graphs' needs a CUDA device"):
        setup("cpu", capture=True)
    with pytest.raises(ConfigError, match="'train.cuda_graphs' needs 'train.static_step: true'"):
        load_config(TINY_CONFIG, ["train.cuda_graphs=true"])
    cfg = load_config(TINY_CONFIG, STATIC + ["train.cuda_graphs=true"])
    with pytest.raises(ValueError, match="'train.cuda_graphs' needs a CUDA device, got cpu"):
        check_cuda_graphs(cfg, torch.device("cpu"))
    with pytest.raises(ValueError, match="'train.cuda_graphs' needs a CUDA device, got cpu"):
        static_forward(cfg, build_model(cfg), world_size=1)
    model = build_model(cfg)
    adam = torch.optim.AdamW(model.parameters(), lr=0.01)
    with pytest.raises(ValueError, match="'solver.optimizer' must be sgd"):
        GuardedStaticStep(model, StaticForward.from_config(model, cfg).losses_fn, adam)


def train_three_steps(device: str, capture: bool, seeds=(1, 2, 3)):
    """The step on three random batches (the sampling seeded before each): the losses
    ``[3, 1 + L]`` and the updates (parameters and buffers minus their initial values,
    then the momentum buffers)."""
    model, forward, opt, step = setup(device, capture)
    initial = [t.detach().clone() for t in list(model.parameters()) + list(model.buffers())]
    losses = []
    for seed in seeds:
        batch = forward.batch(*random_batch(seed))
        torch.manual_seed(seed)
        losses.append(step(batch)[0].clone())
    after = snapshot(model, opt)
    return torch.stack(losses), [a - b for a, b in zip(after, initial)] + after[len(initial):]


def relative_update_difference(a, b) -> float:
    """``||a - b|| / ||b||`` over all the tensors of two updates together, in float64."""
    assert len(a) == len(b)
    diff = sum(float((x.double() - y.double()).norm()) ** 2 for x, y in zip(a, b))
    ref = sum(float(y.double().norm()) ** 2 for y in b)
    if ref == 0.0:  # (a frozen parameter's update)
        return 0.0 if diff == 0.0 else float("inf")
    return (diff / ref) ** 0.5


def test_the_update_check_tells_another_random_state_apart():
    """The GPU test's state check is not vacuous: on the CPU the same steps give the same
    update, and another random state for the third step's sampling (what a replay with
    a stale generator would draw) moves it by far more than its 1 %."""
    _, same = train_three_steps("cpu", False)
    _, again = train_three_steps("cpu", False)
    _, other = train_three_steps("cpu", False, seeds=(1, 2, 7))
    assert relative_update_difference(again, same) == 0.0
    assert relative_update_difference(other, same) > 0.05


@pytest.mark.gpu
def test_captured_step_equals_the_eager_body_on_cuda():
    # Same weights, batches and seeds: the replayed graph (whose warm-up is undone, the
    # random state included) trains as the same body run eagerly.
    loss_e, update_e = train_three_steps("cuda", False)
    loss_c, update_c = train_three_steps("cuda", True)
    # Step 1 runs the same kernels on the same inputs: within 1e-4. By step 3
    # the CUDA backward's atomic adds (RoIAlign, index_add) have made the weights differ
    # in the last bits (the first H200 run: 1.1e-4 relative); a replay of stale inputs or
    # of another random state differs by whole samples (percents).
    torch.testing.assert_close(loss_c[0], loss_e[0], rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(loss_c, loss_e, rtol=1e-3, atol=1e-6)
    # The whole update, not tensor by tensor: on an H200 (28 Nov) one tensor's state
    # differed by 25 % of its norm (which one was not recorded; the message below names
    # it now) and one weight of 100352 by 1.3 % in another, while the losses agreed to
    # 1e-3; noise that flips one sampling decision at a threshold would do that.
    per_tensor = [relative_update_difference([x], [y]) for x, y in zip(update_c, update_e)]
    worst = max(range(len(per_tensor)), key=per_tensor.__getitem__)
    assert relative_update_difference(update_c, update_e) < 1e-2, (
        f"worst tensor #{worst} of {len(per_tensor)}: {per_tensor[worst]:.3g} relative")


def scale_of(scaler) -> tuple:
    return float(scaler.get_scale()), int(scaler._get_growth_tracker())


def test_a_power_of_two_loss_scale_changes_no_bit():
    """The device-side loss scale (float16's GradScaler) scales the loss and unscales the
    gradients exactly: with a power of two, three steps train to the same bits as without."""
    runs = []
    for scaler in (None, torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1000)):
        model, forward, opt, step = setup(scaler=scaler)
        losses = []
        for seed in (1, 2, 3):
            torch.manual_seed(seed)
            losses.append(step(forward.batch(*random_batch(seed)))[0].clone())
        runs.append((torch.stack(losses), snapshot(model, opt)))
    assert torch.equal(runs[0][0], runs[1][0])
    assert_unchanged(runs[0][1], runs[1][1])


def test_the_device_scale_follows_gradscaler():
    """``update_scale`` against torch's GradScaler driven through its public calls, over
    overflows, clean steps (growth every 2) and a non-finite loss, which keeps the scale
    and its count as TrainStep keeps them (``update(get_scale())``)."""
    kwargs = dict(init_scale=2.0**10, growth_factor=2.0, backoff_factor=0.25, growth_interval=2)
    ours, ref = torch.amp.GradScaler("cpu", **kwargs), torch.amp.GradScaler("cpu", **kwargs)
    ours._lazy_init_scale_growth_tracker(torch.device("cpu"))
    w = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([w], lr=0.1)
    history = [2.0**10]
    for grad, nan_loss in ((float("inf"), False), (1.0, False), (1.0, False), (1.0, False), (float("nan"), True),
                           (1.0, False), (float("nan"), False)):
        w.grad = torch.full((3,), grad) * ref.scale(torch.ones(()))  # a scaled loss's gradient
        ref.unscale_(opt)
        ref.step(opt)
        ref.update(ref.get_scale() if nan_loss else None)
        found_inf = torch.tensor(0.0 if grad == 1.0 else 1.0)
        update_scale(ours, found_inf, keep=torch.tensor(nan_loss))
        assert scale_of(ours) == scale_of(ref), (grad, nan_loss)
        history.append(scale_of(ours)[0])
    steps = [b / a for a, b in zip(history, history[1:])]
    assert 0.25 in steps and 2.0 in steps and 1.0 in steps  # backed off, grew, and kept


def test_an_overflow_is_calibration_and_a_nan_loss_is_counted():
    """float16's rules in the guarded step: a scaled loss that overflows skips the step (no
    parameter, buffer or momentum changes) and is not counted as non-finite; a NaN loss
    skips, is counted and keeps the scale and its growth count. (The backoff itself:
    test_the_device_scale_follows_gradscaler.)"""
    scaler = torch.amp.GradScaler("cpu", init_scale=float("inf"), growth_interval=1000)
    model, forward, opt, step = setup(scaler=scaler)
    good = [forward.batch(*random_batch(s)) for s in (1, 2)]
    before = snapshot(model, opt)
    step(good[0])  # an infinite scale overflows every gradient
    assert float(step.found_inf) == 1.0 and float(step.nonfinite_steps) == 0.0
    assert_unchanged(before, snapshot(model, opt))
    scaler.update(1024.0)  # in place: the step reads the same tensor
    step(good[1])
    assert float(step.found_inf) == 0.0 and not all(torch.equal(x, y) for x, y in zip(before, snapshot(model, opt)))
    before = snapshot(model, opt)
    assert scale_of(scaler) == (1024.0, 1)
    step(good[1]._replace(images=torch.full_like(good[1].images, float("nan"))))
    assert float(step.nonfinite_steps) == 1.0 and scale_of(scaler) == (1024.0, 1)
    assert_unchanged(before, snapshot(model, opt))


@pytest.mark.gpu
def test_captured_float16_step_guards_and_scales_on_the_device():
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**10)
    run_guard("cuda", capture=True, scaler=scaler, amp=AmpSettings(True, torch.float16))
    assert scale_of(scaler)[0] == 2.0**10  # no overflow at 2^10, and the NaN step kept the scale


def test_a_loaded_scaler_state_is_the_one_the_step_runs_on():
    """A resume loads the GradScaler before the guarded step exists (it is built at the
    first call): the step then runs on the loaded scale and growth count, and a checkpoint
    saves what the step updated."""
    saved = torch.amp.GradScaler("cpu", init_scale=512.0, growth_interval=1000)
    saved._lazy_init_scale_growth_tracker(torch.device("cpu"))
    saved._growth_tracker.fill_(3)
    scaler = torch.amp.GradScaler("cpu")
    scaler.load_state_dict(saved.state_dict())
    model, forward, opt, step = setup(scaler=scaler)
    assert scale_of(scaler) == (512.0, 3)
    step(forward.batch(*random_batch(1)))
    assert float(step.found_inf) == 0.0 and scaler.state_dict() == {**saved.state_dict(), "_growth_tracker": 4}
