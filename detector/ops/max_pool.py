"""The ResNet stem's 3x3 / stride 2 max pool by strided views, for the CPU without a gradient."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def stem_max_pool(x: Tensor) -> Tensor:
    """``F.max_pool2d(x, 3, stride=2, padding=1)`` of ``[N, C, H, W]`` (contiguous) ->
    ``[N, C, (H - 1) // 2 + 1, (W - 1) // 2 + 1]``, without a gradient: the maximum of the
    nine strided views of ``x`` padded with -inf.

    The values are the same (a maximum is exact, NaN propagates, and -inf is the padding
    ``max_pool2d`` implies). PyTorch's CPU kernel for contiguous NCHW input is not
    vectorised along the width: this is 2.5-2.9x faster for the demo's stem output
    (4x64x48x80, 2 threads, side by side in one process; docs/performance.md); on large
    maps (R50-FPN at 512 px) the two are even. No gradient: ties would share it."""
    height, width = (x.shape[-2] - 1) // 2 + 1, (x.shape[-1] - 1) // 2 + 1
    padded = F.pad(x, (1, 1, 1, 1), value=float("-inf"))
    out = padded[..., 0:2 * height - 1:2, 0:2 * width - 1:2].clone()
    for i in range(3):
        for j in range(3):
            if i or j:
                torch.maximum(out, padded[..., i:i + 2 * height - 1:2, j:j + 2 * width - 1:2], out=out)
    return out


def stem_pool_by_views(pool: nn.Module, x: Tensor) -> bool:
    """Whether ``stem_max_pool`` may stand in for ``pool`` on ``x``: torchvision's stem
    pool (3x3, stride 2, padding 1), contiguous NCHW on the CPU (channels-last input has
    a fast kernel), no gradient, not traced or scripted (exports keep ``MaxPool``)."""
    return (isinstance(pool, nn.MaxPool2d)
            and (pool.kernel_size, pool.stride, pool.padding, pool.dilation, pool.ceil_mode) == (3, 2, 1, 1, False)
            and x.device.type == "cpu" and x.dim() == 4 and x.is_contiguous()
            and not (torch.is_grad_enabled() and x.requires_grad)
            and not torch.jit.is_tracing() and not torch.jit.is_scripting())
