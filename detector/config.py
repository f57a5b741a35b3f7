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

import dataclasses
import difflib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List, Optional

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException


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
    # torchvision's COCO model: 90 (91 outputs).
    num_classes: int = 3
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
    # VOC class names, in label order 1..K. COCO and shapes read them from the JSON.
    class_names: List[str] = field(default_factory=list)
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
    enabled: bool = False
    dtype: str = "float16"  # float16 | bfloat16


@dataclass
class TrainConfig:
    output_dir: str = "runs/default"
    device: str = "auto"  # auto | cpu | cuda | cuda:N
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


@dataclass
class EvalConfig:
    backend: str = "pycocotools"  # pycocotools | faster
    images_per_gpu: int = 1
    voc_iou_thresh: float = 0.5
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
        msg = str(exc).splitlines()[0]
        raise ConfigError(f"{source}: bad value for config key '{key}': {msg}") from None


_CHOICES = {
    "model.backbone": ("resnet18", "resnet34", "resnet50", "resnet101"),
    "model.norm": ("frozen_bn", "bn", "syncbn", "gn"),
    "data.format": ("coco", "voc", "shapes"),
    "solver.optimizer": ("sgd", "adamw"),
    "solver.schedule": ("multistep", "cosine"),
    "train.amp.dtype": ("float16", "bfloat16"),
    "eval.backend": ("pycocotools", "faster"),
}


def _get(cfg: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


def validate_config(cfg: Config) -> None:
    """Check values the type system cannot: choices, ranges, consistent lengths."""
    for key, choices in _CHOICES.items():
        value = _get(cfg, key)
        if value not in choices:
            raise ConfigError(f"config key '{key}' is {value!r}; expected one of {', '.join(choices)}")
    if cfg.model.num_classes < 1:
        raise ConfigError(f"config key 'model.num_classes' must be >= 1 (classes without background), got {cfg.model.num_classes}")
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
    if not cfg.model.return_stages or any(s not in (1, 2, 3, 4) for s in cfg.model.return_stages):
        raise ConfigError(f"config key 'model.return_stages' takes stages from 1..4, got {cfg.model.return_stages}")
    n_levels = len(cfg.model.return_stages) + 1  # + the max-pool level
    if len(cfg.model.anchors.sizes) != n_levels:
        raise ConfigError(
            f"config key 'model.anchors.sizes' has {len(cfg.model.anchors.sizes)} levels but the FPN gives "
            f"{n_levels} (model.return_stages + 1 pooled level)"
        )
    for key in ("rpn.positive_fraction", "roi_heads.positive_fraction"):
        if not 0.0 < _get(cfg, key) <= 1.0:
            raise ConfigError(f"config key '{key}' must be in (0, 1], got {_get(cfg, key)}")
    p = cfg.rpn.positive_weight
    if not (p == -1.0 or 0.0 < p < 1.0):
        raise ConfigError(f"config key 'rpn.positive_weight' must be -1 (uniform) or in (0, 1), got {p}")
    if cfg.solver.lr <= 0:
        raise ConfigError(f"config key 'solver.lr' must be positive, got {cfg.solver.lr}")
    if cfg.solver.images_per_gpu < 1:
        raise ConfigError(f"config key 'solver.images_per_gpu' must be >= 1, got {cfg.solver.images_per_gpu}")
    if not cfg.input.min_size_train:
        raise ConfigError("config key 'input.min_size_train' needs at least one size")


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
            cfg = _merge(cfg, data, source)
    for item in overrides or []:
        key, value = _parse_override(item)
        nested = _nest(key, value)
        _check_keys(nested, schema, "", "override")
        cfg = _merge(cfg, nested, f"override '{item}'")
    try:
        out: Config = OmegaConf.to_object(cfg)  # type: ignore[assignment]
    except OmegaConfBaseException as exc:  # e.g. a missing mandatory value
        raise ConfigError(str(exc).splitlines()[0]) from None
    validate_config(out)
    return out


def config_to_dict(cfg: Config) -> dict:
    """The config as plain Python data (for checkpoints and JSON)."""
    return dataclasses.asdict(cfg)


def config_from_dict(data: dict) -> Config:
    """Rebuild a Config from ``config_to_dict`` output, checking keys and types."""
    _check_keys(data, Config(), "", "stored config")
    cfg = _merge(OmegaConf.structured(Config), data, "stored config")
    return OmegaConf.to_object(cfg)  # type: ignore[return-value]


def config_to_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def save_config(cfg: Config, path: str | os.PathLike) -> None:
    """Write the resolved config as YAML (loadable again by ``load_config``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(config_to_yaml(cfg))
