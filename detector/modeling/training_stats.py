"""Statistics of the training samplers (detectron2 logs the same ones), computed on the
device from what the losses were computed on, and never summed into the loss.

- ``anchor_sample_stats``: the RPN's sampled positive and negative anchors per image;
- ``roi_sample_stats``: the ROI heads' foreground fraction and classification accuracy
  (over all sampled RoIs and over the foreground ones).

Each value is a detached 0-d float32 tensor on the device: reading it on the host is the
caller's business (the trainer does it at logging points only). A value that is
undefined for a batch (an accuracy over no foreground RoI) is NaN, so that averages
over batches can leave it out (``torch.nanmean``).

``TrainingLosses`` carries them: it is the plain dict of scalar losses the model returns
in training (the contract of ``FasterRCNN.forward``), with the statistics in ``stats``.
"""

from __future__ import annotations

from typing import Dict, Mapping, Optional

import torch
from torch import Tensor

from .matching import Sample


class TrainingLosses(dict):
    """A dict of scalar losses (``{"loss_rpn_cls": ..., ...}``: exactly what the losses
    dict holds without statistics) with ``stats``: named detached 0-d statistics of the
    samples these losses were computed on (``rpn/num_pos_anchors``, ...), which are no
    losses: not summed, not back-propagated. A plain dict made from it (``dict(x)``)
    drops them; ``stats_of`` reads them from either."""

    def __init__(self, losses: Mapping[str, Tensor], stats: Optional[Mapping[str, Tensor]] = None) -> None:
        super().__init__(losses)
        self.stats: Dict[str, Tensor] = dict(stats or {})


def stats_of(losses: Mapping[str, Tensor]) -> Dict[str, Tensor]:
    """The ``stats`` of a ``TrainingLosses``; ``{}`` for any other mapping."""
    return dict(getattr(losses, "stats", {}))


@torch.no_grad()
def anchor_sample_stats(sample: Sample) -> Dict[str, Tensor]:
    """``rpn/num_pos_anchors`` and ``rpn/num_neg_anchors``: the foreground and background
    anchors of a batched ``Sample`` (``[B, S]``), per image, averaged over the B images."""
    # Float sums: fewer operators than integer counts divided (this runs every step).
    per_image = 1.0 / (sample.foreground.shape[0] if sample.foreground.dim() == 2 else 1)
    pos = sample.foreground.sum(dtype=torch.float32) * per_image
    return {"rpn/num_pos_anchors": pos,
            "rpn/num_neg_anchors": sample.valid.sum(dtype=torch.float32) * per_image - pos}


@torch.no_grad()
def roi_sample_stats(class_logits: Tensor, labels: Tensor, valid: Tensor) -> Dict[str, Tensor]:
    """Over the sampled RoIs of a batch:

    - ``roi/fg_fraction``: the foreground share of the valid RoIs;
    - ``roi/cls_accuracy``: the share of valid RoIs whose highest class logit is their
      label (background included);
    - ``roi/fg_cls_accuracy``: the same over the foreground RoIs only.

    Each is NaN where its denominator is 0 (no valid, or no foreground, RoI).

    Args:
        class_logits: ``[R, C]`` (C = K + 1, 0 = background); labels: ``[R]`` int64 in
            0..K; valid: ``[R]`` bool, False on padding slots.
    """
    correct = class_logits.argmax(dim=1) == labels
    fg = (labels > 0) & valid
    num_fg = fg.sum(dtype=torch.float32)
    num_valid = valid.sum(dtype=torch.float32)
    return {
        "roi/fg_fraction": num_fg / num_valid,
        "roi/cls_accuracy": (correct & valid).sum(dtype=torch.float32) / num_valid,
        "roi/fg_cls_accuracy": (correct & fg).sum(dtype=torch.float32) / num_fg,
    }
