"""``static_nms`` against ``torchvision.ops.nms``: the same boxes in the same order,
padded, on random sets, ties, identical boxes, empty inputs, all-suppressed sets,
long suppression chains, 3000-box clustered sets, thresholds that equal an IoU
(float32 and float64) and non-finite scores; by both of its methods (the blocked
resolution, and the sequential pass of ``ops.greedy_scan``, whose Triton kernel runs
here in Triton's interpreter)."""

from __future__ import annotations

from typing import List, Optional

import math
import struct

import pytest
import torch
from torchvision.ops import box_iou, nms

from detector.modeling.nms import _comparable_threshold, static_nms


def reference(boxes: torch.Tensor, scores: torch.Tensor, thr: float, max_out: int,
              valid: Optional[torch.Tensor] = None) -> List[List[int]]:
    """torchvision's keep list per image, as indices into the full (unfiltered) row."""
    out = []
    for b in range(boxes.shape[0]):
        idx = torch.arange(boxes.shape[1]) if valid is None else torch.where(valid[b])[0]
        out.append(idx[nms(boxes[b, idx], scores[b, idx], thr)][:max_out].tolist())
    return out


METHODS = pytest.mark.parametrize("method", ["blocks", "scan"])


def ours(boxes, scores, thr, max_out, valid=None, **kw) -> List[List[int]]:
    res = static_nms(boxes, scores, thr, max_out, valid=valid, **kw)
    assert res.keep.shape == (boxes.shape[0], max_out) and res.keep.dtype == torch.int64
    assert res.valid.shape == (boxes.shape[0], max_out) and res.valid.dtype == torch.bool
    # valid is a prefix of each row; padding holds 0
    assert torch.equal(res.valid, res.valid.cummin(dim=1).values)
    assert (res.keep[~res.valid] == 0).all()
    return [k[v].tolist() for k, v in zip(res.keep, res.valid)]


def random_boxes(gen: torch.Generator, batch: int, num: int, spread: float = 100.0, size: float = 30.0):
    xy = torch.rand(batch, num, 2, generator=gen) * spread
    wh = torch.rand(batch, num, 2, generator=gen) * size + 1.0
    return torch.cat((xy, xy + wh), dim=-1)


def chain(num: int, step: float, width: float = 10.0) -> torch.Tensor:
    """Boxes shifted by ``step`` along x: each overlaps its neighbours; ``[1, num, 4]``."""
    x = torch.arange(num, dtype=torch.float32) * step
    return torch.stack((x, torch.zeros(num), x + width, torch.full((num,), width)), dim=1)[None]


@pytest.mark.parametrize("seed", range(12))
@METHODS
def test_random_sets_match_torchvision(seed, method):
    gen = torch.Generator().manual_seed(seed)
    num = int(torch.randint(1, 400, (1,), generator=gen))
    boxes = random_boxes(gen, 3, num)
    if seed % 3 == 0:  # ties: few distinct scores
        scores = torch.randint(0, 4, (3, num), generator=gen).float()
    else:
        scores = torch.rand(3, num, generator=gen)
    valid = torch.rand(3, num, generator=gen) > 0.2 if seed % 2 else None
    thr = [0.3, 0.5, 0.7][seed % 3]
    for max_out in (num, 17, num + 5):
        assert ours(boxes, scores, thr, max_out, valid, method=method) == reference(boxes, scores, thr, max_out, valid)


@pytest.mark.parametrize("threshold", [0.0, 1.0, 0.5])
@pytest.mark.parametrize("seed", range(4))
@METHODS
def test_degenerate_boxes_extreme_thresholds_and_signed_scores_match_torchvision(seed, threshold, method):
    """Variants the random sets above leave out: zero-width or zero-height boxes (IoU 0
    with everything, itself included), thresholds at the ends of [0, 1] (0: any overlap
    suppresses; 1: nothing does, not even an identical box), every score equal, and
    negative scores of large magnitude."""
    gen = torch.Generator().manual_seed(100 + seed)
    num = int(torch.randint(1, 300, (1,), generator=gen))
    boxes = random_boxes(gen, 2, num)
    flat = torch.rand(2, num, generator=gen) < 0.3
    boxes[..., 2] = torch.where(flat, boxes[..., 0], boxes[..., 2])  # zero width
    boxes[:, : num // 4, 3] = boxes[:, : num // 4, 1]  # zero height
    boxes[:, num // 2:] = boxes[:, : num - num // 2].clone() if seed % 2 else boxes[:, num // 2:]  # identical boxes
    scores = [torch.full((2, num), 0.5), -torch.rand(2, num, generator=gen) * 1e6,
              torch.randint(0, 3, (2, num), generator=gen).float(), torch.rand(2, num, generator=gen)][seed]
    for max_out in (num, 1, num + 5):
        assert ours(boxes, scores, threshold, max_out, method=method) == reference(boxes, scores, threshold, max_out)


@METHODS
def test_identical_boxes_and_equal_scores_keep_the_first(method):
    boxes = torch.tensor([[[0, 0, 10, 10], [20, 20, 30, 30], [0, 0, 10, 10], [0, 0, 10, 10.0]]])
    scores = torch.full((1, 4), 0.5)
    assert ours(boxes, scores, 0.5, 4, method=method) == reference(boxes, scores, 0.5, 4) == [[0, 1]]


@METHODS
def test_empty_inputs(method):
    res = static_nms(torch.zeros(2, 0, 4), torch.zeros(2, 0), 0.5, 3, method=method)
    assert res.keep.shape == (2, 3) and not res.valid.any() and not res.unconverged.any()
    boxes = random_boxes(torch.Generator().manual_seed(0), 2, 5)
    res = static_nms(boxes, torch.rand(2, 5), 0.5, 3, valid=torch.zeros(2, 5, dtype=torch.bool), method=method)
    assert not res.valid.any()


@METHODS
def test_all_suppressed_but_one(method):
    boxes = torch.tensor([[0.0, 0.0, 10.0, 10.0]]).repeat(1, 50, 1) + torch.rand(1, 50, 1) * 0.01
    scores = torch.rand(1, 50)
    assert ours(boxes, scores, 0.5, 10, method=method) == reference(boxes, scores, 0.5, 10)
    assert len(ours(boxes, scores, 0.5, 10, method=method)[0]) == 1


@pytest.mark.parametrize("num", [100, 3000])
@METHODS
def test_long_chain_is_exact_with_the_default_bound(num, method):
    # step 1.0 on width 10: IoU with the next box 9/11 > 0.7, with the one after 8/12 < 0.7:
    # greedy keeps every other box, a decision that travels along the whole chain.
    boxes = chain(num, 1.0)
    scores = torch.linspace(1.0, 0.0, num)[None]
    want = reference(boxes, scores, 0.7, num)
    assert want[0] == list(range(0, num, 2))
    res = static_nms(boxes, scores, 0.7, num, method=method)
    assert [res.keep[0][res.valid[0]].tolist()] == want
    assert not res.unconverged.any()


def test_too_few_iterations_are_reported():
    boxes = chain(64, 1.0)
    scores = torch.linspace(1.0, 0.0, 64)[None]
    res = static_nms(boxes, scores, 0.7, 64, max_iters=4, block_size=64, method="blocks")
    assert res.unconverged.all()
    res = static_nms(boxes, scores, 0.7, 64, max_iters=64, block_size=64, method="blocks")
    assert not res.unconverged.any()


@METHODS
def test_3000_clustered_boxes_match_torchvision(method):
    gen = torch.Generator().manual_seed(7)
    centres = torch.rand(2, 30, 1, 2, generator=gen) * 500
    jitter = torch.randn(2, 30, 100, 2, generator=gen) * 4
    xy = (centres + jitter).reshape(2, 3000, 2)
    wh = (torch.rand(2, 30, 1, 2, generator=gen) * 80 + 20 + torch.randn(2, 30, 100, 2, generator=gen) * 3)
    boxes = torch.cat((xy, xy + wh.reshape(2, 3000, 2).clamp(min=2)), dim=-1)
    scores = torch.rand(2, 3000, generator=gen)
    for thr in (0.5, 0.7):
        assert ours(boxes, scores, thr, 2000, method=method) == reference(boxes, scores, thr, 2000)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="max_iters"):
        static_nms(torch.zeros(1, 2, 4), torch.zeros(1, 2), 0.5, 2, max_iters=0)
    with pytest.raises(ValueError, match="method"):
        static_nms(torch.zeros(1, 2, 4), torch.zeros(1, 2), 0.5, 2, method="fast")


def integer_boxes(gen: torch.Generator, num: int, dtype: torch.dtype) -> torch.Tensor:
    """Small integer boxes: many pairs share an IoU, so thresholds can equal one."""
    xy = torch.randint(0, 20, (num, 2), generator=gen)
    wh = torch.randint(1, 12, (num, 2), generator=gen)
    return torch.cat((xy, xy + wh), 1).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@METHODS
def test_a_threshold_equal_to_an_iou_decides_as_torchvision(dtype, method):
    # torchvision's CPU kernel compares the IoU with the double threshold: a float32
    # IoU equal to float32(0.3) > 0.3 is suppressed although float32(0.3) > float32(0.3)
    # is not; a float64 IoU must not be rounded to float32 first.
    gen = torch.Generator().manual_seed(3)
    for _ in range(60):
        boxes = integer_boxes(gen, 40, dtype)
        scores = torch.randint(0, 5, (40,), generator=gen).to(dtype)  # ties too
        ious = box_iou(boxes, boxes).flatten()
        t = float(ious[int(torch.randint(0, ious.numel(), (1,), generator=gen))])
        for thr in (t, math.nextafter(t, 0.0), math.nextafter(t, 1.0), 0.3, 0.7):
            assert ours(boxes[None], scores[None], thr, 40, method=method) == reference(boxes[None], scores[None], thr, 40), thr
    above = torch.tensor(0.3, dtype=torch.float32)  # float32(0.3) = 0.30000001...
    boxes = torch.tensor([[0.0, 0.0, 10.0, 10.0], [0.0, 0.0, 10.0 * float(above), 10.0]], dtype=dtype)
    scores = torch.tensor([[0.9, 0.8]], dtype=dtype)
    assert ours(boxes[None], scores, 0.3, 2, method=method) == reference(boxes[None], scores, 0.3, 2)


@METHODS
def test_float64_scores_are_ranked_without_rounding(method):
    boxes = torch.tensor([[[0.0, 0.0, 10.0, 10.0], [1.0, 0.0, 11.0, 10.0]]], dtype=torch.float64)
    scores = torch.tensor([[0.5, 0.5 + 1e-12]], dtype=torch.float64)  # equal in float32
    assert ours(boxes, scores, 0.5, 2, method=method) == reference(boxes, scores, 0.5, 2) == [[1]]


@METHODS
def test_non_finite_scores_rank_as_torchvision(method):
    boxes = integer_boxes(torch.Generator().manual_seed(5), 12, torch.float32)[None]
    for bad in (float("nan"), float("inf"), -float("inf")):
        scores = torch.rand(1, 12, generator=torch.Generator().manual_seed(6))
        scores[0, ::3] = bad
        assert ours(boxes, scores, 0.4, 12, method=method) == reference(boxes, scores, 0.4, 12), bad


@pytest.mark.parametrize("thr", [0.3, 0.5, 0.7, 1 / 3, 0.123456789])
def test_the_threshold_is_compared_as_each_kernel_compares(thr):
    nearest = struct.unpack("f", struct.pack("f", thr))[0]  # the CUDA kernel's float threshold
    for dtype in (torch.float16, torch.float32, torch.float64):
        assert _comparable_threshold(thr, dtype, torch.device("cuda")) == nearest
    below = _comparable_threshold(thr, torch.float32, torch.device("cpu"))
    assert struct.unpack("f", struct.pack("f", below))[0] == below <= thr  # a float32, at most thr
    following = torch.nextafter(torch.tensor(below), torch.tensor(2.0)).item()
    assert following > thr  # the next float32 is above thr: x > below <=> x > thr
    assert _comparable_threshold(thr, torch.float64, torch.device("cpu")) == thr


@pytest.mark.gpu
def test_cuda_matches_torchvision_cuda_at_thresholds_equal_to_an_iou():
    gen = torch.Generator().manual_seed(4)
    for dtype in (torch.float32, torch.float64):
        for _ in range(30):
            boxes = integer_boxes(gen, 40, dtype)
            scores = torch.rand(40, generator=gen).to(dtype)  # no ties: CUDA's sort is not stable
            ious = box_iou(boxes, boxes).flatten()
            t = float(ious[int(torch.randint(0, ious.numel(), (1,), generator=gen))])
            for thr in (t, math.nextafter(t, 0.0), 0.3):
                want = nms(boxes.cuda(), scores.cuda(), thr).cpu().tolist()
                res = static_nms(boxes[None].cuda(), scores[None].cuda(), thr, 40)
                assert res.keep[0][res.valid[0]].cpu().tolist() == want, (dtype, thr)
