"""The RPN's proposals with fixed shapes and no host synchronisation (the static step).

``static_proposals`` selects what ``RegionProposalNetwork.propose`` selects, with the
training top-k in training mode and the test top-k in eval mode (``eval.static``): top-k
per level, decode, clip, small-box and score filters, NMS per level, the best
``post_nms_topk`` of the image. It returns a fixed number of slots per image with a
validity mask instead of a list of data-dependent lengths. Every shape depends on the
batch shape (a canvas of ``model.canvas_sizes``) and the config only.
``static_backbone_and_proposals`` runs the model up to them (the static training step's
and the static inference's common front).

Shapes: B images, L levels, ``k_l = min(pre_nms_topk, T_l)`` candidates of level l,
``K = max_l k_l``, ``P = min(post_nms_topk, L * min(post_nms_topk, K))`` proposals.
"""

from __future__ import annotations

from typing import Dict, List, NamedTuple

import torch
from torch import Tensor

from .nms import DEFAULT_MAX_ITERS, static_nms
from .rpn import RegionProposalNetwork, flatten_head_outputs


class StaticProposals(NamedTuple):
    """``static_proposals``' result.

    Attributes:
        boxes: ``[B, P, 4]`` proposals, by decreasing objectness; invalid slots hold
            finite boxes that must not be used (``valid``).
        valid: ``[B, P]`` bool, a prefix of each row.
        nms_unconverged: ``[B * L]`` bool on the device (``nms.StaticNMSResult``).
    """

    boxes: Tensor
    valid: Tensor
    nms_unconverged: Tensor


def clip_to_sizes(boxes: Tensor, image_sizes: Tensor) -> Tensor:
    """Clip ``[B, M, 4]`` boxes to each image's ``(height, width)`` (``image_sizes``
    ``[B, 2]``, a tensor): the values of ``box_coder.clip_boxes`` per image."""
    size = image_sizes.to(boxes.dtype)
    height, width = size[:, 0, None, None], size[:, 1, None, None]
    x = torch.minimum(boxes[..., 0::2].clamp(min=0), width)
    y = torch.minimum(boxes[..., 1::2].clamp(min=0), height)
    return torch.stack((x, y), dim=-1).reshape(boxes.shape)


def _top_candidates(rpn: RegionProposalNetwork, anchors: List[Tensor], logits: List[Tensor],
                    deltas: List[Tensor]) -> tuple[List[Tensor], List[Tensor], List[int]]:
    """Per level the ``k_l`` best anchors of each image, decoded (one decode for all
    levels, as ``propose``): boxes ``[B, k_l, 4]``, sigmoid scores ``[B, k_l]``, the ``k_l``."""
    pre_nms = rpn.pre_nms_topk[0 if rpn.training else 1]
    num_images = logits[0].shape[0]
    top_d, top_a, top_l, counts = [], [], [], []
    for anc, lg, dl in zip(anchors, logits, deltas):
        k = min(pre_nms, lg.shape[1])
        top_logits, idx = lg.detach().topk(k, dim=1)  # [B, k]
        top_d.append(torch.gather(dl.detach(), 1, idx[:, :, None].expand(-1, -1, 4)))
        top_a.append(anc[idx])
        top_l.append(top_logits)
        counts.append(k)
    boxes = rpn.box_coder.decode(torch.cat(top_d, dim=1).float().reshape(-1, 4), torch.cat(top_a, dim=1).reshape(-1, 4))
    boxes = boxes.view(num_images, -1, 4)
    scores = torch.sigmoid(torch.cat(top_l, dim=1).float())
    return list(boxes.split(counts, dim=1)), list(scores.split(counts, dim=1)), counts


def _pad_levels(parts: List[Tensor], count: int, value: float) -> Tensor:
    """Per level ``[B, k_l, ...]`` -> ``[B, L, count, ...]``, padded with ``value``."""
    padded = []
    for p in parts:
        fill = p.new_full((p.shape[0], count - p.shape[1], *p.shape[2:]), value)
        padded.append(torch.cat((p, fill), dim=1))
    return torch.stack(padded, dim=1)


def static_proposals(rpn: RegionProposalNetwork, anchors: List[Tensor], logits: List[Tensor],
                     deltas: List[Tensor], image_sizes: Tensor,
                     nms_max_iters: int = DEFAULT_MAX_ITERS) -> StaticProposals:
    """The proposals of ``rpn`` (training or test top-k, by its mode) with fixed shapes
    (see the module docstring).

    Args:
        anchors: per level ``[T_l, 4]``; logits: per level ``[B, T_l]``; deltas: per
            level ``[B, T_l, 4]``.
        image_sizes: ``[B, 2]`` ``(height, width)`` of each image before padding.
        nms_max_iters: ``static_nms``'s bound (``rpn.nms_max_iters``).
    """
    post_nms = rpn.post_nms_topk[0 if rpn.training else 1]
    boxes, scores, counts = _top_candidates(rpn, anchors, logits, deltas)
    num_images, num_levels, top = logits[0].shape[0], len(counts), max(counts)
    b = clip_to_sizes(_pad_levels(boxes, top, 0.0).flatten(1, 2), image_sizes).view(num_images, num_levels, top, 4)
    s = _pad_levels(scores, top, 0.0)  # [B, L, K]
    real = _pad_levels([torch.ones_like(x, dtype=torch.bool) for x in scores], top, False)
    w, h = b[..., 2] - b[..., 0], b[..., 3] - b[..., 1]
    ok = real & (w >= rpn.min_size) & (h >= rpn.min_size)
    if rpn.score_thresh > 0:
        ok = ok & (s >= rpn.score_thresh)
    per_level = min(post_nms, top)
    flat_b, flat_s, flat_ok = b.flatten(0, 1), s.flatten(0, 1), ok.flatten(0, 1)  # [B * L, K, ...]
    res = static_nms(flat_b, flat_s, rpn.nms_thresh, per_level, max_iters=nms_max_iters, valid=flat_ok)
    kept_b = flat_b.gather(1, res.keep[:, :, None].expand(-1, -1, 4)).view(num_images, -1, 4)
    kept_s = torch.where(res.valid, flat_s.gather(1, res.keep), float("-inf")).view(num_images, -1)
    # All levels by decreasing score; ties keep level order (batched_nms's stable order).
    order = torch.sort(kept_s, dim=1, descending=True, stable=True).indices[:, :post_nms]
    out_b = kept_b.gather(1, order[:, :, None].expand(-1, -1, 4))
    out_valid = res.valid.view(num_images, -1).gather(1, order)
    return StaticProposals(out_b, out_valid, res.unconverged)


class StaticFront(NamedTuple):
    """``static_backbone_and_proposals``' result: the backbone's ``features`` by level
    name, the RPN's per-level ``anchors`` ``[T_l, 4]``, ``logits`` ``[B, T_l]`` and
    ``deltas`` ``[B, T_l, 4]``, and the ``proposals``."""

    features: Dict[str, Tensor]
    anchors: List[Tensor]
    logits: List[Tensor]
    deltas: List[Tensor]
    proposals: StaticProposals


def static_backbone_and_proposals(model: torch.nn.Module, images: Tensor, image_sizes: Tensor,
                                  nms_max_iters: int = DEFAULT_MAX_ITERS) -> StaticFront:
    """A ``FasterRCNN``'s backbone, RPN head, anchors and ``static_proposals`` (by the RPN's
    mode) for a padded batch ``images`` ``[B, 3, H, W]`` with ``image_sizes`` ``[B, 2]``."""
    features = model.backbone(images)
    feature_list: List[Tensor] = list(features.values())
    rpn = model.rpn
    logits, deltas = flatten_head_outputs(*rpn.head(feature_list))
    feature_sizes = [tuple(f.shape[-2:]) for f in feature_list]
    anchors = rpn.anchor_generator(tuple(images.shape[-2:]), feature_sizes, images.device, torch.float32)
    props = static_proposals(rpn, anchors, logits, deltas, image_sizes, nms_max_iters)
    return StaticFront(features, anchors, logits, deltas, props)
