"""What a detector costs: parameters per part, FLOPs of one image, weights size on disk.

``model_summary(model, (H, W))`` counts, for each top-level part of a ``FasterRCNN``
(``backbone.body``, ``backbone.fpn``, ``rpn``, ``roi_heads``):

- parameters: ``nn.Parameter`` elements, split into trainable (``requires_grad``) and
  frozen; after ``model.freeze_at`` and the norm policy, since ``build_model`` applies
  both (a frozen BatchNorm becomes ``FrozenBatchNorm2d``, whose affine values are
  buffers, not parameters: they are reported as ``frozen_norm_values``; torchvision's
  parameter counts leave them out the same way);
- FLOPs of one eval-mode forward on a ``[3, H, W]`` image, counted by
  ``torch.utils.flop_counter.FlopCounterMode`` (2 per multiply-accumulate, so half this
  is the "MACs" figure of fvcore/mmcv). It counts convolutions, matrix products and
  attention; RoIAlign, NMS and element-wise ops are not counted. The RoI heads' share
  depends on the number of proposals, reported as ``proposals``.

and the size of the saved state dict (the weights file; a training checkpoint adds the
optimizer state).
"""

from __future__ import annotations

import io
import json
import os
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn
from torch.utils.flop_counter import FlopCounterMode
from torchvision.ops import FrozenBatchNorm2d

from ..config import Config, load_config
from ..files import check_writes_apart, write_text
from .build import build_model
from .faster_rcnn import FasterRCNN


@dataclass
class ParamCount:
    """Parameter elements of one module (``frozen_norm_values``: FrozenBatchNorm2d
    weight and bias elements, constant buffers outside the parameter count)."""

    total: int = 0
    trainable: int = 0
    frozen: int = 0
    frozen_norm_values: int = 0


@dataclass
class ModelSummary:
    """The numbers of ``model_summary``; ``parts`` maps a module name to its
    ``ParamCount`` and ``gflops`` maps it to its share of the forward's GFLOPs."""

    image_size: Tuple[int, int]
    params_total: int
    params_trainable: int
    params_frozen: int
    gflops: float
    checkpoint_bytes: int
    proposals: int
    parts: Dict[str, ParamCount] = field(default_factory=dict)
    part_gflops: Dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> Dict:
        """Plain data for JSON (``summary.json``)."""
        return asdict(self)


def model_parts(model: nn.Module) -> List[Tuple[str, nn.Module]]:
    """``(name, module)`` of the parts that are counted: a ``FasterRCNN``'s backbone
    body, FPN, RPN and RoI heads; for any other module, its children."""
    if isinstance(model, FasterRCNN):
        return [("backbone.body", model.backbone.body), ("backbone.fpn", model.backbone.fpn),
                ("rpn", model.rpn), ("roi_heads", model.roi_heads)]
    return list(model.named_children())


def count_parameters(module: nn.Module) -> ParamCount:
    """Total, trainable and frozen parameter elements of ``module`` (and its
    FrozenBatchNorm2d affine values)."""
    count = ParamCount()
    for p in module.parameters():
        count.total += p.numel()
        if p.requires_grad:
            count.trainable += p.numel()
        else:
            count.frozen += p.numel()
    for m in module.modules():
        if isinstance(m, FrozenBatchNorm2d):
            count.frozen_norm_values += m.weight.numel() + m.bias.numel()
    return count


def count_flops(module: nn.Module, *inputs) -> Dict[str, int]:
    """FLOPs of ``module(*inputs)`` under ``torch.no_grad``, per submodule: keys are
    dotted names relative to ``module`` (``""`` for the whole call)."""
    with torch.no_grad(), FlopCounterMode(display=False, depth=None) as counter:
        module(*inputs)
    root = type(module).__name__
    flops: Dict[str, int] = {}
    for name, per_op in counter.get_flop_counts().items():
        if name == root or name.startswith(root + "."):
            flops[name[len(root) + 1:]] = int(sum(per_op.values()))
    flops[""] = int(counter.get_total_flops())
    return flops


def state_dict_bytes(model: nn.Module) -> int:
    """Bytes of ``torch.save(model.state_dict())``: the size of the weights file."""
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    return buffer.getbuffer().nbytes


def default_image_size(cfg: Config) -> Tuple[int, int]:
    """The largest test input, ``(input.min_size_test, input.max_size_test)`` (H, W):
    the shorter side at its test size, the longer at its cap."""
    return int(cfg.input.min_size_test), int(cfg.input.max_size_test)


def summary_image(image_size: Tuple[int, int], seed: int = 0) -> Tensor:
    """A ``[3, H, W]`` uint8 noise image from its own generator (the global RNG is left
    alone, so a training run is unaffected)."""
    height, width = image_size
    if height < 1 or width < 1:
        raise ValueError(f"image size must be positive, got {height}x{width}")
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (3, height, width), dtype=torch.uint8, generator=generator)


def model_summary(model: FasterRCNN, image_size: Tuple[int, int]) -> ModelSummary:
    """Parameters per part, FLOPs of one ``image_size`` (H, W) image, weights size.

    The forward runs in eval mode on the model's device (the mode is restored after).
    """
    rois: List[int] = []
    hook = model.roi_heads.box_head.register_forward_hook(lambda _m, args, _out: rois.append(int(args[0].shape[0])))
    was_training = model.training
    model.eval()
    try:
        flops = count_flops(model, [summary_image(image_size).to(model.device)])
    finally:
        hook.remove()
        model.train(was_training)
    total = count_parameters(model)
    return ModelSummary(
        image_size=(int(image_size[0]), int(image_size[1])),
        params_total=total.total,
        params_trainable=total.trainable,
        params_frozen=total.frozen,
        gflops=flops[""] / 1e9,
        checkpoint_bytes=state_dict_bytes(model),
        proposals=sum(rois),
        parts={name: count_parameters(module) for name, module in model_parts(model)},
        part_gflops={name: flops.get(name, 0) / 1e9 for name, _ in model_parts(model)},
    )


def format_summary(summary: ModelSummary) -> str:
    """A table: one row per part and the total (parameters in millions, GFLOPs)."""
    h, w = summary.image_size
    rows = [f"{'module':<14} {'params (M)':>10} {'trainable':>10} {'frozen':>10} {'GFLOPs':>9}"]
    for name, count in summary.parts.items():
        rows.append(f"{name:<14} {count.total / 1e6:>10.3f} {count.trainable / 1e6:>10.3f} "
                    f"{count.frozen / 1e6:>10.3f} {summary.part_gflops.get(name, 0.0):>9.2f}")
    rows.append(f"{'total':<14} {summary.params_total / 1e6:>10.3f} {summary.params_trainable / 1e6:>10.3f} "
                f"{summary.params_frozen / 1e6:>10.3f} {summary.gflops:>9.2f}")
    frozen_norm = sum(c.frozen_norm_values for c in summary.parts.values())
    rows.append(f"FLOPs of one {h}x{w} image ({summary.proposals} proposals; torch.utils.flop_counter, "
                f"2 per multiply-add); weights file {summary.checkpoint_bytes / 2**20:.1f} MiB"
                + (f"; {frozen_norm} FrozenBatchNorm2d affine values (buffers)" if frozen_norm else ""))
    return "\n".join(rows)


def write_summary(model: FasterRCNN, image_size: Tuple[int, int], path: str | os.PathLike) -> ModelSummary:
    """``model_summary`` written to ``path`` as JSON (``summary.json`` of a run folder)."""
    summary = model_summary(model, image_size)
    write_text(path, json.dumps(summary.to_dict(), indent=2) + "\n")
    return summary


def summary_command(config_file: str, overrides: Sequence[str] = (), image_size: Optional[Tuple[int, int]] = None,
                    json_file: Optional[str] = None) -> int:
    """``tools/summary.py``: print the summary of the config's model (built without
    ``model.weights``/``model.backbone_weights``: the counts do not depend on them, and
    nothing is downloaded), FLOPs at ``image_size`` (H, W; default ``default_image_size``);
    also write it to ``json_file``. Returns 0."""
    if json_file:
        check_writes_apart({"--json": json_file}, {"--config": config_file})
    cfg = load_config(config_file, [*overrides, "model.weights=", "model.backbone_weights="])
    size = tuple(image_size) if image_size else default_image_size(cfg)
    torch.manual_seed(0)  # random init: the RPN's proposal count (the RoI heads' FLOPs) repeats
    summary = model_summary(build_model(cfg), size)
    print(format_summary(summary))
    if json_file:
        write_text(json_file, json.dumps(summary.to_dict(), indent=2) + "\n")
        print(f"summary written to {json_file}")
    return 0
