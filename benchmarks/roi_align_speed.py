"""``tools/benchmark.py --task roi-align``: the box head's RoIAlign of one training step,
forward and backward, timed side by side on the config's device:

- ``torchvision``: ``torchvision.ops.roi_align`` on each FPN level's RoIs, as
  torchvision's ``MultiScaleRoIAlign`` pools (its backward kernel included);
- ``ours``: the model's pooler (``MultiLevelRoIAlign``: ``ops.multi_level_roi_align``,
  on the CPU the gather of ``detector/ops/roi_align.py``).

Sizes from the config: ``solver.images_per_gpu`` images of the largest training size
(``input.max_size_train`` by the largest ``input.min_size_train``, or the largest of
``model.canvas_sizes``), ``roi_heads.batch_size_per_image`` RoIs each, sides log-uniform
from 8 px to the image's shorter side (so every pooled level gets some). The outputs
and feature gradients of the two ways are compared (``max_abs_diff``).
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Tuple

import torch
from torch import Tensor

from detector.config import Config
from detector.distributed import resolve_device
from detector.modeling import build_model
from detector.modeling.roi_heads import MultiLevelRoIAlign
from detector.ops.roi_align import pool_level_by_level

from .timing import Runner, machine_info, run_interleaved


def pooler_case(cfg: Config, pooler: MultiLevelRoIAlign, device: torch.device,
                seed: int = 0) -> Tuple[List[Tensor], List[Tensor]]:
    """Features (per pooled level ``[N, C, H/s, W/s]``, requiring a gradient) and boxes
    (per image ``[R, 4]`` x1y1x2y2 pixels inside the image)."""
    g = torch.Generator().manual_seed(seed)
    if cfg.model.canvas_sizes:
        height, width = max(cfg.model.canvas_sizes, key=lambda hw: hw[0] * hw[1])
    else:
        height, width = max(cfg.input.min_size_train), cfg.input.max_size_train
    n, r, c = cfg.solver.images_per_gpu, cfg.roi_heads.batch_size_per_image, cfg.model.fpn_channels
    feats = [torch.randn(n, c, math.ceil(height * s), math.ceil(width * s), generator=g).to(device).requires_grad_()
             for s in pooler.scales]
    side = torch.exp(torch.rand(n, r, 2, generator=g) * torch.log(torch.tensor(min(height, width) / 8.0))) * 8.0
    xy = torch.rand(n, r, 2, generator=g) * (torch.tensor([width, height]) - side)
    return feats, [b.to(device) for b in torch.cat((xy, xy + side), dim=2)]


def _torchvision_pool(pooler: MultiLevelRoIAlign, feats: List[Tensor], boxes: List[Tensor]) -> Tensor:
    """torchvision's ``MultiScaleRoIAlign``: its op on each level's RoIs, in RoI order."""
    rois = torch.cat([torch.cat((torch.full_like(b[:, :1], i), b), dim=1) for i, b in enumerate(boxes)])
    return pool_level_by_level(feats, rois, pooler.level_of(rois[:, 1:]), pooler.output_size, pooler.scales,
                               pooler.sampling_ratio, pooler.aligned)


def benchmark_roi_align(cfg: Config, iters: int, warmup: int) -> Dict[str, Any]:
    """Median seconds of each way's forward + backward (``runs``), and how far apart
    their outputs and gradients are."""
    device = resolve_device(cfg.train.device)
    pooler = build_model(cfg).roi_heads.box_roi_pool
    feats, boxes = pooler_case(cfg, pooler, device)
    grad = torch.randn((sum(len(b) for b in boxes), feats[0].shape[1], *pooler.output_size),
                       generator=torch.Generator().manual_seed(1)).to(device)
    results: Dict[str, Tuple[Tensor, List[Tensor]]] = {}

    def way(name: str, pool: Any):
        def fn(_: int) -> int:
            out = pool(feats, boxes)
            grads = torch.autograd.grad(out, feats, grad, allow_unused=True)
            results[name] = (out.detach(), [torch.zeros_like(f) if gr is None else gr for f, gr in zip(feats, grads)])
            return len(boxes)
        return fn

    runners = [Runner("torchvision", way("torchvision", lambda f, b: _torchvision_pool(pooler, f, b)), device),
               Runner("ours", way("ours", pooler), device)]
    run_interleaved(runners, iters, warmup)
    (out_tv, grads_tv), (out_ours, grads_ours) = results["torchvision"], results["ours"]
    return {
        "task": "roi-align",
        "machine": machine_info(device),
        "rois": int(out_tv.shape[0]), "channels": int(feats[0].shape[1]),
        "levels": [list(f.shape) for f in feats], "output_size": list(pooler.output_size),
        "sampling_ratio": pooler.sampling_ratio, "aligned": pooler.aligned,
        "runs": {r.name: r.summary() for r in runners},
        "max_abs_diff": {"output": float((out_tv - out_ours).abs().max()),
                         "gradient": max(float((a - b).abs().max()) for a, b in zip(grads_tv, grads_ours))},
    }


def format_roi_align(result: Dict[str, Any]) -> str:
    """One line per way (median ms of forward + backward) and the speed-up."""
    runs = result["runs"]
    lines = [f"RoIAlign forward + backward: {result['rois']} RoIs x {result['channels']} channels over "
             f"{len(result['levels'])} levels, output {result['output_size']}"]
    for name, run in runs.items():
        lines.append(f"  {name:12s} {run['median_s'] * 1e3:9.2f} ms")
    lines.append(f"  torchvision / ours: {runs['torchvision']['median_s'] / runs['ours']['median_s']:.2f}x; "
                 f"max abs difference: output {result['max_abs_diff']['output']:.2e}, "
                 f"gradient {result['max_abs_diff']['gradient']:.2e}")
    return "\n".join(lines)
