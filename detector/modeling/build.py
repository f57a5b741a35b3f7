"""``build_model(cfg)``: compose Faster R-CNN from the config with plain constructor calls."""

from __future__ import annotations

from ..config import Config
from .anchors import AnchorGenerator
from .backbone import ResNetFPN, build_resnet_fpn
from .faster_rcnn import FasterRCNN
from .roi_heads import FastRCNNPredictor, MultiLevelRoIAlign, ROIHeads, SoftNMSSettings, TwoMLPHead
from .rpn import RegionProposalNetwork, RPNHead


def build_model(cfg: Config) -> FasterRCNN:
    """Build the detector described by ``cfg.model``, ``cfg.rpn`` and ``cfg.roi_heads``.

    The model is on the CPU, freshly initialised (apart from ``model.backbone_weights``);
    the caller moves it and loads weights explicitly: ``cfg.model.weights`` through
    ``detector.modeling.weights.load_initial_weights`` (training), or a checkpoint through
    ``load_weights`` (evaluation, inference).
    """
    m = cfg.model
    if len(m.pixel_mean) != 3 or len(m.pixel_std) != 3:
        raise ValueError("model.pixel_mean and model.pixel_std need 3 values (RGB)")
    backbone = build_resnet_fpn(
        depth_name=m.backbone,
        norm=m.norm,
        norm_eps=m.norm_eps,
        gn_groups=m.gn_groups,
        freeze_at=m.freeze_at,
        return_stages=m.return_stages,
        fpn_channels=m.fpn_channels,
        backbone_weights=m.backbone_weights,
    )
    if len(m.anchors.sizes) != len(backbone.strides):
        raise ValueError(
            f"model.anchors.sizes has {len(m.anchors.sizes)} levels but the backbone has "
            f"{len(backbone.strides)} (model.return_stages {list(m.return_stages)} + the pooled level)"
        )
    if m.num_classes is None:
        raise ValueError("model.num_classes is auto, which only training resolves (from the data set): "
                         "use the run's config.yaml, or set model.num_classes=K")
    if m.num_classes < 1:
        raise ValueError(f"model.num_classes must be >= 1, got {m.num_classes}")
    return FasterRCNN(backbone, build_rpn(cfg, backbone.out_channels), build_roi_heads(cfg, backbone),
                      m.pixel_mean, m.pixel_std, m.size_divisibility, canvas_sizes=m.canvas_sizes)


def build_rpn(cfg: Config, in_channels: int) -> RegionProposalNetwork:
    """The RPN of ``cfg.rpn`` with the anchors of ``cfg.model.anchors``, on FPN levels of
    ``in_channels`` channels."""
    r = cfg.rpn
    anchor_generator = AnchorGenerator(cfg.model.anchors.sizes, cfg.model.anchors.aspect_ratios)
    return RegionProposalNetwork(
        anchor_generator,
        RPNHead(in_channels, anchor_generator.num_anchors_per_location, r.conv_depth),
        box_coder_weights=r.box_coder_weights,
        pre_nms_topk=(r.pre_nms_topk_train, r.pre_nms_topk_test),
        post_nms_topk=(r.post_nms_topk_train, r.post_nms_topk_test),
        nms_thresh=r.nms_thresh,
        min_size=r.min_size,
        score_thresh=r.score_thresh,
        fg_iou_thresh=r.fg_iou_thresh,
        bg_iou_thresh=r.bg_iou_thresh,
        batch_size_per_image=r.batch_size_per_image,
        positive_fraction=r.positive_fraction,
        sigma=r.sigma,
        positive_weight=r.positive_weight,
    )


def build_roi_heads(cfg: Config, backbone: ResNetFPN) -> ROIHeads:
    """The box branch of ``cfg.roi_heads`` for ``cfg.model.num_classes`` classes (set),
    pooling the backbone's ``pooled_levels``."""
    h, num_classes = cfg.roi_heads, int(cfg.model.num_classes)
    pooler = MultiLevelRoIAlign(
        backbone.strides[: len(backbone.pooled_levels)],
        output_size=h.pooler_resolution,
        sampling_ratio=h.sampling_ratio,
        aligned=h.aligned,
    )
    box_head = TwoMLPHead(backbone.out_channels * h.pooler_resolution ** 2, h.representation_size)
    return ROIHeads(
        pooler,
        box_head,
        FastRCNNPredictor(h.representation_size, num_classes + 1),
        num_classes=num_classes,
        fg_iou_thresh=h.fg_iou_thresh,
        bg_iou_lo=h.bg_iou_lo,
        bg_iou_hi=h.bg_iou_hi,
        batch_size_per_image=h.batch_size_per_image,
        positive_fraction=h.positive_fraction,
        box_coder_weights=h.box_coder_weights,
        sigma=h.sigma,
        score_thresh=h.score_thresh,
        nms_thresh=h.nms_thresh,
        detections_per_img=h.detections_per_img,
        min_box_size=h.min_box_size,
        nms=SoftNMSSettings(h.nms.method, h.nms.sigma, h.nms.score_thresh) if h.nms.type == "soft" else None,
    )
