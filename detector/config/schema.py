"""The config schema: one dataclass per section, every key with its type and default.

A key's allowed values sit next to it, in the field's metadata (see ``field_``):
``choices`` for a string with a fixed set of values, bounds (``ge``, ``gt``, ``le``,
``lt``) for a number, ``auto`` for a key that takes ``auto`` (stored as None).
``detector.config.validation`` reads them; rules that tie keys together, or that look
inside a list, are written out there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional, Sequence

# The longest image side (pixels) any input.* size may ask for: an 8192 x 8192 float
# image is 768 MiB before the backbone. (A batch is also estimated against the
# memory before work starts: detector.engine.memory.)
MAX_IMAGE_SIDE = 8192
MAX_SHAPES_IMAGES = 1_000_000  # images per split of the generated shapes set
# train.seed seeds numpy, whose seeds are 32-bit.
MAX_SEED = 2**32 - 1

def field_(
    default: Any,
    *,
    choices: Sequence[str] = (),
    ge: Optional[float] = None,
    gt: Optional[float] = None,
    le: Optional[float] = None,
    lt: Optional[float] = None,
    note: str = "",
    auto: bool = False,
    path: bool = False,
) -> Any:
    """A dataclass field with its allowed values as metadata.

    Args:
        default: the default value (an immutable one: a list key takes no bounds).
        choices: the allowed strings.
        ge, gt, le, lt: bounds of a number (>=, >, <=, <); None is always allowed for
            an Optional key (it means ``auto`` or "unset").
        note: words after the range in the error message, e.g. "(0 disables it)".
        auto: the key takes ``auto`` in YAML and overrides, stored as None.
        path: the key names a file or folder: a leading ``~`` is the home folder.
    """
    metadata = {"choices": tuple(choices), "ge": ge, "gt": gt, "le": le, "lt": lt, "note": note, "auto": auto,
                "path": path}
    return field(default=default, metadata=metadata)


@dataclass
class AnchorConfig:
    # One tuple of sizes (pixels, side of a square anchor) per FPN level.
    sizes: List[List[float]] = field(default_factory=lambda: [[32.0], [64.0], [128.0], [256.0], [512.0]])
    # Height / width ratios, shared by every level.
    aspect_ratios: List[float] = field(default_factory=lambda: [0.5, 1.0, 2.0])


@dataclass
class ModelConfig:
    # Number of object classes K, background excluded; the predictor has K + 1 outputs.
    # "auto" (stored as None) takes K from the training data: the COCO categories (or
    # data.class_names), VOC's 20 (or data.class_names), the shapes' 3. The run's
    # config.yaml records the resolved number. torchvision's COCO model: 90 (91 outputs).
    num_classes: Optional[int] = field_(None, ge=1, note="(classes without background) or auto", auto=True)
    backbone: str = field_("resnet50", choices=("resnet18", "resnet34", "resnet50", "resnet101"))
    norm: str = field_("frozen_bn", choices=("frozen_bn", "bn", "syncbn", "gn"))
    # BatchNorm epsilon. torchvision: 1e-5 for a model built without weights, 0.0 for
    # its COCO_V1 detection weights.
    norm_eps: float = field_(1e-5, ge=0, le=1)
    gn_groups: int = field_(32, ge=1)
    # Number of leading backbone stages frozen: 0 none, 1 stem, 2 stem+layer1, ... 5 all.
    freeze_at: int = field_(2, ge=0, le=5)
    # ResNet stages (1..4 = layer1..layer4) that feed the FPN.
    return_stages: List[int] = field(default_factory=lambda: [1, 2, 3, 4])
    fpn_channels: int = field_(256, ge=1, le=4096)
    # torchvision weights name for the backbone, e.g. "ResNet50_Weights.IMAGENET1K_V1"; "" = random.
    backbone_weights: str = ""
    # Whole-model weights: a local checkpoint path or a torchvision weights name
    # (e.g. "FasterRCNN_ResNet50_FPN_Weights.COCO_V1"); "" = none.
    weights: str = field_("", path=True)
    # Normalisation, on the 0..1 scale, applied inside the model.
    pixel_mean: List[float] = field(default_factory=lambda: [0.485, 0.456, 0.406])
    pixel_std: List[float] = field(default_factory=lambda: [0.229, 0.224, 0.225])
    size_divisibility: int = field_(32, ge=1, le=1024)
    # Fixed batch canvases [[H, W], ...] in pixels (each a multiple of size_divisibility):
    # a batch is padded to the smallest canvas that holds it, so the static part of the
    # network (backbone, FPN, RPN head) sees a few shapes only (compiled or CUDA-graph
    # captured code then pays). [] pads each batch to its own size. A batch larger than
    # every canvas falls back to its own size. 1x recipe: [[800, 1344], [1344, 800]].
    canvas_sizes: List[List[int]] = field(default_factory=list)
    anchors: AnchorConfig = field(default_factory=AnchorConfig)


@dataclass
class RPNConfig:
    conv_depth: int = field_(1, ge=1)
    pre_nms_topk_train: int = field_(2000, ge=1)  # per FPN level
    pre_nms_topk_test: int = field_(1000, ge=1)  # per FPN level
    post_nms_topk_train: int = field_(2000, ge=1)  # per image
    post_nms_topk_test: int = field_(1000, ge=1)  # per image
    nms_thresh: float = field_(0.7, gt=0, le=1)
    min_size: float = field_(1e-3, ge=0)  # pixels
    score_thresh: float = field_(0.0, ge=0, le=1)
    fg_iou_thresh: float = field_(0.7, gt=0, le=1)
    bg_iou_thresh: float = field_(0.3, ge=0, le=1)
    batch_size_per_image: int = field_(256, ge=1)
    positive_fraction: float = field_(0.5, gt=0, le=1)
    sigma: float = field_(3.0, gt=0)
    # -1: uniform outside weights 1/num_sampled; p in (0, 1): p/num_pos and (1-p)/num_neg.
    positive_weight: float = -1.0
    box_coder_weights: List[float] = field(default_factory=lambda: [1.0, 1.0, 1.0, 1.0])
    # Static step (train.static_step): Jacobi iterations per block of the proposal NMS
    # (modeling/nms.py); >= 32 (the block size) is exact for every input. On CUDA with
    # Triton the NMS is one exact kernel (ops/greedy_scan.py) and this does not apply.
    nms_max_iters: int = field_(32, ge=1, le=100000)


@dataclass
class NMSConfig:
    # Test-time NMS of the detections, per class. hard: torchvision's batched_nms at
    # roi_heads.nms_thresh. soft: Soft-NMS (Bodla et al. 2017), decaying the scores of
    # overlapping boxes instead of removing them: linear (1 - IoU above
    # roi_heads.nms_thresh) or gaussian (exp(-IoU^2 / sigma)); a box whose decayed score
    # falls below score_thresh is dropped. (detector/ops/soft_nms.py)
    type: str = field_("hard", choices=("hard", "soft"))
    method: str = field_("linear", choices=("linear", "gaussian"))
    sigma: float = field_(0.5, gt=0)
    score_thresh: float = field_(0.001, ge=0, le=1)


@dataclass
class ROIHeadsConfig:
    fg_iou_thresh: float = field_(0.5, gt=0, le=1)
    bg_iou_lo: float = field_(0.0, ge=0, le=1)
    bg_iou_hi: float = field_(0.5, ge=0, le=1)
    batch_size_per_image: int = field_(512, ge=1)
    positive_fraction: float = field_(0.25, gt=0, le=1)
    pooler_resolution: int = field_(7, ge=1, le=64)
    sampling_ratio: int = field_(2, ge=0, le=32, note="(samples per bin side; 0: adaptive)")
    aligned: bool = False
    representation_size: int = field_(1024, ge=1, le=16384)
    box_coder_weights: List[float] = field(default_factory=lambda: [10.0, 10.0, 5.0, 5.0])
    sigma: float = field_(1.0, gt=0)
    score_thresh: float = field_(0.05, ge=0, lt=1, note="(detections scoring above it are kept)")
    nms_thresh: float = field_(0.5, gt=0, le=1)
    detections_per_img: int = field_(100, ge=1)
    min_box_size: float = field_(1e-2, ge=0)  # pixels, detections smaller than this are removed
    nms: NMSConfig = field(default_factory=NMSConfig)


@dataclass
class SplitConfig:
    # COCO: image folder and instances JSON. VOC: VOCdevkit year folder and split name.
    # shapes: the folder written by detector.data.shapes and the split name.
    # Each format reads only its own keys (ann_file: COCO only; split: VOC and shapes), so a
    # key inherited from a base config of another format is not read.
    root: str = field_("", path=True)
    ann_file: str = field_("", path=True)
    split: str = ""


@dataclass
class ShapesConfig:
    num_train: int = field_(600, ge=1, le=MAX_SHAPES_IMAGES)
    num_val: int = field_(100, ge=1, le=MAX_SHAPES_IMAGES)
    seed: int = field_(0, ge=0, le=2**63 - 1)
    min_side: int = field_(96, ge=8, le=MAX_IMAGE_SIDE)  # pixels
    max_side: int = field_(224, ge=8, le=MAX_IMAGE_SIDE)


@dataclass
class DataConfig:
    format: str = field_("shapes", choices=("coco", "voc", "shapes"))
    train: SplitConfig = field(default_factory=SplitConfig)
    # More training sets of data.format, trained on with data.train as one set (VOC
    # 2007+2012 trainval, the paper's "07+12"; or COCO plus one's own COCO file): each
    # {root, ann_file, split} as data.train; the same classes in each (data.class_names).
    train_extra: List[SplitConfig] = field(default_factory=list)
    val: SplitConfig = field(default_factory=SplitConfig)
    # The classes to train on, in label order 1..K: VOC class names (default VOC's 20) or
    # COCO category names (default every category of the JSON). A subset trains on
    # those classes only; boxes of the other classes are dropped (counted in the log).
    class_names: List[str] = field(default_factory=list)
    # Labels of COCO-format data: "contiguous" maps the categories (sorted by id, or in
    # data.class_names order) to 1..K; "category_id" keeps label = category_id, so K is
    # the largest id in use (COCO: 90, as torchvision's COCO weights). Not for VOC.
    label_space: str = field_("contiguous", choices=("contiguous", "category_id"))
    filter_empty: bool = True
    use_difficult: bool = False
    # COCO-format data (coco, shapes): parse the annotation file once per machine and
    # share the records through a memory-mapped file in this folder, which the machine's
    # ranks and their loader workers read (detector.data.record_cache). "auto":
    # <train.output_dir>/cache in a distributed run (more than one rank), none in one
    # process; "": never; a folder: always (reused by later runs while the annotation
    # file and the data.* keys that shape the records are unchanged).
    cache_dir: str = field_("auto", path=True)
    # Images with an EXIF orientation (a camera's rotation): false reads the pixels as
    # stored (with a warning naming the file), true turns them as viewers show them, for
    # boxes annotated on the displayed image (sizes are then checked on the turned image).
    apply_exif: bool = False
    shapes: ShapesConfig = field(default_factory=ShapesConfig)
    num_workers: int = field_(2, ge=0, note="(0 loads in the main process)")
    persistent_workers: bool = True
    prefetch_factor: int = 2
    aspect_ratio_grouping: bool = True
    # Repeat-factor sampling threshold (LVIS); 0 disables it.
    repeat_factor_threshold: float = field_(0.0, ge=0, note="(0 disables it)")
    # Static step (train.static_step): ground-truth slots per image; an image with more
    # boxes trains on its first ones, with a log line naming it.
    max_gt_per_image: int = field_(100, ge=1, le=100000)


@dataclass
class LSJConfig:
    # Large-scale jitter (training): the image is resized so that it fits a size x size
    # square, times a scale drawn uniformly from [min_scale, max_scale], then randomly
    # cropped / padded (bottom-right, zeros) to size x size. Replaces the
    # min_size_train / max_size_train resize when enabled. (detector.data.transforms)
    enabled: bool = False
    min_scale: float = field_(0.1, gt=0, le=10)
    max_scale: float = field_(2.0, gt=0, le=10)
    size: int = field_(1024, ge=1)  # pixels


@dataclass
class CopyPasteConfig:
    # Copy-paste (training): with probability prob, up to max_objects boxes of another
    # training image (box regions: there are no masks) are pasted onto the sample; an
    # original box with less than min_visible of its area left is dropped, a partly
    # covered one shrinks to its visible part. (detector.data.copy_paste)
    enabled: bool = False
    prob: float = field_(0.5, ge=0, le=1)
    max_objects: int = field_(10, ge=1)
    min_visible: float = field_(0.3, gt=0, le=1)


@dataclass
class InputConfig:
    # Shorter side drawn from these values in training; longer side capped at max_size.
    # Every size in pixels, at most MAX_IMAGE_SIDE.
    min_size_train: List[int] = field(default_factory=lambda: [800])
    max_size_train: int = field_(1333, ge=1, le=MAX_IMAGE_SIDE)
    min_size_test: int = field_(800, ge=1, le=MAX_IMAGE_SIDE)
    max_size_test: int = field_(1333, ge=1, le=MAX_IMAGE_SIDE)
    hflip_prob: float = field_(0.5, ge=0, le=1)
    color_jitter: bool = False
    lsj: LSJConfig = field(default_factory=LSJConfig)
    copy_paste: CopyPasteConfig = field(default_factory=CopyPasteConfig)


@dataclass
class ParamGroupRule:
    # Parameters whose name contains `match` (first matching rule wins).
    match: str = ""
    lr_mult: float = 1.0
    weight_decay_mult: float = 1.0


@dataclass
class SolverConfig:
    optimizer: str = field_("sgd", choices=("sgd", "adamw"))
    lr: float = field_(0.02, gt=0)
    momentum: float = field_(0.9, ge=0, lt=1)
    nesterov: bool = False
    betas: List[float] = field(default_factory=lambda: [0.9, 0.999])
    weight_decay: float = field_(1e-4, ge=0)
    weight_decay_norm: float = field_(0.0, ge=0)
    bias_lr_mult: float = field_(1.0, ge=0)
    # None (null) = same as weight_decay.
    weight_decay_bias: Optional[float] = field_(None, ge=0, note="(or null: same as solver.weight_decay)")
    param_groups: List[ParamGroupRule] = field(default_factory=list)
    images_per_gpu: int = field_(2, ge=1)
    reference_batch_size: int = field_(16, ge=1)
    # Micro-batches of images_per_gpu per optimizer step (gradient accumulation).
    accumulate_steps: int = field_(1, ge=1, le=1024)
    scale_lr: bool = True
    max_iter: int = field_(90000, ge=0, note="(0: from solver.max_epochs)")
    # Schedules in epochs: with max_iter 0, the trainer converts max_epochs and
    # steps_epochs into max_iter and steps with the optimizer steps of an epoch
    # (data set size / (images_per_gpu * world size * accumulate_steps)), which it
    # records in iters_per_epoch (0: not converted) and writes to the run's config.yaml.
    max_epochs: int = field_(0, ge=0, note="(0: train by solver.max_iter)")
    steps_epochs: List[int] = field(default_factory=list)
    iters_per_epoch: int = field_(0, ge=0, note="(set by the trainer: 0 until converted)")
    schedule: str = field_("multistep", choices=("multistep", "cosine"))
    steps: List[int] = field(default_factory=lambda: [60000, 80000])
    gamma: float = field_(0.1, gt=0)
    warmup_iters: int = field_(1000, ge=0)
    warmup_factor: float = field_(0.001, gt=0, le=1)
    cosine_final_lr_factor: float = field_(0.0, ge=0, le=1)
    clip_grad_norm: float = field_(0.0, ge=0, note="(0 disables clipping)")


@dataclass
class AMPConfig:
    # auto (stored as None) | true | false. auto: on for CUDA, off for the CPU.
    enabled: Optional[bool] = field_(None, auto=True)
    # auto: bfloat16 where the device supports it, else float16 (with a GradScaler).
    # float16 autocast on a CPU device is refused. (detector.engine.amp)
    dtype: str = field_("auto", choices=("auto", "float16", "bfloat16"))


@dataclass
class EMAConfig:
    # An exponential moving average of the weights (detector.engine.ema): decay ramps up
    # as decay * (1 - exp(-updates / warmup)); saved in checkpoints, evaluated with eval.use_ema.
    enabled: bool = False
    decay: float = field_(0.9998, gt=0, lt=1)
    warmup: int = field_(2000, ge=0, note="(optimizer steps; 0: no ramp)")


@dataclass
class EarlyStopConfig:
    # Stop after this many periodic evaluations in a row without an improvement of
    # train.best_metric by more than min_delta (0: off). Needs train.eval_period > 0.
    patience: int = field_(0, ge=0, note="(0: off)")
    min_delta: float = field_(0.0, ge=0)


@dataclass
class TrainConfig:
    output_dir: str = field_("runs/default", path=True)
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    # auto: NCCL on CUDA, gloo on CPU. gloo on CUDA lets ranks share GPUs (rank r on
    # cuda:(LOCAL_RANK mod GPU count)), e.g. to test DDP + SyncBN on one GPU.
    dist_backend: str = field_("auto", choices=("auto", "nccl", "gloo"))
    # Seconds a collective waits for the other ranks before the run stops with one line
    # naming the rank that does not answer (frozen, stopped or lost): the process group's
    # timeout. A collective slow to complete is logged before (after a fifth of it, at
    # most 60 s).
    dist_timeout_s: float = field_(300.0, gt=0, le=86400.0)
    seed: int = field_(42, ge=0, le=MAX_SEED)
    deterministic: bool = False
    amp: AMPConfig = field(default_factory=AMPConfig)
    log_period: int = field_(20, ge=1)
    checkpoint_period: int = field_(5000, ge=0, note="(0: only at the end)")
    keep_last: int = field_(3, ge=0, note="(numbered checkpoints kept; 0: all)")
    eval_period: int = 5000
    best_metric: str = "AP"
    early_stop: EarlyStopConfig = field(default_factory=EarlyStopConfig)
    ema: EMAConfig = field(default_factory=EMAConfig)
    # A run stops after this many non-finite losses in a row.
    max_nonfinite_steps: int = field_(5, ge=1)
    tensorboard: bool = True
    vis_images: int = field_(4, ge=0)
    channels_last: bool = False
    cudnn_benchmark: bool = False
    compile_backbone: bool = False
    # A training step whose tensor shapes depend on the config only (no host syncs);
    # needs model.canvas_sizes. See detector/modeling/static_forward.py.
    static_step: bool = False
    # CUDA only: capture the static step with its SGD step in a CUDA graph, with a
    # device-side non-finite guard (detector/engine/graphed_step.py).
    cuda_graphs: bool = False
    # DistributedDataParallel settings (more than one rank): gradient bucket size in MiB
    # (torch's default 25) and gradients as views into the buckets (saves one copy).
    ddp_bucket_cap_mb: float = field_(25.0, gt=0)
    ddp_gradient_as_bucket_view: bool = False


@dataclass
class TTAConfig:
    # Test-time augmentation (detector/evaluation/tta.py): the model runs once per
    # shorter-side size (longer side capped at input.max_size_test), and with flip also
    # on the horizontally flipped image; the boxes, mapped back to the original image,
    # are merged and NMS'd per class (roi_heads.nms) and the top
    # roi_heads.detections_per_img kept. [] (the default) turns TTA off.
    sizes: List[int] = field(default_factory=list)
    flip: bool = False


@dataclass
class EvalConfig:
    # pycocotools or faster (faster-coco-eval).
    backend: str = field_("pycocotools", choices=("pycocotools", "faster"))
    images_per_gpu: int = field_(1, ge=1)
    voc_iou_thresh: float = field_(0.5, gt=0, le=1)
    # VOC07 11-point AP recall levels: "exact" (0, 0.1, ..., 1 as k/10) or "numpy_arange"
    # (np.arange(0, 1.1, 0.1), whose 0.30000000000000004, 0.6000000000000001 and
    # 0.7000000000000001 py-faster-rcnn, detectron2 and mmdetection use; see docs/evaluation.md).
    voc07_thresholds: str = field_("exact", choices=("exact", "numpy_arange"))
    # Score threshold for counting, precision/recall/F1 and the confusion matrix.
    score_thresh: float = field_(0.5, ge=0, le=1)
    compute_val_loss: bool = False
    amp: bool = False
    # With train.ema.enabled: evaluate the EMA weights (they choose best.pth; the raw
    # weights' metrics are logged as raw/<metric>); false: the raw ones (EMA as ema/<metric>).
    use_ema: bool = True
    tta: TTAConfig = field(default_factory=TTAConfig)
    # Inference with fixed shapes and no host syncs (needs model.canvas_sizes; the eager
    # detections, docs/evaluation.md): modeling/static_detect.py. cuda_graphs replays it
    # as one CUDA graph per batch shape (CUDA only).
    static: bool = False
    cuda_graphs: bool = False
    # eval.static: (RoI, class) candidates per image, best first, that enter the NMS (its
    # cost grows with the square); an image with more that keeps fewer than
    # roi_heads.detections_per_img is counted and reported after the run.
    static_candidates: int = field_(2048, ge=1, le=1000000)


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    rpn: RPNConfig = field(default_factory=RPNConfig)
    roi_heads: ROIHeadsConfig = field(default_factory=ROIHeadsConfig)
    data: DataConfig = field(default_factory=DataConfig)
    input: InputConfig = field(default_factory=InputConfig)
    solver: SolverConfig = field(default_factory=SolverConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
