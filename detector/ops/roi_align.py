"""RoIAlign for the CPU training step: the bilinear sampling as a gather, forward and
backward.

A drop-in for ``torchvision.ops.roi_align`` (used by ``modeling.roi_heads.MultiLevelRoIAlign``).

torchvision's CPU kernels loop in scalar code, on one thread: the forward interpolates
every channel of every sample again, and the backward also recomputes the bilinear
weights per channel: a quarter of torchvision's demo training step (one thread).
The weights depend only on the boxes, so each output bin is a weighted sum of
``K = 4 * sampling_ratio**2`` rows of the features laid out as a matrix
``F[N*H*W, C]`` (channels last; over several FPN levels the levels' rows one after the
other):

    out[b, :] = sum_k weight[b, k] * F[index[b, k], :]          b = (roi, ph, pw)

which is ``torch.nn.functional.embedding_bag(index, F, per_sample_weights=weight)``. The
backward is the transposed sum, each feature row gathering from the bins that read it
(the ``index`` entries sorted by row, one more ``embedding_bag``).

The weights are torchvision's ``bilinear_interpolate``: a point with ``y < -1``,
``y > H``, ``x < -1`` or ``x > W`` contributes nothing; otherwise it is clamped to
``>= 0``, and a point at or past the last row/column uses that row/column for both
corners; each bin's weights are divided by ``sampling_ratio**2``. The values are
torchvision's up to float rounding (the terms are summed in another order: a few ulp).

Only where a gradient is needed: without one (evaluation, inference, export) the op is
torchvision's, so a trained model's outputs are torchvision's to the bit. CUDA tensors,
dtypes other than float32/float64 (e.g. under bfloat16 autocast) and
``sampling_ratio <= 0`` (adaptive grid, a different count per box) use torchvision's op
for both passes.
"""

from __future__ import annotations

from typing import List, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor
from torchvision.ops import roi_align as tv_roi_align


def rois_for_kernel(rois: Tensor, features: Tensor) -> Tensor:
    """``rois`` in the dtype torchvision's kernel is to see with ``features``. Under
    autocast on the features' device its wrapper runs the kernel in float32 and casts
    both itself, so the boxes keep their precision (cast to float16 or bfloat16 first, a
    box edge near 1000 px would move by up to 0.25 or 2 px); otherwise the kernel needs
    both in one dtype."""
    if torch.is_autocast_enabled(features.device.type):
        return rois
    return rois.to(features.dtype)


def _axis(start: Tensor, roi_size: Tensor, bins: int, sr: int, size_f: Tensor, size_i: Tensor) -> Tuple[Tensor, Tensor]:
    """Bilinear corners along one axis for RoIs of per-RoI feature size ``size`` (``[R]``
    float and int64): indices ``[R, bins, sr, 2]`` (low, high) and their weights."""
    dtype = start.dtype
    bin_size = (roi_size / bins)[:, None, None]
    p = torch.arange(bins, dtype=dtype, device=start.device)[None, :, None]
    i = torch.arange(sr, dtype=dtype, device=start.device)[None, None, :]
    # Same operation order as torchvision: start + p * bin + (i + .5) * bin / sr.
    c = start[:, None, None] + p * bin_size + (i + 0.5) * bin_size / sr
    size_f, last_i = size_f[:, None, None], (size_i - 1)[:, None, None]
    inside = (c >= -1.0) & (c <= size_f)
    c = c.clamp(min=0.0)
    low = c.long()
    last = low >= last_i
    low = torch.minimum(low, last_i)
    high = torch.where(last, low, low + 1)
    low_f = low.to(dtype)
    frac = torch.where(last, 0.0, c - low_f)
    index = torch.stack((low, high), dim=-1)
    weight = torch.stack((1.0 - frac, frac), dim=-1) * inside[..., None]
    return index, weight


def sampling_points(
    rois: Tensor, levels: Tensor, scales: Sequence[float], shapes: Sequence[Tuple[int, int, int, int]],
    pooled: Tuple[int, int], sampling_ratio: int, aligned: bool,
) -> Tuple[Tensor, Tensor]:
    """The rows and weights each output bin sums (see the module doc).

    Args:
        rois: ``[R, 5]`` float ``(batch_index, x1, y1, x2, y2)`` in image pixels.
        levels: ``[R]`` int64 index into ``scales``/``shapes`` of each RoI's level.
        scales: per level, feature-map size / image size (1 / stride).
        shapes: per level ``(N, C, H, W)``.
        pooled: ``(PH, PW)``.
        sampling_ratio: sampling points per bin side (> 0).
        aligned: shift boxes by -0.5 px (torchvision's ``aligned=True``).

    Returns:
        ``index [R*PH*PW, K]`` (int32, or int64 past 2**31 rows): rows of the levels'
        channels-last features stacked (level 0's ``[N, H, W]`` positions, then level
        1's, ...); ``weight [R*PH*PW, K]`` in ``rois.dtype``; ``K = 4 * sampling_ratio**2``,
        bins in ``(roi, ph, pw)`` order.
    """
    ph_n, pw_n = pooled
    sr = sampling_ratio
    dtype, device = rois.dtype, rois.device
    num = rois.shape[0]
    bases, rows = [], 0
    for n, _, h, w in shapes:
        bases.append(rows)
        rows += n * h * w
    table_f = torch.tensor([[s, h, w] for s, (_, _, h, w) in zip(scales, shapes)], dtype=dtype, device=device)[levels]
    table_i = torch.tensor([[h, w, b] for (_, _, h, w), b in zip(shapes, bases)], dtype=torch.int64, device=device)[levels]
    scale, height_f, width_f = table_f.unbind(1)
    height, width, base = table_i.unbind(1)
    offset = 0.5 if aligned else 0.0
    box = rois[:, 1:] * scale[:, None] - offset  # [R, 4]
    x1, y1 = box[:, 0], box[:, 1]
    roi_w, roi_h = box[:, 2] - x1, box[:, 3] - y1
    if not aligned:  # torchvision forces malformed boxes to 1x1
        roi_w = roi_w.clamp(min=1.0)
        roi_h = roi_h.clamp(min=1.0)
    yi, wy = _axis(y1, roi_h, ph_n, sr, height_f, height)  # [R, PH, sr, 2]
    xi, wx = _axis(x1, roi_w, pw_n, sr, width_f, width)  # [R, PW, sr, 2]
    k = 2 * sr  # points (sample x corner) per bin along one axis
    start = base + rois[:, 0].long() * (height * width)  # [R]: the RoI's image on its level
    row_of_y = (start[:, None, None, None] + yi * width[:, None, None, None]).view(num, ph_n, 1, k, 1)
    index = (row_of_y + xi.view(num, 1, pw_n, 1, k)).to(torch.int32 if rows < 2**31 else torch.int64)
    weight = (wy / float(sr * sr)).view(num, ph_n, 1, k, 1) * wx.view(num, 1, pw_n, 1, k)
    return index.view(num * ph_n * pw_n, k * k), weight.view(num * ph_n * pw_n, k * k)


def gather_backward(index: Tensor, weight: Tensor, grad: Tensor, rows: int) -> Tensor:
    """The gradient of ``embedding_bag(index, F, per_sample_weights=weight)`` with
    respect to ``F [rows, C]``, for ``grad [B, C]`` of its output: each row of ``F`` sums
    ``weight * grad[b]`` over the entries ``(b, k)`` with ``index[b, k] == row``, found by
    one stable sort of ``index`` (deterministic: the same order on every run).

    Returns ``[rows, C]`` in ``grad.dtype``."""
    k = index.shape[1]
    keys, order = torch.sort(index.reshape(-1), stable=True)
    offsets = torch.searchsorted(keys, torch.arange(rows + 1, dtype=keys.dtype, device=keys.device))
    bins = torch.div(order, k, rounding_mode="floor")
    return F.embedding_bag(bins, grad.contiguous(), offsets, mode="sum", include_last_offset=True,
                           per_sample_weights=weight.reshape(-1)[order].to(grad.dtype))


class _GatherRoIAlign(torch.autograd.Function):
    """RoIAlign over one or more levels as a gather and its transpose (module doc)."""

    @staticmethod
    def forward(ctx, index: Tensor, weight: Tensor, *features: Tensor) -> Tensor:
        c = features[0].shape[1]
        rows = torch.cat([f.permute(0, 2, 3, 1).reshape(-1, c) for f in features])  # [sum N*H*W, C]
        ctx.save_for_backward(index, weight)
        ctx.shapes = [tuple(f.shape) for f in features]
        return F.embedding_bag(index, rows, per_sample_weights=weight, mode="sum")  # [B, C]

    @staticmethod
    def backward(ctx, grad_output: Tensor):
        index, weight = ctx.saved_tensors
        c = ctx.shapes[0][1]
        grad = gather_backward(index, weight, grad_output, sum(n * h * w for n, _, h, w in ctx.shapes))
        grads, start = [], 0
        for n, _, h, w in ctx.shapes:
            grads.append(grad[start:start + n * h * w].view(n, h, w, c).permute(0, 3, 1, 2))  # NCHW view of NHWC
            start += n * h * w
        return (None, None, *grads)


def _gather_roi_align(features: Sequence[Tensor], rois: Tensor, levels: Tensor, output_size: Tuple[int, int],
                      scales: Sequence[float], sampling_ratio: int, aligned: bool) -> Tensor:
    """``[R, C, PH, PW]`` (a view of channels-last memory) through :class:`_GatherRoIAlign`."""
    rois = rois.to(features[0].dtype)  # the weights follow, in the features' dtype
    index, weight = sampling_points(rois, levels, scales, [tuple(f.shape) for f in features], tuple(output_size),
                                    sampling_ratio, aligned)
    out = _GatherRoIAlign.apply(index, weight, *features)
    ph, pw = output_size
    return out.view(rois.shape[0], ph, pw, features[0].shape[1]).permute(0, 3, 1, 2)


def _gather_applies(features: Sequence[Tensor], sampling_ratio: int) -> bool:
    """The gather runs where a gradient is needed, on CPU float32/float64 features of one
    dtype, with a fixed sampling grid; everywhere else torchvision's op does."""
    return (torch.is_grad_enabled() and any(f.requires_grad for f in features) and sampling_ratio > 0
            and len({f.dtype for f in features}) == 1
            and all(f.device.type == "cpu" and f.dtype in (torch.float32, torch.float64) for f in features))


def roi_align(input: Tensor, boxes: Tensor, output_size: Union[int, Tuple[int, int]],
              spatial_scale: float = 1.0, sampling_ratio: int = -1, aligned: bool = False) -> Tensor:
    """``torchvision.ops.roi_align`` (same arguments; ``boxes`` as a ``[K, 5]`` tensor),
    through the gather on the CPU where a gradient is needed (module doc).

    Returns ``[K, C, PH, PW]``."""
    if not isinstance(boxes, Tensor) or not _gather_applies([input], sampling_ratio):
        return tv_roi_align(input, boxes, output_size, spatial_scale, sampling_ratio, aligned)
    size = (output_size, output_size) if isinstance(output_size, int) else tuple(output_size)
    levels = torch.zeros(boxes.shape[0], dtype=torch.int64, device=boxes.device)
    return _gather_roi_align([input], boxes, levels, size, [float(spatial_scale)], int(sampling_ratio), bool(aligned))


def multi_level_roi_align(features: List[Tensor], rois: Tensor, levels: Tensor, output_size: Tuple[int, int],
                          scales: Sequence[float], sampling_ratio: int, aligned: bool) -> Tensor:
    """RoIAlign of each RoI on its own level: ``rois`` ``[R, 5]``, ``levels`` ``[R]`` int64
    index into ``features`` (per level ``[N, C, H_l, W_l]``) and ``scales``; every level is
    in ``[0, len(features))`` (``MultiLevelRoIAlign.level_of`` clamps), so every row is written.

    Through the gather where it applies (one for all levels); else on the CPU
    torchvision's ``roi_align`` on each level's RoIs (:func:`pool_level_by_level`), and
    on other devices on every RoI at every level (:func:`pool_every_level`: no host sync).

    Returns ``[R, C, PH, PW]``."""
    if _gather_applies(features, sampling_ratio):
        return _gather_roi_align(features, rois, levels, tuple(output_size), scales, int(sampling_ratio),
                                 bool(aligned))
    if features[0].device.type != "cpu":
        return pool_every_level(features, rois, levels, output_size, scales, sampling_ratio, aligned)
    return pool_level_by_level(features, rois, levels, output_size, scales, sampling_ratio, aligned)


def rois_on_level(rois: Tensor, mine: Tensor, scale: float) -> Tensor:
    """``rois`` ``[R, 5]`` with the boxes of RoIs not ``mine`` (``[R]`` bool) replaced by
    a point 4 feature cells above and left of the map (``-4 / scale`` image pixels), where
    every sample of RoIAlign lies outside it: torchvision's CPU and CUDA kernels pool zeros
    there without reading the features and add no gradient (its deterministic Python
    version, ``train.deterministic`` on CUDA, gives the same zeros and zero gradients)."""
    boxes = torch.where(mine[:, None], rois[:, 1:], -4.0 / scale)
    return torch.cat((rois[:, :1], boxes), dim=1)


def pool_every_level(features: Sequence[Tensor], rois: Tensor, levels: Tensor, output_size: Tuple[int, int],
                     scales: Sequence[float], sampling_ratio: int, aligned: bool) -> Tensor:
    """torchvision's ``roi_align`` of every RoI on every level, each RoI keeping its own
    level's values (``levels`` ``[R]``): the others' RoIs are moved off the map
    (:func:`rois_on_level`), so the kernels skip them. No shape depends on the data and
    nothing is read back to the host (grouping the RoIs by level would be a ``nonzero``,
    a host sync, per level); one launch per level over all R RoIs.

    Returns ``[R, C, PH, PW]`` (the values of :func:`pool_level_by_level`)."""
    out = None
    for level, (feat, scale) in enumerate(zip(features, scales)):
        mine = levels == level  # [R]
        pooled = tv_roi_align(feat, rois_for_kernel(rois_on_level(rois, mine, scale), feat), output_size, scale,
                              sampling_ratio, aligned)
        out = torch.where(mine[:, None, None, None], pooled, 0.0 if out is None else out)
    return out


def pool_level_by_level(features: Sequence[Tensor], rois: Tensor, levels: Tensor, output_size: Tuple[int, int],
                         scales: Sequence[float], sampling_ratio: int, aligned: bool) -> Tensor:
    """torchvision's ``roi_align`` of each level's RoIs on its level, written into
    ``[R, C, PH, PW]`` in RoI order (dtype of ``features[0]``). Traceable: the level split
    stays in the graph."""
    out = features[0].new_zeros((rois.shape[0], features[0].shape[1]) + tuple(output_size))
    for level, (feat, scale) in enumerate(zip(features, scales)):
        idx = torch.where(levels == level)[0]
        pooled = tv_roi_align(feat, rois_for_kernel(rois[idx], feat), output_size, scale, sampling_ratio, aligned)
        out.index_put_((idx,), pooled.to(out.dtype))  # not out[idx] = ...: traced, that bakes in len(idx) == 1
    return out
