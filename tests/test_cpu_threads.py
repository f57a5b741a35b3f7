"""detector/modeling/cpu_threads.py: independent CPU work on several threads gives the
results of running it one piece after the other, and the model's outputs do not
depend on the thread count."""

from __future__ import annotations

import threading

import pytest
import torch

from detector.modeling import build_model, cpu_threads, roi_align
from detector.modeling.cpu_threads import map_no_grad, worker_count


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def test_map_keeps_order_turns_gradients_off_and_uses_threads(threads):
    threads(2)
    x = torch.ones(3, requires_grad=True)
    seen = set()

    def work(i: int):
        seen.add(threading.get_ident())
        return i, (x * i).requires_grad

    assert map_no_grad(work, range(6), torch.device("cpu")) == [(i, False) for i in range(6)]
    assert threading.get_ident() not in seen  # ran on worker threads
    assert worker_count(torch.device("cpu"), 5) == 2
    assert worker_count(torch.device("cpu"), 1) == 1
    assert worker_count(torch.device("meta"), 5) == 1  # not the CPU: in the caller
    threads(1)
    assert worker_count(torch.device("cpu"), 5) == 1


def test_detections_and_training_losses_equal_the_serial_run(tiny_cfg, threads, monkeypatch):
    """Proposals (NMS per image), RoIAlign (chunks of RoIs) and detections (NMS per
    image) on 3 threads and in the caller alone: the same values bit for bit. (The
    intra-op thread count stays 3 in both runs: the convolutions' rounding depends on it.)"""
    cfg = tiny_cfg("eval.score_thresh=0.0")
    threads(3)
    images = [torch.rand(3, 96, 128) * 255, torch.rand(3, 80, 112) * 255, torch.rand(3, 64, 64) * 255]
    targets = [{"boxes": torch.tensor([[10.0, 10.0, 50.0, 60.0]]), "labels": torch.tensor([1])}] * 3

    def run():
        torch.manual_seed(0)
        model = build_model(cfg).eval()  # afresh: training updates BatchNorm statistics
        with torch.inference_mode():
            dets = model(images)
        model.train()
        torch.manual_seed(1)
        losses = model(images, targets)
        return dets, {k: v.detach() for k, v in losses.items()}

    dets3, loss3 = run()
    serial = lambda device, pieces: 1  # noqa: E731
    monkeypatch.setattr(cpu_threads, "worker_count", serial)
    monkeypatch.setattr(roi_align, "worker_count", serial)
    dets1, loss1 = run()
    assert sum(len(d["boxes"]) for d in dets1) > 0
    for a, b in zip(dets1, dets3):
        for k in a:
            assert torch.equal(a[k], b[k]), k
    for k in loss1:
        assert torch.equal(loss1[k], loss3[k]), k


def test_workers_run_under_the_callers_cpu_autocast(threads, monkeypatch):
    """Autocast is per thread: without passing it on, a bfloat16 feature map reached
    torchvision's CPU roi_align kernel, which has no bfloat16 version (an error under
    ``eval.amp`` on the CPU)."""
    threads(2)
    state = lambda _: (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"))  # noqa: E731
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert map_no_grad(state, range(2), torch.device("cpu")) == [(True, torch.bfloat16)] * 2
    assert map_no_grad(state, range(2), torch.device("cpu"))[0][0] is False
    monkeypatch.setattr(roi_align, "MIN_ROIS_PER_THREAD", 4)
    feat = torch.randn(1, 4, 12, 12)
    rois = torch.cat([torch.zeros(16, 1), torch.rand(16, 2) * 20, 24 + torch.rand(16, 2) * 20], 1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bf16 = feat.to(torch.bfloat16)
        got = roi_align.roi_align_forward(bf16, rois.to(torch.bfloat16), 0.25, 3, 3, 2, False)
        expected = roi_align.tv_roi_align(bf16, rois.to(torch.bfloat16), (3, 3), 0.25, 2, False)
    assert torch.equal(got, expected)
