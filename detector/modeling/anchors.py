"""Anchors: a fixed set of boxes per FPN level, tiled over the feature map.

Each level has ``A = len(sizes) * len(aspect_ratios)`` cell anchors centred on 0,
ordered aspect-ratio major (for ratio r: the sizes in order). An anchor of size s and
ratio r = h / w has ``w = s / sqrt(r)``, ``h = s * sqrt(r)`` (area s^2); its corners
are rounded to whole pixels, as in torchvision. Cell anchors are shifted to every
feature-map location ``(x * stride_w, y * stride_h)``; the flattened order is row
(y) major, then column (x), then anchor, which matches the RPN head's output layout
``[N, A, H, W] -> [N, H, W, A]``.

The stride of a level is ``padded image size // feature size`` per dimension (integer
division, torchvision's rule; for the max-pooled top level of a size that is not a
multiple of 64 this differs from 64, and torchvision's weights were trained so).
Grids are cached per (level, feature size, stride, device, dtype).
"""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import torch
from torch import Tensor, nn


def cell_anchors(sizes: Sequence[float], aspect_ratios: Sequence[float]) -> Tensor:
    """``[len(aspect_ratios) * len(sizes), 4]`` anchors centred on (0, 0), float32."""
    scales = torch.as_tensor(sizes, dtype=torch.float32)
    ratios = torch.as_tensor(aspect_ratios, dtype=torch.float32)
    h_ratios = torch.sqrt(ratios)
    w_ratios = 1.0 / h_ratios
    ws = (w_ratios[:, None] * scales[None, :]).reshape(-1)
    hs = (h_ratios[:, None] * scales[None, :]).reshape(-1)
    return (torch.stack((-ws, -hs, ws, hs), dim=1) / 2).round()


class AnchorGenerator(nn.Module):
    """Anchors for every level of a feature pyramid.

    Args:
        sizes: one list of sizes (pixels) per level.
        aspect_ratios: height / width ratios, shared by all levels.
    """

    def __init__(self, sizes: Sequence[Sequence[float]], aspect_ratios: Sequence[float]) -> None:
        super().__init__()
        if len(sizes) == 0 or any(len(s) == 0 for s in sizes) or len(aspect_ratios) == 0:
            raise ValueError(f"anchor sizes and aspect ratios must be non-empty, got {sizes}, {aspect_ratios}")
        if any(s <= 0 for level in sizes for s in level) or any(r <= 0 for r in aspect_ratios):
            raise ValueError(f"anchor sizes and aspect ratios must be > 0, got {sizes}, {aspect_ratios}")
        self.sizes = [list(map(float, s)) for s in sizes]
        self.aspect_ratios = list(map(float, aspect_ratios))
        # Non-persistent buffers (not in the state dict, as torchvision's plain list is not):
        # they move with the model, so a compiled or CUDA-graphed step reads them on its
        # device instead of copying them from host memory at every call.
        for level, level_sizes in enumerate(self.sizes):
            self.register_buffer(f"cell_anchors_{level}", cell_anchors(level_sizes, self.aspect_ratios),
                                 persistent=False)
        self._cache: Dict[tuple, Tensor] = {}

    @property
    def cell_anchors(self) -> List[Tensor]:
        """One ``[A, 4]`` tensor of anchors centred on (0, 0) per level, on the model's device."""
        return [getattr(self, f"cell_anchors_{level}") for level in range(len(self.sizes))]

    @property
    def num_anchors_per_location(self) -> int:
        """A, the same on every level (the RPN head is shared)."""
        counts = {c.shape[0] for c in self.cell_anchors}
        if len(counts) != 1:
            raise ValueError(f"every level needs the same number of anchors per location, got {self.sizes}")
        return counts.pop()

    def grid_anchors(self, level: int, feature_size: Tuple[int, int], stride: Tuple[int, int],
                     device: torch.device, dtype: torch.dtype = torch.float32) -> Tensor:
        """``[H * W * A, 4]`` anchors of one level (cached; not while tracing for export,
        where the sizes and strides are 0-dim tensors that stay in the traced graph)."""
        # Not cached while tracing or compiling: the grid then belongs to the graph.
        tracing = torch.jit.is_tracing() or torch.compiler.is_compiling()
        key = (level, feature_size, stride, device, dtype)
        anchors = None if tracing else self._cache.get(key)
        if anchors is None:
            height, width = feature_size
            shifts_x = torch.arange(width, dtype=torch.int32, device=device) * stride[1]
            shifts_y = torch.arange(height, dtype=torch.int32, device=device) * stride[0]
            shift_y, shift_x = torch.meshgrid(shifts_y, shifts_x, indexing="ij")
            shift_x, shift_y = shift_x.reshape(-1), shift_y.reshape(-1)
            shifts = torch.stack((shift_x, shift_y, shift_x, shift_y), dim=1).to(dtype)
            base = self.cell_anchors[level].to(device=device, dtype=dtype)
            anchors = (shifts[:, None, :] + base[None, :, :]).reshape(-1, 4)
            if tracing:
                return anchors
            if len(self._cache) > 64:  # many distinct image sizes: keep the cache bounded
                self._cache.clear()
            self._cache[key] = anchors
        return anchors

    def forward(self, image_size: Tuple[int, int], feature_sizes: List[Tuple[int, int]],
                device: torch.device, dtype: torch.dtype = torch.float32) -> List[Tensor]:
        """Anchors for a padded batch.

        Args:
            image_size: ``(H, W)`` of the padded batch tensor.
            feature_sizes: ``(H_l, W_l)`` per level.

        Returns:
            one ``[H_l * W_l * A, 4]`` tensor per level, in image pixels.
        """
        if len(feature_sizes) != len(self.cell_anchors):
            raise ValueError(
                f"model.anchors.sizes has {len(self.cell_anchors)} levels but the backbone "
                f"returns {len(feature_sizes)} feature maps"
            )
        out = []
        for level, (fh, fw) in enumerate(feature_sizes):
            stride = (image_size[0] // fh, image_size[1] // fw)
            out.append(self.grid_anchors(level, (fh, fw), stride, device, dtype))
        return out
