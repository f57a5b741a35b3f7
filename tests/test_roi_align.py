"""detector/ops/roi_align.py: the CPU gather (forward and backward) against
torchvision's op, gradcheck, and the fallbacks to torchvision's op; the static step's
pooler (detector/modeling/static_roi_heads.py) against the eager one."""

import pytest
import torch
from torch.profiler import ProfilerActivity, profile
from torchvision.ops import roi_align as tv_roi_align

from detector.modeling.roi_heads import MultiLevelRoIAlign
from detector.modeling.static_roi_heads import static_roi_align
from detector.ops.roi_align import multi_level_roi_align, pool_every_level, roi_align, rois_on_level

from benchmarks.roi_align_speed import benchmark_roi_align, format_roi_align


def _case(n=2, c=8, h=20, w=24, r=40, scale=0.25, seed=0):
    g = torch.Generator().manual_seed(seed)
    feat = torch.randn(n, c, h, w, generator=g, requires_grad=True)
    size = torch.tensor([w / scale, h / scale])
    xy = torch.rand(r, 2, generator=g) * size * 1.1 - 6  # some boxes cross the border
    wh = torch.exp(torch.rand(r, 2, generator=g) * 4) * 2
    rois = torch.cat([torch.randint(0, n, (r, 1), generator=g).float(), xy, xy + wh], 1)
    rois[0, 1:] = torch.tensor([-40.0, -40.0, -20.0, -20.0])  # fully outside
    rois[1, 1:] = torch.tensor([10.0, 10.0, 10.2, 10.1])  # smaller than a pixel
    rois[2, 1:] = torch.tensor([0.0, 0.0, w / scale, h / scale])  # the whole map
    return feat, rois


@pytest.mark.parametrize("aligned", [False, True])
@pytest.mark.parametrize("sampling_ratio", [1, 2, 3])
def test_matches_torchvision(aligned, sampling_ratio):
    feat, rois = _case()
    out = roi_align(feat, rois, (7, 6), 0.25, sampling_ratio, aligned)
    ref = tv_roi_align(feat, rois, (7, 6), 0.25, sampling_ratio, aligned)
    assert out.grad_fn.name() == "PermuteBackward0"  # the gather, not torchvision's op
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)  # 4 * sr**2 terms summed in another order
    grad = torch.randn_like(out)
    (g_out,) = torch.autograd.grad(out, feat, grad)
    (g_ref,) = torch.autograd.grad(ref, feat, grad)
    torch.testing.assert_close(g_out, g_ref, rtol=1e-5, atol=1e-6)


def test_float64_values_and_gradient_match_torchvision_closely():
    """In float64 the summation order leaves the values and gradients torchvision's to 1e-12."""
    feat, rois = _case(n=2, c=3, r=50)
    feat = feat.detach().double().requires_grad_()
    out = roi_align(feat, rois.double(), (5, 4), 0.25, 2, True)
    ref = tv_roi_align(feat, rois.double(), (5, 4), 0.25, 2, True)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    grad = torch.randn_like(out)
    torch.testing.assert_close(torch.autograd.grad(out, feat, grad)[0], torch.autograd.grad(ref, feat, grad)[0],
                               rtol=1e-12, atol=1e-12)


def test_no_rois_give_empty_output_and_zero_gradient():
    feats = [torch.randn(2, 4, 8, 8, requires_grad=True), torch.randn(2, 4, 4, 4, requires_grad=True)]
    out = multi_level_roi_align(feats, torch.zeros(0, 5), torch.zeros(0, dtype=torch.int64), (3, 3), [0.5, 0.25],
                                2, False)
    assert out.shape == (0, 4, 3, 3)
    grads = torch.autograd.grad(out.sum(), feats)
    assert all(g.shape == f.shape and not g.any() for g, f in zip(grads, feats))


def test_gradient_is_the_same_on_every_run():
    """The backward sorts and sums in a fixed order: bit-identical gradients on two runs,
    on one thread and on two (the training step's reproducibility rests on it)."""
    feat, rois = _case(r=300)
    grad = torch.randn(300, 8, 7, 7, generator=torch.Generator().manual_seed(5))
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2, 1, 2):
            torch.set_num_threads(n)
            results.append(torch.autograd.grad(roi_align(feat, rois, 7, 0.25, 2), feat, grad)[0])
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(r, results[0]) for r in results[1:])


def test_gradcheck_multi_level_float64():
    g = torch.Generator().manual_seed(6)
    feats = [torch.randn(2, 1, 8 // s, 10 // s, generator=g, dtype=torch.float64, requires_grad=True) for s in (1, 2)]
    _, rois = _case(n=2, c=1, h=8, w=10, r=6, scale=1.0, seed=7)
    rois = rois.double()
    levels = torch.tensor([0, 1, 0, 1, 1, 0])
    assert torch.autograd.gradcheck(
        lambda a, b: multi_level_roi_align([a, b], rois, levels, (3, 2), [1.0, 0.5], 2, False), tuple(feats))


def test_gradcheck_float64():
    feat, rois = _case(n=1, c=2, h=6, w=7, r=5, scale=0.5)
    feat = feat.detach().double().requires_grad_()
    rois = rois.double()
    rois[:, 0] = 0
    assert torch.autograd.gradcheck(lambda f: roi_align(f, rois, 3, 0.5, 2, False), (feat,))


def test_falls_back_without_grad_and_for_adaptive_sampling():
    feat, rois = _case()
    with torch.no_grad():
        assert torch.equal(roi_align(feat, rois, 7, 0.25, 2), tv_roi_align(feat, rois, 7, 0.25, 2))
    out = roi_align(feat, rois, 7, 0.25, 0)  # adaptive grid: torchvision's op
    assert torch.equal(out, tv_roi_align(feat, rois, 7, 0.25, 0))
    assert out.grad_fn.name() != "PermuteBackward0"  # not the gather


def test_under_bfloat16_autocast_matches_torchvision():
    feat, rois = _case()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = roi_align(feat, rois, 7, 0.25, 2)
        ref = tv_roi_align(feat, rois, 7, 0.25, 2)
    assert out.dtype == ref.dtype == torch.float32  # torchvision's op runs in float32 under autocast; the gather too
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    (g_out,) = torch.autograd.grad(out.float().sum(), feat)
    (g_ref,) = torch.autograd.grad(ref.float().sum(), feat)
    torch.testing.assert_close(g_out, g_ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("aligned", [False, True])
def test_multi_level_matches_torchvision_level_by_level(aligned):
    """One gather over all levels = torchvision's op on each level's RoIs, forward and backward."""
    g = torch.Generator().manual_seed(1)
    feats = [torch.randn(2, 5, 64 // s, 80 // s, generator=g, requires_grad=True) for s in (4, 8, 16, 32)]
    scales = [1 / 4, 1 / 8, 1 / 16, 1 / 32]
    _, rois = _case(n=2, c=5, h=16, w=20, r=60, scale=0.25, seed=2)
    levels = torch.randint(0, 4, (60,), generator=g)
    out = multi_level_roi_align(feats, rois, levels, (7, 7), scales, 2, aligned)
    ref = torch.zeros_like(out)
    for lv, (f, s) in enumerate(zip(feats, scales)):
        idx = torch.where(levels == lv)[0]
        ref[idx] = tv_roi_align(f, rois[idx], 7, s, 2, aligned)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    grad = torch.randn(out.shape, generator=g)
    ours = torch.autograd.grad(out, feats, grad)
    theirs = torch.autograd.grad(ref, feats, grad)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)  # sums of up to ~100 terms, another order


@pytest.mark.parametrize("layout", ["mixed", "one_level", "none"])
def test_no_grad_multi_level_pooling_is_level_by_level(layout):
    """Without a gradient the values are torchvision's op level by level, in RoI order,
    whether the RoIs spread over the levels, all sit on one, or there are none."""
    feat, rois = _case(r=199)
    feats = [feat.detach(), feat.detach()[:, :, ::2, ::2].contiguous(), feat.detach()[:, :, ::4, ::4].contiguous()]
    scales = [0.25, 0.125, 0.0625]
    g = torch.Generator().manual_seed(3)
    levels = {"mixed": torch.randint(0, 3, (rois.shape[0],), generator=g),
              "one_level": torch.ones(rois.shape[0], dtype=torch.int64), "none": None}[layout]
    if levels is None:
        rois, levels = rois[:0], torch.zeros(0, dtype=torch.int64)
    with torch.no_grad():
        out = multi_level_roi_align(feats, rois.detach(), levels, (7, 6), scales, 2, False)
    assert out.shape == (rois.shape[0], feat.shape[1], 7, 6)
    for level, scale in enumerate(scales):
        ref = tv_roi_align(feats[level], rois[levels == level].detach(), (7, 6), scale, 2, False)
        assert torch.equal(out[levels == level], ref)


@pytest.mark.parametrize("grad", [False, True])
def test_low_precision_features_keep_float32_boxes_under_autocast(grad):
    """Under autocast torchvision's op runs in float32 and casts the boxes itself: the
    boxes must reach it in float32, not rounded to the features' bfloat16 (a box edge
    near 700 px would move by up to 2 px). Same values as torchvision's op per level."""
    g = torch.Generator().manual_seed(4)
    feats = [torch.randn(1, 4, 200 // s, 200 // s, generator=g).bfloat16().requires_grad_(grad) for s in (4, 8)]
    rois = torch.tensor([[0.0, 600.3, 601.7, 700.9, 699.4], [0.0, 11.3, 13.9, 40.2, 47.7],
                         [0.0, 301.1, 5.3, 790.6, 402.2]])
    levels = torch.tensor([0, 0, 1])
    assert not torch.equal(rois.bfloat16().float(), rois)  # bfloat16 would move these edges
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.set_grad_enabled(grad):
        out = multi_level_roi_align(feats, rois, levels, (3, 3), [0.25, 0.125], 2, False)
        for level, scale in enumerate((0.25, 0.125)):
            ref = tv_roi_align(feats[level], rois[levels == level], (3, 3), scale, 2, False)
            assert torch.equal(out[levels == level], ref)


@pytest.mark.parametrize("aligned", [False, True])
@pytest.mark.parametrize("sampling_ratio", [0, 2])
def test_static_pooler_equals_the_eager_pooler(aligned, sampling_ratio):
    """``static_roi_align`` (every level called with all RoIs, the other levels' moved
    outside the map) gives the eager pooler's values and feature gradients, for boxes on
    all four levels, inside, across the border and outside the image."""
    pooler = MultiLevelRoIAlign([4, 8, 16, 32], 7, sampling_ratio, aligned)
    g = torch.Generator().manual_seed(3)
    feats = [torch.randn(2, 8, 64 // s, 96 // s, generator=g, requires_grad=True) for s in (1, 2, 4, 8)]
    xy = torch.rand(2, 30, 2, generator=g) * torch.tensor([380.0, 250.0]) - 20
    wh = torch.exp(torch.rand(2, 30, 2, generator=g) * 6.0) * 2  # 2 to 800 px: every level
    boxes = torch.cat([xy, xy + wh], dim=2)
    levels = pooler.level_of(boxes.reshape(-1, 4))
    assert set(levels.tolist()) == {0, 1, 2, 3}
    out = static_roi_align(pooler, feats, boxes)
    ref = pooler(feats, list(boxes))
    with torch.no_grad():
        assert torch.equal(out, pooler(feats, list(boxes)))  # without a gradient both are torchvision's op
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)  # with one, the eager pooler gathers
    grad = torch.randn(out.shape, generator=g)
    for a, b in zip(torch.autograd.grad(out, feats, grad), torch.autograd.grad(ref, feats, grad)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_rois_moved_off_their_level_pool_zeros_and_add_no_gradient():
    """What ``static_roi_align`` relies on: a RoI moved by ``rois_on_level`` lies outside
    the map for every sampling setting, so torchvision's kernel pools zeros for it and its
    backward adds nothing (no features read, no atomic adds on CUDA)."""
    feat, rois = _case(r=12)
    mine = torch.zeros(12, dtype=torch.bool)
    for aligned in (False, True):
        for sr in (0, 1, 2):
            out = tv_roi_align(feat, rois_on_level(rois, mine, 0.25), 7, 0.25, sr, aligned)
            assert torch.equal(out, torch.zeros_like(out))
            (grad,) = torch.autograd.grad(out, feat, torch.ones_like(out))
            assert torch.equal(grad, torch.zeros_like(grad))
    kept = rois_on_level(rois, ~mine, 0.25)
    assert torch.equal(kept, rois)


def test_roi_align_task_times_both_ways_and_they_agree(tiny_cfg):
    """``tools/benchmark.py --task roi-align`` (its arguments are parsed by
    tests/test_docs_commands.py): torchvision's op level by level against the model's
    pooler, forward and backward, at the config's sizes; their outputs and gradients
    agree (the check that backs the speed figure)."""
    res = benchmark_roi_align(tiny_cfg(), iters=2, warmup=1)
    assert set(res["runs"]) == {"torchvision", "ours"}
    assert all(r["iters"] == 2 and r["median_s"] > 0 for r in res["runs"].values())
    assert res["rois"] == 2 * 32 and len(res["levels"]) == 4 and res["levels"][0][:2] == [2, 32]
    assert 0 < res["max_abs_diff"]["output"] < 1e-5 and res["max_abs_diff"]["gradient"] < 1e-4
    assert "torchvision / ours" in format_roi_align(res)


@pytest.mark.parametrize("grad", [False, True])
def test_every_level_pooling_equals_level_by_level(grad):
    """``pool_every_level`` (what the pooler does off the CPU: no ``nonzero``, no host
    sync) gives torchvision's op level by level to the bit, and the same feature
    gradients, for RoIs on all levels and a level with none."""
    g = torch.Generator().manual_seed(8)
    feats = [torch.randn(2, 4, 64 // s, 48 // s, generator=g).requires_grad_(grad) for s in (1, 2, 4, 8, 16)]
    scales = [1.0, 0.5, 0.25, 0.125, 0.0625]
    _, rois = _case(n=2, c=4, h=64, w=48, r=80, scale=1.0, seed=9)
    levels = torch.randint(0, 4, (80,), generator=g)  # level 4 gets no RoI
    with torch.set_grad_enabled(grad):
        out = pool_every_level(feats, rois, levels, (5, 5), scales, 2, True)
        ref = torch.zeros_like(out)
        for lv, (f, s) in enumerate(zip(feats, scales)):
            idx = torch.where(levels == lv)[0]
            ref[idx] = tv_roi_align(f, rois[idx], 5, s, 2, True)
    assert torch.equal(out, ref)
    if grad:
        grad_out = torch.randn(out.shape, generator=g)
        for a, b in zip(torch.autograd.grad(out, feats, grad_out), torch.autograd.grad(ref, feats, grad_out)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
def test_cuda_pooler_reads_nothing_back():
    """On CUDA the eager pooler pools every level (no ``nonzero``) with the values of
    torchvision's op on each level's RoIs."""
    feat, rois = _case(n=2, c=8, h=32, w=40, r=90, scale=1.0)
    feats = [feat.detach().cuda()[:, :, ::s, ::s].contiguous() for s in (1, 2, 4, 8)]
    scales = [1.0, 0.5, 0.25, 0.125]
    levels = torch.arange(90) % 4
    rois, levels = rois.cuda(), levels.cuda()
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof:
        out = multi_level_roi_align(feats, rois, levels, (7, 7), scales, 2, False)
    assert not any(e.key == "aten::nonzero" for e in prof.key_averages())
    for lv, (f, s) in enumerate(zip(feats, scales)):
        assert torch.equal(out[levels == lv], tv_roi_align(f, rois[levels == lv], 7, s, 2, False))
