"""Greedy NMS's sequential pass on the device, in one kernel: ``greedy_scan``.

Greedy NMS keeps box ``i`` (boxes sorted by decreasing score) iff no kept box before it
suppresses it. Given the suppression matrix, that is one pass over the boxes in order:
``torchvision.ops.nms`` runs this pass on the host (its CUDA kernel builds the matrix,
then copies it back: a host sync). ``greedy_scan`` runs it on the device, one program
per row (image x level) looping over the boxes, so a step that calls it has no host
sync and can be captured in a CUDA graph. It replaces the ``ceil(N / 32) * 33`` small
sequential kernels of the blocked Jacobi resolution (``modeling.nms``) by one launch.

The matrix travels as bit words (``pack_suppression``): ``words[r, i, w]`` holds, in its
low 32 bits, whether box ``i`` suppresses boxes ``32 w .. 32 w + 31`` of row ``r``.

- CUDA with Triton (a dependency of torch's CUDA builds), on GPUs of compute capability
  7.0 or later: a Triton kernel.
- Any other device: the same pass as a loop of tensor operations (for tests and
  reference; ``modeling.nms`` uses the Jacobi resolution there).

``torch.ops.detector.greedy_scan`` is a custom operator with a fake (meta) kernel:
``torch.compile(fullgraph=True)`` keeps it in the graph as one call.
"""

from __future__ import annotations

import torch
from torch import Tensor

try:  # torch's CUDA builds ship Triton; CPU-only installs may not
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

BITS = 32  # suppression bits per word (int64 words: no sign bit is ever set)


def pack_suppression(sup: Tensor) -> Tensor:
    """``[R, N, N]`` bool (``sup[r, i, j]``: box i suppresses box j) -> ``[R, N, W]``
    int64 words, ``W = ceil(N / 32)``; bit ``b`` of word ``w`` is column ``32 w + b``."""
    rows, num, cols = sup.shape
    words = (cols + BITS - 1) // BITS
    pad = words * BITS - cols
    if pad:
        sup = torch.cat((sup, sup.new_zeros(rows, num, pad)), dim=2)
    weights = torch.ones(BITS, dtype=torch.int64, device=sup.device) << torch.arange(BITS, device=sup.device)
    return (sup.view(rows, num, words, BITS).to(torch.int64) * weights).sum(dim=3)


# Triton compiles for CUDA GPUs of compute capability 7.0 (Volta) and later only; so does
# torch.compile's inductor.
TRITON_MIN_CAPABILITY = (7, 0)


def scan_on_device(device: torch.device) -> bool:
    """True where ``greedy_scan`` runs as one kernel: a CUDA GPU that Triton supports
    (compute capability 7.0 or later), with Triton importable."""
    if device.type != "cuda" or triton is None:
        return False
    return torch.cuda.get_device_capability(device) >= TRITON_MIN_CAPABILITY


def greedy_scan_reference(words: Tensor, valid: Tensor) -> Tensor:
    """The pass as tensor operations, one box at a time (``N`` steps): ``[R, N]`` bool
    keep mask for ``words`` ``[R, N, W]`` int64 and ``valid`` ``[R, N]`` bool (an invalid
    box is neither kept nor suppresses)."""
    rows, num = valid.shape
    keep = torch.zeros_like(valid)
    removed = torch.zeros(rows, words.shape[2], dtype=torch.int64, device=words.device)
    for i in range(num):
        word, bit = divmod(i, BITS)
        kept = valid[:, i] & (((removed[:, word] >> bit) & 1) == 0)
        keep[:, i] = kept
        removed = removed | torch.where(kept[:, None], words[:, i], 0)
    return keep


if triton is not None:

    @triton.jit
    def _or(a, b):
        return a | b

    @triton.jit
    def _greedy_scan_kernel(words_ptr, valid_ptr, keep_ptr, num_words, NUM: tl.constexpr, BLOCK_W: tl.constexpr):
        """One row, 32 boxes (one word, a "tile") at a time. ``removed`` (the row's bit
        words) stays in registers. A tile's loads (its validity, its boxes' words and,
        for each box, its word of the tile's own index, ``diag``) do not depend on the
        decisions, so one memory latency serves 32 boxes. Inside the tile the boxes are
        decided in order on one scalar word, ``cur`` (which of the tile's boxes are
        removed so far); then the kept boxes' words are ORed into ``removed``. ``NUM``
        (boxes per row) is fixed by the config: one compilation per model."""
        row = tl.program_id(0)
        lanes = tl.arange(0, 32)
        offs = tl.arange(0, BLOCK_W)
        in_row = offs < num_words
        base = words_ptr + row * NUM * num_words
        removed = tl.zeros([BLOCK_W], dtype=tl.int64)
        for t in range(0, (NUM + 31) // 32):
            box = t * 32 + lanes
            in_tile = box < NUM
            valid = tl.load(valid_ptr + row * NUM + box, mask=in_tile, other=0).to(tl.int64)
            # A box's word of index t (bits 0-31), with its validity in bit 32.
            diag = tl.load(base + box * num_words + t, mask=in_tile, other=0) | (valid << 32)
            tile = tl.load(base + box[:, None] * num_words + offs[None, :],
                           mask=in_tile[:, None] & in_row[None, :], other=0)
            cur = tl.sum(tl.where(offs == t, removed, 0), axis=0)
            kept_bits = cur * 0
            for j in tl.static_range(32):
                d = tl.sum(tl.where(lanes == j, diag, 0), axis=0)
                kept = (((d >> 32) & 1) != 0) & (((cur >> j) & 1) == 0)
                cur = cur | tl.where(kept, d & 0xFFFFFFFF, 0)
                kept_bits = kept_bits | (kept.to(tl.int64) << j)
            kept_lanes = (kept_bits >> lanes) & 1
            tl.store(keep_ptr + row * NUM + box, kept_lanes.to(tl.int8), mask=in_tile)
            # Every element's own condition (Triton 3.8 and 3.9 interpreters refuse a
            # broadcast boolean as a condition).
            kept_tile = (kept_lanes[:, None] + tl.zeros([32, BLOCK_W], dtype=tl.int64)) != 0
            removed = removed | tl.reduce(tl.where(kept_tile, tile, 0), 0, _or)


def greedy_scan_triton(words: Tensor, valid: Tensor) -> Tensor:
    """The Triton kernel's keep mask (``[R, N]`` bool); the tensors on its device (CUDA,
    or the CPU under ``TRITON_INTERPRET=1``)."""
    if triton is None:
        raise RuntimeError("greedy_scan_triton needs Triton (pip install triton)")
    rows, num = valid.shape
    keep = torch.empty(rows, num, dtype=torch.int8, device=valid.device)
    if rows == 0 or num == 0:
        return keep.bool()
    num_words = words.shape[2]
    block = max(16, triton.next_power_of_2(num_words))
    _greedy_scan_kernel[(rows,)](words.contiguous(), valid.to(torch.int8).contiguous(), keep, num_words,
                                 NUM=num, BLOCK_W=block, num_warps=1)
    return keep.bool()


@torch.library.custom_op("detector::greedy_scan", mutates_args=())
def greedy_scan(words: Tensor, valid: Tensor) -> Tensor:
    """Greedy NMS's keep mask ``[R, N]`` bool from the packed suppression words ``[R, N, W]``
    int64 (``pack_suppression``) and ``valid`` ``[R, N]`` bool, boxes in score order."""
    if scan_on_device(words.device):
        return greedy_scan_triton(words, valid)
    return greedy_scan_reference(words, valid)


@greedy_scan.register_fake
def _(words: Tensor, valid: Tensor) -> Tensor:
    return torch.empty_like(valid, dtype=torch.bool)
