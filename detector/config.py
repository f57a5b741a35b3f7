"""Typed configuration: dataclass schema, YAML loading with ``base:`` inheritance,
and ``key=value`` command-line overrides.

Every key has a type and a default here. A YAML file or an override that names a key
the schema does not have, or gives a value of the wrong type, raises ``ConfigError``
with the full dotted key and the nearest valid key::

    >>> load_config("configs/tiny_cpu.yaml", ["solver.lrr=0.1"])
    ConfigError: unknown config key 'solver.lrr' (did you mean 'solver.lr'?)

Resolution order, last wins: schema defaults, the chain of ``base:`` files (the
deepest base first), the file itself, then the overrides in the order given.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, List, Optional, Tuple

import torch
import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from detector.messages import first_line


class ConfigError(ValueError):
    """A config file or override that does not fit the schema."""


# --------------------------------------------------------------------------- schema


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
    num_classes: Optional[int] = None
    backbone: str = "resnet50"  # resnet18 | resnet34 | resnet50 | resnet101
    # frozen_bn | bn | syncbn | gn
    norm: str = "frozen_bn"
    # BatchNorm epsilon. torchvision: 1e-5 for a model built without weights, 0.0 for
    # its COCO_V1 detection weights.
    norm_eps: float = 1e-5
    gn_groups: int = 32
    # Number of leading backbone stages frozen: 0 none, 1 stem, 2 stem+layer1, ... 5 all.
    freeze_at: int = 2
    # ResNet stages (1..4 = layer1..layer4) that feed the FPN.
    return_stages: List[int] = field(default_factory=lambda: [1, 2, 3, 4])
    fpn_channels: int = 256
    # torchvision weights name for the backbone, e.g. "ResNet50_Weights.IMAGENET1K_V1"; "" = random.
    backbone_weights: str = ""
    # Whole-model weights: a local checkpoint path or a torchvision weights name
    # (e.g. "FasterRCNN_ResNet50_FPN_Weights.COCO_V1"); "" = none.
    weights: str = ""
    # Normalisation, on the 0..1 scale, applied inside the model.
    pixel_mean: List[float] = field(default_factory=lambda: [0.485, 0.456, 0.406])
    pixel_std: List[float] = field(default_factory=lambda: [0.229, 0.224, 0.225])
    size_divisibility: int = 32
    # Fixed batch canvases [[H, W], ...] in pixels (each a multiple of size_divisibility):
    # a batch is padded to the smallest canvas that holds it, so the static part of the
    # network (backbone, FPN, RPN head) sees a few shapes only (compiled or CUDA-graph
    # captured code then pays). [] pads each batch to its own size. A batch larger than
    # every canvas falls back to its own size. 1x recipe: [[800, 1344], [1344, 800]].
    canvas_sizes: List[List[int]] = field(default_factory=list)
    anchors: AnchorConfig = field(default_factory=AnchorConfig)


@dataclass
class RPNConfig:
    conv_depth: int = 1
    pre_nms_topk_train: int = 2000  # per FPN level
    pre_nms_topk_test: int = 1000  # per FPN level
    post_nms_topk_train: int = 2000  # per image
    post_nms_topk_test: int = 1000  # per image
    nms_thresh: float = 0.7
    min_size: float = 1e-3  # pixels
    score_thresh: float = 0.0
    fg_iou_thresh: float = 0.7
    bg_iou_thresh: float = 0.3
    batch_size_per_image: int = 256
    positive_fraction: float = 0.5
    sigma: float = 3.0
    # -1: uniform outside weights 1/num_sampled; p in (0, 1): p/num_pos and (1-p)/num_neg.
    positive_weight: float = -1.0
    box_coder_weights: List[float] = field(default_factory=lambda: [1.0, 1.0, 1.0, 1.0])


@dataclass
class ROIHeadsConfig:
    fg_iou_thresh: float = 0.5
    bg_iou_lo: float = 0.0
    bg_iou_hi: float = 0.5
    batch_size_per_image: int = 512
    positive_fraction: float = 0.25
    pooler_resolution: int = 7
    sampling_ratio: int = 2
    aligned: bool = False
    representation_size: int = 1024
    box_coder_weights: List[float] = field(default_factory=lambda: [10.0, 10.0, 5.0, 5.0])
    sigma: float = 1.0
    score_thresh: float = 0.05
    nms_thresh: float = 0.5
    detections_per_img: int = 100
    min_box_size: float = 1e-2  # pixels, detections smaller than this are removed


@dataclass
class SplitConfig:
    # COCO: image folder and instances JSON. VOC: VOCdevkit year folder and split name.
    # shapes: the folder written by detector.data.shapes and the split name.
    root: str = ""
    ann_file: str = ""
    split: str = ""


@dataclass
class ShapesConfig:
    num_train: int = 600
    num_val: int = 100
    seed: int = 0
    min_side: int = 96
    max_side: int = 224


@dataclass
class DataConfig:
    format: str = "shapes"  # coco | voc | shapes
    train: SplitConfig = field(default_factory=SplitConfig)
    val: SplitConfig = field(default_factory=SplitConfig)
    # The classes to train on, in label order 1..K: VOC class names (default VOC's 20) or
    # COCO category names (default every category of the JSON). A subset trains on
    # those classes only; boxes of the other classes are dropped (counted in the log).
    class_names: List[str] = field(default_factory=list)
    # Labels of COCO-format data: "contiguous" maps the categories (sorted by id, or in
    # data.class_names order) to 1..K; "category_id" keeps label = category_id, so K is
    # the largest id in use (COCO: 90, as torchvision's COCO weights). Not for VOC.
    label_space: str = "contiguous"
    filter_empty: bool = True
    use_difficult: bool = False
    shapes: ShapesConfig = field(default_factory=ShapesConfig)
    num_workers: int = 2
    persistent_workers: bool = True
    prefetch_factor: int = 2
    aspect_ratio_grouping: bool = True
    # Repeat-factor sampling threshold (LVIS); 0 disables it.
    repeat_factor_threshold: float = 0.0


@dataclass
class InputConfig:
    # Shorter side drawn from these values in training; longer side capped at max_size.
    min_size_train: List[int] = field(default_factory=lambda: [800])
    max_size_train: int = 1333
    min_size_test: int = 800
    max_size_test: int = 1333
    hflip_prob: float = 0.5
    color_jitter: bool = False


@dataclass
class ParamGroupRule:
    # Parameters whose name contains `match` (first matching rule wins).
    match: str = ""
    lr_mult: float = 1.0
    weight_decay_mult: float = 1.0


@dataclass
class SolverConfig:
    optimizer: str = "sgd"  # sgd | adamw
    lr: float = 0.02
    momentum: float = 0.9
    nesterov: bool = False
    betas: List[float] = field(default_factory=lambda: [0.9, 0.999])
    weight_decay: float = 1e-4
    weight_decay_norm: float = 0.0
    bias_lr_mult: float = 1.0
    weight_decay_bias: Optional[float] = None  # None = same as weight_decay
    param_groups: List[ParamGroupRule] = field(default_factory=list)
    images_per_gpu: int = 2
    reference_batch_size: int = 16
    scale_lr: bool = True
    max_iter: int = 90000
    schedule: str = "multistep"  # multistep | cosine
    steps: List[int] = field(default_factory=lambda: [60000, 80000])
    gamma: float = 0.1
    warmup_iters: int = 1000
    warmup_factor: float = 0.001
    cosine_final_lr_factor: float = 0.0
    clip_grad_norm: float = 0.0  # 0 disables clipping


@dataclass
class AMPConfig:
    # auto (stored as None) | true | false. auto: on for CUDA, off for the CPU.
    enabled: Optional[bool] = None
    # auto | float16 | bfloat16. auto: bfloat16 where the device supports it, else
    # float16 (with a GradScaler). float16 autocast on a CPU device is refused.
    dtype: str = "auto"


@dataclass
class TrainConfig:
    output_dir: str = "runs/default"
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    # auto: NCCL on CUDA, gloo on CPU. gloo on CUDA lets ranks share GPUs (rank r on
    # cuda:(LOCAL_RANK mod GPU count)), e.g. to test DDP + SyncBN on one GPU.
    dist_backend: str = "auto"  # auto | nccl | gloo
    seed: int = 42
    deterministic: bool = False
    amp: AMPConfig = field(default_factory=AMPConfig)
    log_period: int = 20
    checkpoint_period: int = 5000
    keep_last: int = 3
    eval_period: int = 5000
    best_metric: str = "AP"
    # A run stops after this many non-finite losses in a row.
    max_nonfinite_steps: int = 5
    tensorboard: bool = True
    vis_images: int = 4
    channels_last: bool = False
    cudnn_benchmark: bool = False
    compile_backbone: bool = False
    # DistributedDataParallel settings (more than one rank): gradient bucket size in MiB
    # (torch's default 25) and gradients as views into the buckets (saves one copy).
    ddp_bucket_cap_mb: float = 25.0
    ddp_gradient_as_bucket_view: bool = False


@dataclass
class EvalConfig:
    backend: str = "pycocotools"  # pycocotools | faster | numpy (vectorised, same numbers)
    images_per_gpu: int = 1
    voc_iou_thresh: float = 0.5
    # VOC07 11-point AP recall levels: "exact" (0, 0.1, ..., 1 as k/10) or "numpy_arange"
    # (np.arange(0, 1.1, 0.1), whose 0.30000000000000004, 0.6000000000000001 and
    # 0.7000000000000001 py-faster-rcnn, detectron2 and mmdetection use; see docs/evaluation.md).
    voc07_thresholds: str = "exact"
    # Score threshold for counting, precision/recall/F1 and the confusion matrix.
    score_thresh: float = 0.5
    compute_val_loss: bool = False
    amp: bool = False


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


# --------------------------------------------------------------------------- helpers


def _valid_keys(schema: Any, prefix: str = "") -> List[str]:
    """All dotted keys of a dataclass schema (leaves and sections)."""
    keys = []
    for f in dataclasses.fields(schema):
        key = f"{prefix}{f.name}"
        keys.append(key)
        value = getattr(schema, f.name)
        if dataclasses.is_dataclass(value):
            keys.extend(_valid_keys(value, key + "."))
    return keys


def _unknown_key_error(key: str, schema: Any = None, prefix: str = "") -> ConfigError:
    """An error naming ``key`` and the nearest valid key (``schema`` is the section that
    lacks it, ``prefix`` that section's dotted name)."""
    valid = _valid_keys(Config())
    if schema is not None and prefix.endswith("]."):  # an item of a list of sections
        valid = [prefix + k for k in _valid_keys(schema)]
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
    if not close:
        # Compare the last component within the same section too.
        section, _, leaf = key.rpartition(".")
        siblings = [k.rpartition(".")[2] for k in valid if k.rpartition(".")[0] == section]
        near = difflib.get_close_matches(leaf, siblings, n=1, cutoff=0.5)
        close = [f"{section}.{near[0]}" if section else near[0]] if near else []
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    return ConfigError(f"unknown config key '{key}'{hint}")


def _check_keys(data: Any, schema: Any, prefix: str, source: str) -> None:
    """Raise ConfigError for the first key of ``data`` that ``schema`` lacks."""
    if not isinstance(data, dict):
        return
    names = {f.name: f for f in dataclasses.fields(schema)}
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if key not in names:
            err = _unknown_key_error(dotted, schema, prefix)
            raise ConfigError(f"{source}: {err}")
        sub = getattr(schema, key)
        if dataclasses.is_dataclass(sub):
            if value is not None and not isinstance(value, dict):
                raise ConfigError(f"{source}: config key '{dotted}' is a section; got {value!r}")
            _check_keys(value, sub, dotted + ".", source)
        elif key == "param_groups" and isinstance(value, list):
            for i, rule in enumerate(value):
                if not isinstance(rule, dict):
                    raise ConfigError(f"{source}: '{dotted}[{i}]' must be a mapping like {{match: ..., lr_mult: ...}}")
                _check_keys(rule, ParamGroupRule(), f"{dotted}[{i}].", source)


def _read_yaml(path: Path, seen: tuple[Path, ...] = ()) -> List[tuple[dict, str]]:
    """Return the chain of YAML mappings to merge, the deepest ``base:`` first."""
    path = path.resolve()
    if path in seen:
        chain = " -> ".join(str(p) for p in (*seen, path))
        raise ConfigError(f"config 'base:' chain has a cycle: {chain}")
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}".replace("\n", " ")) from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    base = data.pop("base", None)
    chain: List[tuple[dict, str]] = []
    if base:
        base_path = Path(base)
        if not base_path.is_absolute():
            base_path = path.parent / base_path
        chain.extend(_read_yaml(base_path, (*seen, path)))
    chain.append((data, str(path)))
    return chain


# Keys that take ``auto``, stored as None in the typed config (and written back as auto).
_AUTO_KEYS = ("model.num_classes", "train.amp.enabled")


def _auto_to_none(data: dict) -> dict:
    """``data`` with ``auto`` replaced by None at the keys of ``_AUTO_KEYS`` (in place)."""
    for key in _AUTO_KEYS:
        *sections, leaf = key.split(".")
        node: Any = data
        for part in sections:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and isinstance(node.get(leaf), str) and node[leaf].strip().lower() == "auto":
            node[leaf] = None
    return data


def _parse_override(item: str) -> tuple[str, Any]:
    if "=" not in item:
        raise ConfigError(f"override '{item}' is not of the form key=value")
    key, _, raw = item.partition("=")
    key = key.strip()
    try:
        value = yaml.safe_load(raw) if raw.strip() != "" else ""
    except yaml.YAMLError:
        value = raw
    return key, value


def _nest(key: str, value: Any) -> dict:
    out: Any = value
    for part in reversed(key.split(".")):
        out = {part: out}
    return out


def _merge(base: Any, data: dict, source: str) -> Any:
    try:
        return OmegaConf.merge(base, data)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or "?"
        msg = first_line(exc)
        raise ConfigError(f"{source}: bad value for config key '{key}': {msg}") from None


_CHOICES = {
    "model.backbone": ("resnet18", "resnet34", "resnet50", "resnet101"),
    "model.norm": ("frozen_bn", "bn", "syncbn", "gn"),
    "data.format": ("coco", "voc", "shapes"),
    "data.label_space": ("contiguous", "category_id"),
    "solver.optimizer": ("sgd", "adamw"),
    "solver.schedule": ("multistep", "cosine"),
    "train.amp.dtype": ("auto", "float16", "bfloat16"),
    "train.dist_backend": ("auto", "nccl", "gloo"),
    "eval.backend": ("pycocotools", "faster", "numpy"),
    "eval.voc07_thresholds": ("exact", "numpy_arange"),
}


def _get(cfg: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


# Range of each number, checked at load time: (key, test, what the test means). Every
# float anywhere in the config must also be finite (checked generically, before these).
_RANGES: Tuple[Tuple[str, Callable[[Any], bool], str], ...] = (
    ("model.gn_groups", lambda v: v >= 1, ">= 1"),
    ("train.ddp_bucket_cap_mb", lambda v: v > 0, "> 0"),
    ("model.fpn_channels", lambda v: v >= 1, ">= 1"),
    ("model.size_divisibility", lambda v: v >= 1, ">= 1"),
    ("rpn.conv_depth", lambda v: v >= 1, ">= 1"),
    ("rpn.pre_nms_topk_train", lambda v: v >= 1, ">= 1"),
    ("rpn.pre_nms_topk_test", lambda v: v >= 1, ">= 1"),
    ("rpn.post_nms_topk_train", lambda v: v >= 1, ">= 1"),
    ("rpn.post_nms_topk_test", lambda v: v >= 1, ">= 1"),
    ("rpn.nms_thresh", lambda v: 0 < v <= 1, "in (0, 1]"),
    ("rpn.min_size", lambda v: v >= 0, ">= 0"),
    ("rpn.fg_iou_thresh", lambda v: 0 < v <= 1, "in (0, 1]"),
    ("rpn.bg_iou_thresh", lambda v: 0 <= v <= 1, "in [0, 1]"),
    ("rpn.batch_size_per_image", lambda v: v >= 1, ">= 1"),
    ("rpn.sigma", lambda v: v > 0, "> 0"),
    ("roi_heads.fg_iou_thresh", lambda v: 0 < v <= 1, "in (0, 1]"),
    ("roi_heads.bg_iou_lo", lambda v: 0 <= v <= 1, "in [0, 1]"),
    ("roi_heads.bg_iou_hi", lambda v: 0 <= v <= 1, "in [0, 1]"),
    ("roi_heads.batch_size_per_image", lambda v: v >= 1, ">= 1"),
    ("roi_heads.pooler_resolution", lambda v: v >= 1, ">= 1"),
    ("roi_heads.representation_size", lambda v: v >= 1, ">= 1"),
    ("roi_heads.sigma", lambda v: v > 0, "> 0"),
    ("roi_heads.score_thresh", lambda v: 0 <= v <= 1, "in [0, 1]"),
    ("roi_heads.nms_thresh", lambda v: 0 < v <= 1, "in (0, 1]"),
    ("roi_heads.detections_per_img", lambda v: v >= 1, ">= 1"),
    ("roi_heads.min_box_size", lambda v: v >= 0, ">= 0"),
    ("data.num_workers", lambda v: v >= 0, ">= 0 (0 loads in the main process)"),
    ("data.repeat_factor_threshold", lambda v: v >= 0, ">= 0 (0 disables it)"),
    ("input.max_size_train", lambda v: v >= 1, ">= 1"),
    ("input.min_size_test", lambda v: v >= 1, ">= 1"),
    ("input.max_size_test", lambda v: v >= 1, ">= 1"),
    ("input.hflip_prob", lambda v: 0 <= v <= 1, "in [0, 1]"),
    ("solver.lr", lambda v: v > 0, "> 0"),
    ("solver.momentum", lambda v: 0 <= v < 1, "in [0, 1)"),
    ("solver.weight_decay", lambda v: v >= 0, ">= 0"),
    ("solver.weight_decay_norm", lambda v: v >= 0, ">= 0"),
    ("solver.bias_lr_mult", lambda v: v >= 0, ">= 0"),
    ("solver.weight_decay_bias", lambda v: v is None or v >= 0, ">= 0 (or null: same as solver.weight_decay)"),
    ("solver.images_per_gpu", lambda v: v >= 1, ">= 1"),
    ("solver.reference_batch_size", lambda v: v >= 1, ">= 1"),
    ("solver.max_iter", lambda v: v >= 1, ">= 1"),
    ("solver.gamma", lambda v: v > 0, "> 0"),
    ("solver.warmup_iters", lambda v: v >= 0, ">= 0"),
    ("solver.warmup_factor", lambda v: 0 < v <= 1, "in (0, 1]"),
    ("solver.cosine_final_lr_factor", lambda v: 0 <= v <= 1, "in [0, 1]"),
    ("solver.clip_grad_norm", lambda v: v >= 0, ">= 0 (0 disables clipping)"),
    ("train.log_period", lambda v: v >= 1, ">= 1"),
    ("train.checkpoint_period", lambda v: v >= 0, ">= 0 (0: only at the end)"),
    ("train.keep_last", lambda v: v >= 0, ">= 0"),
    ("train.max_nonfinite_steps", lambda v: v >= 1, ">= 1"),
    ("train.vis_images", lambda v: v >= 0, ">= 0"),
    ("eval.images_per_gpu", lambda v: v >= 1, ">= 1"),
    ("eval.voc_iou_thresh", lambda v: 0 < v <= 1, "in (0, 1]"),
    ("eval.score_thresh", lambda v: 0 <= v <= 1, "in [0, 1]"),
)


def _check_finite(value: Any, key: str) -> None:
    """Raise ConfigError for the first NaN or infinite float in ``value`` (a config
    section, a list or a number); ``key`` is its dotted name."""
    if dataclasses.is_dataclass(value):
        for f in dataclasses.fields(value):
            _check_finite(getattr(value, f.name), f"{key}.{f.name}" if key else f.name)
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _check_finite(item, f"{key}[{i}]")
    elif isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"config key '{key}' is {value}; it must be a finite number")


def validate_config(cfg: Config) -> None:
    """Check values the type system cannot: every float finite, choices, ranges,
    consistent lengths. The first problem raises a one-line ``ConfigError`` naming the key."""
    _check_finite(cfg, "")
    for key, choices in _CHOICES.items():
        value = _get(cfg, key)
        if value not in choices:
            raise ConfigError(f"config key '{key}' is {value!r}; expected one of {', '.join(choices)}")
    for key, ok, what in _RANGES:
        value = _get(cfg, key)
        if not ok(value):
            raise ConfigError(f"config key '{key}' must be {what}, got {value}")
    _check_model_keys(cfg)
    _check_recipe_keys(cfg)


def _check_model_keys(cfg: Config) -> None:
    """``validate_config``'s checks of ``model.*`` (and of ``train.compile_backbone``,
    which needs fixed canvases)."""
    if cfg.model.num_classes is not None and cfg.model.num_classes < 1:
        raise ConfigError(
            f"config key 'model.num_classes' must be >= 1 (classes without background) or auto, got {cfg.model.num_classes}"
        )
    if not 0 <= cfg.model.freeze_at <= 5:
        raise ConfigError(f"config key 'model.freeze_at' must be in 0..5, got {cfg.model.freeze_at}")
    if len(cfg.model.pixel_mean) != 3 or len(cfg.model.pixel_std) != 3:
        raise ConfigError("config keys 'model.pixel_mean' and 'model.pixel_std' need 3 values (RGB)")
    if any(s <= 0 for s in cfg.model.pixel_std):
        raise ConfigError(f"config key 'model.pixel_std' must be positive, got {cfg.model.pixel_std}")
    d = cfg.model.size_divisibility
    for canvas in cfg.model.canvas_sizes:
        if len(canvas) != 2 or any(v <= 0 or v % d for v in canvas):
            raise ConfigError(
                f"config key 'model.canvas_sizes' takes [height, width] pairs that are positive multiples of "
                f"model.size_divisibility ({d}), got {canvas}"
            )
    if cfg.train.compile_backbone and not cfg.model.canvas_sizes:
        raise ConfigError(
            "config key 'train.compile_backbone' needs 'model.canvas_sizes' (fixed batch shapes): without them every "
            "new batch size recompiles, measured slower than eager on the CPU and on an H100 (docs/performance.md)"
        )
    if not cfg.model.return_stages or any(s not in (1, 2, 3, 4) for s in cfg.model.return_stages):
        raise ConfigError(f"config key 'model.return_stages' takes stages from 1..4, got {cfg.model.return_stages}")
    n_levels = len(cfg.model.return_stages) + 1  # + the max-pool level
    if len(cfg.model.anchors.sizes) != n_levels:
        raise ConfigError(
            f"config key 'model.anchors.sizes' has {len(cfg.model.anchors.sizes)} levels but the FPN gives "
            f"{n_levels} (model.return_stages + 1 pooled level)"
        )
    for key in ("model.anchors.sizes", "model.anchors.aspect_ratios"):
        values = _get(cfg, key)
        flat = [v for level in values for v in level] if key.endswith("sizes") else list(values)
        if not flat or any(v <= 0 for v in flat):
            raise ConfigError(f"config key '{key}' needs positive values, got {values}")


def _check_recipe_keys(cfg: Config) -> None:
    """``validate_config``'s checks of the samplers, data, input and solver keys."""
    for key in ("rpn.positive_fraction", "roi_heads.positive_fraction"):
        if not 0.0 < _get(cfg, key) <= 1.0:
            raise ConfigError(f"config key '{key}' must be in (0, 1], got {_get(cfg, key)}")
    p = cfg.rpn.positive_weight
    if not (p == -1.0 or 0.0 < p < 1.0):
        raise ConfigError(f"config key 'rpn.positive_weight' must be -1 (uniform) or in (0, 1), got {p}")
    if cfg.data.num_workers > 0 and cfg.data.prefetch_factor < 1:
        raise ConfigError(
            f"config key 'data.prefetch_factor' must be >= 1 with data.num_workers={cfg.data.num_workers}, "
            f"got {cfg.data.prefetch_factor}"
        )
    if not cfg.input.min_size_train or any(s < 1 for s in cfg.input.min_size_train):
        raise ConfigError(f"config key 'input.min_size_train' needs at least one size >= 1, got {cfg.input.min_size_train}")
    if any(s < 1 for s in cfg.solver.steps):
        raise ConfigError(f"config key 'solver.steps' takes iterations >= 1, got {cfg.solver.steps}")
    if len(cfg.solver.betas) != 2 or not all(0 <= b < 1 for b in cfg.solver.betas):
        raise ConfigError(f"config key 'solver.betas' needs two values in [0, 1), got {cfg.solver.betas}")
    for i, rule in enumerate(cfg.solver.param_groups):
        if rule.lr_mult < 0 or rule.weight_decay_mult < 0:
            raise ConfigError(f"config key 'solver.param_groups[{i}]' needs lr_mult and weight_decay_mult >= 0")
    if cfg.data.label_space == "category_id" and cfg.data.format == "voc":
        raise ConfigError("config key 'data.label_space' is 'category_id', which needs COCO-format data "
                          "(data.format coco or shapes); VOC has no category ids: use contiguous")
    if len(set(cfg.data.class_names)) != len(cfg.data.class_names):
        dup = next(n for n in cfg.data.class_names if cfg.data.class_names.count(n) > 1)
        raise ConfigError(f"config key 'data.class_names' names {dup!r} twice")


def check_output_dir(path: str | os.PathLike, key: str = "train.output_dir") -> None:
    """Check that ``path`` can be the run folder: it, and the nearest of its parents that
    exists, must be folders we may write into. Nothing is created.

    Raises:
        ConfigError: one line naming ``key`` and the path that is in the way.
    """
    path = Path(path)
    probe = path
    while not probe.exists():
        if probe.is_symlink():
            raise ConfigError(f"config key '{key}': {probe} is a broken symbolic link")
        if probe.parent == probe:
            break
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        what = "is a file" if probe == path else f"cannot be created: {probe} is a file"
        raise ConfigError(f"config key '{key}': {path} {what}, not a folder")
    if probe.exists() and not os.access(probe, os.W_OK | os.X_OK):
        raise ConfigError(f"config key '{key}': {probe} is not writable")


@dataclass(frozen=True)
class AmpSettings:
    """What ``train.amp`` means on one device (``resolve_amp``): autocast ``enabled``
    with ``dtype``. float16 needs a GradScaler (it is refused on the CPU)."""

    enabled: bool = False
    dtype: torch.dtype = torch.float16

    @property
    def uses_scaler(self) -> bool:
        return self.enabled and self.dtype == torch.float16


def amp_dtype(amp: AMPConfig, device: torch.device | str) -> torch.dtype:
    """The autocast dtype of ``train.amp.dtype`` on ``device``: ``auto`` is bfloat16
    where the device supports it (``torch.cuda.is_bf16_supported()``; always on the CPU),
    else float16."""
    device = torch.device(device)
    if amp.dtype == "auto":
        bf16 = torch.cuda.is_bf16_supported() if device.type == "cuda" else device.type == "cpu"
        return torch.bfloat16 if bf16 else torch.float16
    return {"float16": torch.float16, "bfloat16": torch.bfloat16}[amp.dtype]


def resolve_amp(amp: AMPConfig, device: torch.device | str) -> AmpSettings:
    """Resolve ``train.amp`` for training on ``device``: ``enabled: auto`` is on for
    CUDA and off for anything else; the dtype as in ``amp_dtype``.

    Raises:
        ConfigError: float16 autocast asked for on a CPU device (many times slower than
            float32 there, and without loss scaling); one line, before the model is built.
    """
    device = torch.device(device)
    cuda = device.type == "cuda"
    enabled = cuda if amp.enabled is None else bool(amp.enabled)
    dtype = amp_dtype(amp, device)
    if enabled and dtype == torch.float16 and device.type == "cpu":
        raise ConfigError(
            "config key 'train.amp.enabled' is true with train.amp.dtype=float16 on a CPU device: float16 autocast "
            "is many times slower than float32 on the CPU and trains without loss scaling; use "
            "train.amp.enabled=auto (off on the CPU) or train.amp.dtype=bfloat16"
        )
    return AmpSettings(enabled=enabled, dtype=dtype)


# --------------------------------------------------------------------------- public


def default_config() -> Config:
    """The schema defaults."""
    return Config()


def load_config(path: Optional[str | os.PathLike] = None, overrides: Optional[List[str]] = None) -> Config:
    """Load a YAML config (with its ``base:`` chain) and apply ``key=value`` overrides.

    Args:
        path: a YAML file, or None for the schema defaults.
        overrides: e.g. ``["solver.lr=0.01", "model.backbone=resnet18"]``; values are
            parsed as YAML (``[1,2]`` is a list, ``true`` a bool).

    Raises:
        ConfigError: unknown key (with the nearest valid key), wrong type, bad YAML,
            a missing file or a ``base:`` cycle.
    """
    cfg = OmegaConf.structured(Config)
    schema = Config()
    if path is not None:
        for data, source in _read_yaml(Path(path)):
            _check_keys(data, schema, "", source)
            cfg = _merge(cfg, _auto_to_none(data), source)
    for item in overrides or []:
        key, value = _parse_override(item)
        nested = _nest(key, value)
        _check_keys(nested, schema, "", "override")
        cfg = _merge(cfg, _auto_to_none(nested), f"override '{item}'")
    try:
        out: Config = OmegaConf.to_object(cfg)  # type: ignore[assignment]
    except OmegaConfBaseException as exc:  # e.g. a missing mandatory value
        raise ConfigError(first_line(exc)) from None
    validate_config(out)
    return out


def config_to_dict(cfg: Config) -> dict:
    """The config as plain Python data (for checkpoints and JSON)."""
    return dataclasses.asdict(cfg)


def config_from_dict(data: dict) -> Config:
    """Rebuild a Config from ``config_to_dict`` output, checking keys and types."""
    _check_keys(data, Config(), "", "stored config")
    cfg = _merge(OmegaConf.structured(Config), _auto_to_none(copy.deepcopy(data)), "stored config")
    return OmegaConf.to_object(cfg)  # type: ignore[return-value]


def config_to_yaml(cfg: Config) -> str:
    """The config as YAML; the keys that take ``auto`` read ``auto`` where unresolved."""
    data = config_to_dict(cfg)
    for key in _AUTO_KEYS:
        *sections, leaf = key.split(".")
        node = data
        for part in sections:
            node = node[part]
        if node[leaf] is None:
            node[leaf] = "auto"
    return OmegaConf.to_yaml(OmegaConf.create(data))


def save_config(cfg: Config, path: str | os.PathLike) -> None:
    """Write the resolved config as YAML (loadable again by ``load_config``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(config_to_yaml(cfg))
