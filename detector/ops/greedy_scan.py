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

- CUDA with Triton (a dependency of torch's CUDA builds): a Triton kernel.
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


def scan_on_device(device: torch.device) -> bool:
    """True where ``greedy_scan`` runs as one kernel: CUDA with Triton importable."""
    return device.type == "cuda" and triton is not None


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
    def _greedy_scan_kernel(words_ptr, valid_ptr, keep_ptr, num_words, NUM: tl.constexpr, BLOCK_W: tl.constexpr):
        """One row: ``removed`` (its bit words) in registers; box ``i`` is kept when valid
        and not removed, and then ORs its suppression words into ``removed``. ``NUM``
        (boxes per row) is fixed by the config: one compilation per model.

        The chain from box to box is short scalar work: ``cur`` is the word of
        ``removed`` that holds box ``i``'s bit (read from the vector once per 32 boxes,
        then updated with ``diag``, the kept box's own word of that index). Box ``i + 1``'s
        words are loaded while box ``i`` is decided (the loads do not depend on it), so the
        memory latency is hidden instead of paid once per box."""
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK_W)
        in_row = offs < num_words
        base = words_ptr + row * NUM * num_words
        removed = tl.zeros([BLOCK_W], dtype=tl.int64)
        cur = tl.sum(removed, axis=0)
        next_words = tl.load(base + offs, mask=in_row, other=0)
        next_diag = tl.load(base)
        next_valid = tl.load(valid_ptr + row * NUM)
        for i in range(0, NUM):
            row_words, diag, valid = next_words, next_diag, next_valid
            nxt = i + 1 - (i + 1) // NUM  # i + 1, or the last box again (a harmless load)
            next_words = tl.load(base + nxt * num_words + offs, mask=in_row, other=0)
            next_diag = tl.load(base + nxt * num_words + nxt // 32)
            next_valid = tl.load(valid_ptr + row * NUM + nxt)
            if i % 32 == 0:
                cur = tl.sum(tl.where(offs == i // 32, removed, 0), axis=0)
            kept = (valid != 0) & (((cur >> (i % 32)) & 1) == 0)
            tl.store(keep_ptr + row * NUM + i, kept.to(tl.int8))
            cur = cur | tl.where(kept, diag, 0)
            # The scalar on every lane (Triton 3.8 and 3.9 interpreters refuse a scalar
            # or broadcast boolean as a vector condition).
            kept_lanes = tl.zeros([BLOCK_W], dtype=tl.int8) + kept.to(tl.int8)
            removed = removed | tl.where(kept_lanes != 0, row_words, 0)


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
