"""Gradient accumulation (``solver.accumulate_steps``): 2 micro-batches of 1 image give the
update of 1 batch of 2 images; the LR scales with the effective batch; a SIGTERM in the
middle of a cycle stops at the next optimizer step and resumes exactly."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from detector.config import load_config
from detector.engine.log import read_jsonl
from detector.engine.optim import scaled_lr
from detector.engine.step import TrainStep
from detector.engine.trainer import build_trainer
from detector.modeling import build_model
from conftest import TINY_CONFIG, tiny_config


@pytest.fixture(scope="module")
def data_root(tmp_path_factory):
    return tmp_path_factory.mktemp("shapes") / "data"  # generated on first use


# Every candidate is sampled (batch sizes above the candidate counts, positive fraction 1):
# the random draw only orders the samples, so both ways see the same anchors and RoIs.
# Each image keeps 20 proposals + its 2 boxes, so the RoI loss (normalised by the RoIs of
# the batch) is the mean of the images' losses, like the RPN loss (normalised per image).
SAME_SAMPLES = ["model.norm=gn", "rpn.batch_size_per_image=100000", "rpn.positive_fraction=1.0",
                "rpn.post_nms_topk_train=20", "roi_heads.batch_size_per_image=100000",
                "roi_heads.positive_fraction=1.0"]


def two_images():
    g = torch.Generator().manual_seed(3)
    images = [torch.randint(0, 256, (3, 64, 64), generator=g, dtype=torch.uint8) for _ in range(2)]
    targets = [{"boxes": torch.tensor([[4.0, 6.0, 30.0, 40.0], [20.0, 10.0, 60.0, 50.0]]) + i,
                "labels": torch.tensor([1, 2 + i])} for i in range(2)]
    return images, targets


def one_step(accumulate: bool):
    torch.manual_seed(0)
    cfg = load_config(TINY_CONFIG, SAME_SAMPLES)
    model = build_model(cfg).train()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.01, momentum=0.9)
    step = TrainStep(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda it: 1.0))
    images, targets = two_images()
    if accumulate:
        out = step.accumulate([([images[0]], [targets[0]]), ([images[1]], [targets[1]])])
    else:
        out = step(images, targets)
    assert not out.skipped
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out, grads, params


def test_two_micro_batches_of_one_equal_one_batch_of_two():
    big, g_big, p_big = one_step(False)
    acc, g_acc, p_acc = one_step(True)
    assert big.loss_names == acc.loss_names
    torch.testing.assert_close(acc.losses, big.losses, rtol=1e-4, atol=1e-6)
    assert g_big.keys() == g_acc.keys() and len(g_big) > 10
    for k in g_big:
        torch.testing.assert_close(g_acc[k], g_big[k], rtol=1e-3, atol=1e-6, msg=k)
    torch.testing.assert_close(acc.grad_norm, big.grad_norm, rtol=1e-4, atol=1e-6)
    for k in p_big:
        torch.testing.assert_close(p_acc[k], p_big[k], rtol=1e-4, atol=1e-7, msg=k)


def test_lr_scales_with_the_effective_batch():
    cfg = load_config(TINY_CONFIG, ["solver.lr=0.01", "solver.images_per_gpu=2", "solver.reference_batch_size=4",
                                    "solver.accumulate_steps=3"])
    assert scaled_lr(cfg, world_size=2) == pytest.approx(0.01 * 2 * 2 * 3 / 4)


@pytest.mark.parametrize("value", ["0", "-1"])
def test_accumulate_steps_below_one_is_refused(value):
    with pytest.raises(Exception, match="solver.accumulate_steps") as e:
        load_config(TINY_CONFIG, [f"solver.accumulate_steps={value}"])
    assert "\n" not in str(e.value)


def _sigterm_at_forward(model: torch.nn.Module, call: int) -> None:
    """SIGTERM to this process during the ``call``-th training forward pass (1-based)."""
    forward, calls = model.forward, {"n": 0}

    def forward_and_signal(images, targets=None):
        if model.training:
            calls["n"] += 1
            if calls["n"] == call:
                os.kill(os.getpid(), signal.SIGTERM)
        return forward(images, targets)

    model.forward = forward_and_signal


def test_sigterm_mid_cycle_resumes_exactly(data_root, tmp_path):
    """Checkpoints are written at optimizer-step boundaries only, so there is no
    mid-cycle state to lose: a SIGTERM during the second micro-batch of iteration 2
    stops after iteration 3, and the resumed run ends where the straight run ends."""
    extra = ["solver.images_per_gpu=1", "solver.accumulate_steps=2", "solver.max_iter=5"]
    a = build_trainer(tiny_config(data_root, tmp_path / "a", *extra))  # 8 images: 4 steps an epoch
    assert a.train().iteration == 5
    a.close()
    cfg_b = tiny_config(data_root, tmp_path / "b", *extra)
    b = build_trainer(cfg_b)
    _sigterm_at_forward(b.model_without_ddp, 4)
    res = b.train()
    b.close()
    assert res.status == "interrupted" and res.iteration == 3 and b.epoch_position == 6
    b2 = build_trainer(cfg_b, resume=True)
    assert (b2.iteration, b2.epoch, b2.epoch_position) == (3, 0, 6)
    assert b2.train().iteration == 5
    b2.close()
    wa, wb = a.model_without_ddp.state_dict(), b2.model_without_ddp.state_dict()
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], msg=k)
    ra = read_jsonl(tmp_path / "a" / "metrics.jsonl")
    rb = read_jsonl(tmp_path / "b" / "metrics.jsonl")
    assert [r["iteration"] for r in rb if "total_loss" in r] == [1, 2, 3, 4, 5]
    for x, y in zip([r for r in ra if "total_loss" in r], [r for r in rb if "total_loss" in r]):
        assert x["total_loss"] == pytest.approx(y["total_loss"], rel=1e-5)
