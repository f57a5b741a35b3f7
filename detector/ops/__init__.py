"""Hand-written speed code the model uses, each kept because it is at least 2x faster
than the library operator it stands in for on a case users have, measured side by side
in one process (docs/performance.md), and each giving the library operator's values (to
float rounding, where a sum runs in another order):

- ``roi_align``, ``multi_level_roi_align``: RoIAlign as a gather (``embedding_bag``)
  and its transpose on the CPU where a gradient is needed; torchvision's op elsewhere;
- ``stem_max_pool``: the ResNet stem's max pool without a gradient on the CPU.

and ops the library lacks: ``soft_nms``, ``batched_soft_nms`` (Soft-NMS, Bodla et al. 2017).

The floor under ``detector.modeling``: it imports torch and torchvision only.
"""

from .max_pool import stem_max_pool, stem_pool_by_views
from .roi_align import multi_level_roi_align, roi_align
from .soft_nms import batched_soft_nms, soft_nms

__all__ = ["batched_soft_nms", "multi_level_roi_align", "roi_align", "stem_max_pool", "stem_pool_by_views", "soft_nms"]
