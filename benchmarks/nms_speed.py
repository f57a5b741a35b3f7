"""``tools/benchmark.py --task nms``: the proposal NMS of one training step, timed four
ways side by side on the config's device, with its config's sizes.

- ``torchvision``: what torchvision's RPN does, per image ``batched_nms`` over the levels
  (one host sync per image, data-dependent output length);
- ``scan`` and ``blocks``: ``static_nms`` with each method on the static step's padded
  ``[images x levels, pre_nms_topk_train]`` rows (fixed shapes, no host sync);
- ``scan_kernel``: ``ops.greedy_scan`` alone, on the rows' suppression words packed
  beforehand (what ``scan`` spends outside it: sorting, IoUs, packing, the slots).

The boxes are clustered (a few centres per row, many near-duplicates: long suppression
chains, as in an RPN's top-k), inside the largest of ``model.canvas_sizes``. Each static
method's kept indices are checked against ``torchvision.ops.nms`` row by row.
"""

from __future__ import annotations

from typing import Any, Dict, Tuple

import torch
import torchvision
from torch import Tensor

from detector.config import Config
from detector.distributed import resolve_device
from detector.modeling.nms import resolve_method, static_nms, suppression_matrix
from detector.ops.greedy_scan import greedy_scan, pack_suppression

from .timing import Runner, machine_info, run_interleaved

CENTRES = 24  # clusters per row


def clustered_rows(rows: int, num: int, height: int, width: int, size: float, seed: int = 0) -> Tuple[Tensor, Tensor]:
    """``rows`` sets of ``num`` boxes: ``([rows, num, 4]`` x1y1x2y2 pixels inside the
    ``height x width`` canvas, ``[rows, num]`` scores in [0, 1))``; sides ``size`` x 0.75-1.5,
    centres jittered by a tenth of a side around ``CENTRES`` points per row."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.rand(rows, CENTRES, 2, generator=g) * torch.tensor([width, height])
    pick = torch.randint(0, CENTRES, (rows, num), generator=g)
    xy = centres.gather(1, pick[:, :, None].expand(-1, -1, 2))
    wh = size * (0.75 + 0.75 * torch.rand(rows, num, 2, generator=g))
    xy = xy + 0.1 * wh * torch.randn(rows, num, 2, generator=g)
    boxes = torch.cat((xy - wh / 2, xy + wh / 2), dim=2)
    boxes = torch.minimum(boxes.clamp(min=0), torch.tensor([width, height, width, height], dtype=boxes.dtype))
    return boxes, torch.rand(rows, num, generator=g)


def packed_rows(boxes: Tensor, scores: Tensor, threshold: float) -> Tensor:
    """The suppression words ``[R, N, W]`` of each row's boxes in decreasing score order,
    as ``static_nms`` builds them (``pack_suppression`` of ``suppression_matrix``)."""
    order = scores.argsort(dim=1, descending=True, stable=True)
    ranked = boxes.gather(1, order[:, :, None].expand(-1, -1, 4))
    return pack_suppression(suppression_matrix(ranked, torch.ones_like(scores, dtype=torch.bool), threshold))


def _matches(keep: Tensor, valid: Tensor, boxes: Tensor, scores: Tensor, threshold: float) -> bool:
    """Every row's kept indices (valid slots) equal ``torchvision.ops.nms``'s first ones."""
    for r in range(boxes.shape[0]):
        ref = torchvision.ops.nms(boxes[r], scores[r], threshold)[: keep.shape[1]]
        if not torch.equal(keep[r][valid[r]].cpu(), ref.cpu()):
            return False
    return True


def benchmark_nms(cfg: Config, iters: int, warmup: int) -> Dict[str, Any]:
    """Median seconds of each way per step's proposal NMS (``runs``), whether each static
    method matches torchvision (``matches_torchvision``), and the sizes used."""
    device = resolve_device(cfg.train.device)
    images, levels = cfg.solver.images_per_gpu, len(cfg.model.anchors.sizes)
    num, threshold, max_out = cfg.rpn.pre_nms_topk_train, cfg.rpn.nms_thresh, cfg.rpn.post_nms_topk_train
    height, width = max(cfg.model.canvas_sizes or [[cfg.input.max_size_train] * 2], key=lambda hw: hw[0] * hw[1])
    sizes = [s for level in cfg.model.anchors.sizes for s in level]
    boxes, scores = clustered_rows(images * levels, num, height, width, float(sum(sizes) / len(sizes)))
    boxes, scores = boxes.to(device), scores.to(device)
    level_ids = torch.arange(levels, device=device).repeat_interleave(num)

    def torchvision_way(_: int) -> int:
        per_image_b, per_image_s = boxes.view(images, levels * num, 4), scores.view(images, levels * num)
        for b in range(images):
            torchvision.ops.batched_nms(per_image_b[b], per_image_s[b], level_ids, threshold)[:max_out]
        return images

    results: Dict[str, Dict[str, Tensor]] = {}

    def static_way(method: str):
        def fn(_: int) -> int:
            res = static_nms(boxes, scores, threshold, min(max_out, num), max_iters=cfg.rpn.nms_max_iters,
                             method=method)
            results[method] = {"keep": res.keep, "valid": res.valid}
            return images
        return fn

    words, all_valid = packed_rows(boxes, scores, threshold), torch.ones_like(scores, dtype=torch.bool)

    def scan_kernel(_: int) -> int:
        greedy_scan(words, all_valid)
        return images

    runners = [Runner("torchvision", torchvision_way, device), Runner("scan", static_way("scan"), device),
               Runner("scan_kernel", scan_kernel, device), Runner("blocks", static_way("blocks"), device)]
    run_interleaved(runners, iters, warmup)
    matches = {m: _matches(r["keep"], r["valid"], boxes, scores, threshold) for m, r in results.items()}
    return {
        "task": "nms",
        "machine": machine_info(device),
        "rows": images * levels, "boxes_per_row": num, "iou_threshold": threshold, "max_out": min(max_out, num),
        "canvas": [height, width], "auto_method": resolve_method("auto", device),
        "runs": {r.name: r.summary() for r in runners},
        "matches_torchvision": matches,
    }


def format_nms(result: Dict[str, Any]) -> str:
    """One line per way: median milliseconds per step, and the static methods' check."""
    lines = [f"proposal NMS: {result['rows']} rows x {result['boxes_per_row']} boxes "
             f"(auto = {result['auto_method']})"]
    for name, run in result["runs"].items():
        check = result["matches_torchvision"].get(name)
        suffix = "" if check is None else f"  matches torchvision: {check}"
        lines.append(f"  {name:12s} {run['median_s'] * 1e3:9.2f} ms{suffix}")
    return "\n".join(lines)
