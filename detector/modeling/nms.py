"""Greedy NMS with fixed shapes and no host synchronisation: ``static_nms``.

``torchvision.ops.nms`` returns an index list whose length depends on the data, and
its CUDA kernel copies a mask to the host. ``static_nms`` selects exactly the same
boxes, in the same order, as a fixed-size padded index tensor plus a validity mask,
using tensor operations only (no ``.item()``, ``nonzero`` or boolean indexing), so a
training step that uses it compiles as one graph and can be captured in a CUDA graph.

Method (a blocked Cluster-NMS, Zheng et al. 2021). Boxes are sorted by decreasing
score with a stable sort (ties keep the lower input index first: torchvision's CPU
order). ``S[i, j]`` (``i < j`` in that order) says that box ``i`` suppresses box ``j``
(IoU > threshold, computed with torchvision's arithmetic and compared as its kernel
for the device compares, ``_comparable_threshold``). Greedy NMS keeps box ``j``
iff no kept box ``i < j`` has ``S[i, j]``: the unique fixed point of
``keep = f(keep)``, ``f(k)[j] = not any_i (k[i] and S[i, j])``. The sorted boxes are cut
into blocks of ``block_size``, resolved in order:

1. propagation: the block's boxes that a kept box of an earlier (final) block
   suppresses are dropped (one masked ``any`` over the earlier boxes);
2. resolution: ``max_iters`` Jacobi iterations of ``f`` restricted to the block,
   started from "all alive". Iterate t is exact for every box whose chain of
   suppressions inside the block is shorter than t, so ``max_iters >= block_size``
   is exact for every input; fewer iterations are exact whenever the block's
   suppression chains are short (the usual case), and a block that has not reached
   the fixed point is reported in ``unconverged``.

On CUDA (with Triton) the resolution is instead one kernel, ``ops.greedy_scan``: the
sequential pass over the boxes in order, on the device (exact, ``unconverged`` is
False). The blocked resolution below stays the method elsewhere, and either can be
asked for (``method``).

Cost of the blocked resolution, for N boxes per image: the IoU matrix (``N^2`` floats per image), then
``ceil(N / block_size) * (1 + max_iters)`` small sequential steps of
``O(block_size^2)`` (resolution) and ``O(N * block_size)`` (propagation) work per image.
Greedy NMS is inherently sequential (its worst case, a chain of boxes each suppressing
only the next, needs N decisions in order), so the exact default has about N
sequential steps; lowering ``max_iters`` trades that for the ``unconverged`` check.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from ..ops.greedy_scan import greedy_scan, pack_suppression, scan_on_device
from .matching import box_iou_batched

# Defaults: exact for every input (max_iters >= block_size, see the module docstring).
DEFAULT_BLOCK_SIZE = 32
DEFAULT_MAX_ITERS = DEFAULT_BLOCK_SIZE


class StaticNMSResult(NamedTuple):
    """``static_nms``'s result for B images.

    Attributes:
        keep: ``[B, max_out]`` int64 indices into the input boxes, in greedy NMS's order
            (decreasing score); padding slots hold 0.
        valid: ``[B, max_out]`` bool, True on the kept boxes (a prefix of each row).
        unconverged: ``[B]`` bool on the device: some block of the image did not reach
            the fixed point within ``max_iters`` (the result may then differ from greedy
            NMS). Read it at logging points only.
    """

    keep: Tensor
    valid: Tensor
    unconverged: Tensor


def pairwise_iou(boxes: Tensor) -> Tensor:
    """``[B, N, 4]`` x1y1x2y2 boxes -> ``[B, N, N]`` IoU, with the arithmetic of
    torchvision's NMS kernel (``inter / (area_i + area_j - inter)``, the width and height
    of the intersection clamped at 0), so the comparison with the threshold decides as
    it does (``matching.box_iou_batched``: in place, three ``[B, N, N]`` buffers)."""
    return box_iou_batched(boxes, boxes)


def _comparable_threshold(iou_threshold: float, dtype: torch.dtype, device: torch.device) -> float:
    """The threshold ``t'`` for which ``iou > t'`` on ``dtype`` IoUs decides as
    torchvision's NMS kernel on ``device`` decides ``iou > iou_threshold``.

    Its CPU kernel compares with the double ``t``: exact in float64, and for a float32
    IoU ``x``, ``x > t`` exactly when ``x > t'``, ``t'`` the largest float32 <= ``t``
    (a Python float compared with a float32 tensor is rounded to the nearest float32,
    which differs when that rounds up, as 0.3 does, and ``x`` is that float). Its CUDA
    kernel rounds ``t`` to the nearest float32 for every box dtype."""
    if iou_threshold == 0 or not math.isfinite(iou_threshold):
        return iou_threshold
    mantissa, exponent = math.frexp(iou_threshold)  # t = m * 2**e, 0.5 <= |m| < 1
    scaled = math.ldexp(mantissa, 24)  # float32 keeps 24 bits
    if device.type == "cuda":
        return math.ldexp(round(scaled), exponent - 24)
    if dtype == torch.float32:
        return math.ldexp(math.floor(scaled), exponent - 24)
    return iou_threshold


def _resolve_block(sup: Tensor, alive: Tensor, max_iters: int) -> tuple[Tensor, Tensor]:
    """Greedy NMS inside one block by Jacobi iterations.

    Args:
        sup: ``[B, K, K]`` bool, ``sup[b, i, j]``: box i suppresses box j (i < j only).
        alive: ``[B, K]`` bool, boxes not yet suppressed from outside the block.

    Returns:
        kept ``[B, K]`` bool and ``[B]`` bool "not at the fixed point".
    """
    sup = sup & alive[:, :, None]
    keep = alive
    for _ in range(max_iters):
        keep = alive & ~(sup & keep[:, :, None]).any(dim=1)
    again = alive & ~(sup & keep[:, :, None]).any(dim=1)
    return keep, (again != keep).any(dim=1)


def suppression_matrix(boxes: Tensor, valid: Tensor, iou_threshold: float) -> Tensor:
    """``[B, N, N]`` bool, ``[b, i, j]``: box i suppresses box j (i before j, i valid, IoU
    above ``iou_threshold`` as torchvision's kernel decides it) for boxes ``[B, N, 4]``
    sorted by decreasing score, ``valid`` ``[B, N]`` bool."""
    order = torch.arange(boxes.shape[1], device=boxes.device)
    upper = order[:, None] < order[None, :]  # i before j
    threshold = _comparable_threshold(iou_threshold, boxes.dtype, boxes.device)
    return (pairwise_iou(boxes) > threshold) & upper & valid[:, :, None]


def _greedy_keep(boxes: Tensor, valid: Tensor, iou_threshold: float, block_size: int,
                 max_iters: int, scan: bool) -> tuple[Tensor, Tensor]:
    """Greedy NMS's keep mask ``[B, N]`` bool for boxes already sorted by decreasing
    score (``valid`` ``[B, N]``: False boxes are neither kept nor suppress), and ``[B]``
    bool "some block did not converge" (``scan``: the one-kernel pass, always exact)."""
    num = boxes.shape[1]
    sup = suppression_matrix(boxes, valid, iou_threshold)
    unconverged = torch.zeros(boxes.shape[0], dtype=torch.bool, device=boxes.device)
    if scan:
        return greedy_scan(pack_suppression(sup), valid), unconverged
    kept_blocks = []
    for start in range(0, num, block_size):
        stop = min(start + block_size, num)
        alive = valid[:, start:stop]
        if start > 0:
            before = torch.cat(kept_blocks, dim=1)  # [B, start], final
            alive = alive & ~(sup[:, :start, start:stop] & before[:, :, None]).any(dim=1)
        kept, bad = _resolve_block(sup[:, start:stop, start:stop], alive, max_iters)
        kept_blocks.append(kept)
        unconverged = unconverged | bad
    if not kept_blocks:
        return valid, unconverged
    return torch.cat(kept_blocks, dim=1), unconverged


def resolve_method(method: str, device: torch.device) -> str:
    """``static_nms``'s ``method`` for boxes on ``device``: "auto" becomes "scan" where
    ``ops.greedy_scan`` is one kernel (CUDA with Triton), else "blocks". Raises
    ``ValueError`` for a method other than auto, scan or blocks."""
    if method not in ("auto", "scan", "blocks"):
        raise ValueError(f"static_nms: method must be auto, scan or blocks, got {method!r}")
    if method == "auto":
        return "scan" if scan_on_device(device) else "blocks"
    return method


def static_nms(
    boxes: Tensor,
    scores: Tensor,
    iou_threshold: float,
    max_out: int,
    max_iters: int = DEFAULT_MAX_ITERS,
    valid: Optional[Tensor] = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    method: str = "auto",
) -> StaticNMSResult:
    """Greedy NMS of each image's boxes with fixed-size, padded output.

    Selects what ``torchvision.ops.nms(boxes[b][valid[b]], scores[b][valid[b]],
    iou_threshold)[:max_out]`` selects (as indices into ``boxes[b]``), in the same
    order; exact when ``max_iters >= block_size`` (the default), see the module
    docstring.

    Args:
        boxes: ``[B, N, 4]`` x1y1x2y2, finite on valid entries; IoUs are computed in
            float32, or float64 for float64 boxes (torchvision: the boxes' own dtype).
        scores: ``[B, N]``; ranked in float32, or float64 for float64 scores.
        iou_threshold: a box is suppressed by a kept box with IoU > this.
        max_out: slots per image in the result.
        max_iters: Jacobi iterations per block (>= 1).
        valid: ``[B, N]`` bool, entries to consider (None: all).
        block_size: boxes per block (>= 1).
        method: "scan" (``ops.greedy_scan``: one kernel on CUDA with Triton, a loop of
            N steps elsewhere), "blocks" (the blocked Jacobi resolution; ``max_iters``
            and ``block_size`` apply to it alone) or "auto" (scan where it is one
            kernel, else blocks).

    Returns:
        ``StaticNMSResult`` (keep ``[B, max_out]`` int64, valid ``[B, max_out]`` bool,
        unconverged ``[B]`` bool).
    """
    if max_iters < 1 or block_size < 1 or max_out < 0:
        raise ValueError(f"static_nms needs max_iters >= 1, block_size >= 1 and max_out >= 0, "
                         f"got {max_iters}, {block_size}, {max_out}")
    num_images, num = scores.shape
    device = scores.device
    if valid is None:
        valid = torch.ones(num_images, num, dtype=torch.bool, device=device)
    # Invalid entries go last; ties in score keep the input order (stable sort).
    key = torch.where(valid, scores.to(torch.promote_types(scores.dtype, torch.float32)), float("-inf"))
    order = torch.sort(key, dim=1, descending=True, stable=True).indices  # [B, N]
    sorted_valid = valid.gather(1, order)
    work = boxes.to(torch.promote_types(boxes.dtype, torch.float32))
    sorted_boxes = work.gather(1, order[:, :, None].expand(-1, -1, 4))
    scan = resolve_method(method, boxes.device) == "scan"
    keep_sorted, unconverged = _greedy_keep(sorted_boxes, sorted_valid, iou_threshold, block_size, max_iters, scan)
    return StaticNMSResult(*_kept_slots(order, keep_sorted, max_out), unconverged)


def _kept_slots(order: Tensor, keep_sorted: Tensor, max_out: int) -> tuple[Tensor, Tensor]:
    """The kept boxes' input indices in sorted order, padded to ``max_out`` slots:
    ``(keep [B, max_out] int64, valid [B, max_out] bool)``, padding 0 / False."""
    num_images, num = order.shape
    slots = min(max_out, num)
    rank_key = torch.where(keep_sorted, num - torch.arange(num, device=order.device), 0)  # rank among the kept
    top, pos = rank_key.topk(slots, dim=1) if slots > 0 else (rank_key[:, :0], rank_key[:, :0])
    ok = top > 0
    keep = torch.where(ok, order.gather(1, pos), 0)
    if slots < max_out:
        pad = max_out - slots
        keep = torch.cat((keep, keep.new_zeros(num_images, pad)), dim=1)
        ok = torch.cat((ok, ok.new_zeros(num_images, pad)), dim=1)
    return keep, ok
