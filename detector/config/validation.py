"""Checks of a config against the schema, each failure one line naming the key.

In the order they run:

1. keys (``check_keys``, on every YAML mapping and override before it is merged):
   an unknown key names the nearest valid one;
2. types: OmegaConf checks each value against the field's type while merging
   (``detector.config.loading``);
3. values (``validate_config``, on the merged config): every float finite, then the
   ``choices`` and the bounds that ``detector.config.schema`` keeps next to each field,
   then the rules that look inside lists or tie keys together.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import typing
from typing import Any, Dict, Iterator, List, Mapping, Optional, Tuple

from detector.messages import DetectorError

from .schema import MAX_IMAGE_SIDE, Config


class ConfigError(DetectorError, ValueError):
    """A config file or override that does not fit the schema."""


# --------------------------------------------------------------------------- keys


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


@functools.lru_cache(maxsize=None)
def _type_hints(section_type: type) -> Dict[str, Any]:
    return typing.get_type_hints(section_type)


def _is_list(section: Any, name: str) -> bool:
    """Whether the key ``section.name`` takes a list."""
    return typing.get_origin(_type_hints(type(section)).get(name)) in (list, List)


def _list_item_schema(section: Any, name: str) -> Optional[type]:
    """The dataclass of the items of ``section.name`` when that key is a list of
    sections (``solver.param_groups``), else None."""
    args = typing.get_args(_type_hints(type(section)).get(name)) if _is_list(section, name) else ()
    return args[0] if args and dataclasses.is_dataclass(args[0]) else None


# Names other frameworks give to keys of this schema (the last key component).
_KEY_ALIASES = {
    "base_lr": "lr", "learning_rate": "lr", "max_iters": "max_iter", "max_epochs": "max_iter",
    "ims_per_batch": "images_per_gpu", "batch_size": "images_per_gpu", "samples_per_gpu": "images_per_gpu",
    "warmup_iter": "warmup_iters", "lr_steps": "steps", "milestones": "steps",
}


def _nearest_key(key: str, valid: List[str]) -> Optional[str]:
    """The valid key nearest to ``key``, comparing the last component within its section
    first: a known alias (``base_lr`` -> ``lr``), a sibling that is one of its ``_`` parts,
    then the closest spelling; else the closest full key; None when nothing is close."""
    section, _, leaf = key.rpartition(".")
    siblings = [k.rpartition(".")[2] for k in valid if k.rpartition(".")[0] == section]
    parts = [p for p in leaf.split("_") if p in siblings]
    candidates = ([_KEY_ALIASES[leaf]] if _KEY_ALIASES.get(leaf) in siblings else []) \
        + sorted(parts, key=len, reverse=True) + difflib.get_close_matches(leaf, siblings, n=1, cutoff=0.6)
    if candidates:
        return f"{section}.{candidates[0]}" if section else candidates[0]
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
    if close:
        return close[0]
    near = difflib.get_close_matches(leaf, siblings, n=1, cutoff=0.5)
    return (f"{section}.{near[0]}" if section else near[0]) if near else None


def _unknown_key_error(key: str, schema: Any = None, prefix: str = "") -> ConfigError:
    """An error naming ``key`` and the nearest valid key (``schema`` is the section that
    lacks it, ``prefix`` that section's dotted name)."""
    valid = _valid_keys(Config())
    if schema is not None and prefix.endswith("]."):  # an item of a list of sections
        valid = [prefix + k for k in _valid_keys(schema)]
    close = _nearest_key(key, valid)
    hint = f" (did you mean '{close}'?)" if close else ""
    return ConfigError(f"unknown config key '{key}'{hint}")


def check_keys(data: Any, source: str, schema: Any = None, prefix: str = "") -> None:
    """Raise ConfigError for the first key of the mapping ``data`` that the schema lacks
    (``schema``: the section ``data`` fills, by default the whole ``Config``; ``source``:
    the file or override, named first in the message)."""
    if not isinstance(data, dict):
        return
    schema = Config() if schema is None else schema
    names = {f.name for f in dataclasses.fields(schema)}
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if key not in names:
            raise ConfigError(f"{source}: {_unknown_key_error(dotted, schema, prefix)}")
        sub = getattr(schema, key)
        item = _list_item_schema(schema, key)
        if dataclasses.is_dataclass(sub):
            if value is not None and not isinstance(value, dict):
                raise ConfigError(f"{source}: config key '{dotted}' is a section; got {value!r}")
            check_keys(value, source, sub, dotted + ".")
        elif item is not None and isinstance(value, (list, dict)):
            example = ", ".join(f"{f.name}: ..." for f in dataclasses.fields(item)[:2])
            if isinstance(value, dict):
                raise ConfigError(f"{source}: config key '{dotted}' takes a list of mappings like [{{{example}}}]; "
                                  f"got {value!r}")
            for i, rule in enumerate(value):
                if not isinstance(rule, dict):
                    raise ConfigError(f"{source}: '{dotted}[{i}]' must be a mapping like {{{example}}}")
                check_keys(rule, source, item(), f"{dotted}[{i}].")
        elif _is_list(schema, key) and (isinstance(value, dict) or (
                isinstance(value, list) and any(isinstance(v, dict) for v in value))):
            raise ConfigError(f"{source}: config key '{dotted}' takes a list of values, not mappings; got {value!r}")


def auto_keys(schema: Any = None, prefix: str = "") -> List[str]:
    """The dotted keys that take ``auto`` (stored as None), from the schema's metadata."""
    schema = Config() if schema is None else schema
    keys = []
    for f in dataclasses.fields(schema):
        value = getattr(schema, f.name)
        if dataclasses.is_dataclass(value):
            keys.extend(auto_keys(value, f"{prefix}{f.name}."))
        elif f.metadata.get("auto"):
            keys.append(f"{prefix}{f.name}")
    return keys


# --------------------------------------------------------------------------- values


def _fields(cfg: Any, prefix: str = "") -> Iterator[Tuple[str, Any, Mapping[str, Any]]]:
    """``(dotted key, value, field metadata)`` of every leaf key, in schema order."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            yield from _fields(value, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", value, f.metadata


def range_text(meta: Mapping[str, Any], integer: bool = False) -> str:
    """The bounds of a field's metadata in words: ``>= 1``, ``in (0, 1]``, ``in 0..5``
    (both ends of an integer range), then the note. "" for a key without bounds."""
    lower = ("[", meta["ge"]) if meta.get("ge") is not None else ("(", meta["gt"]) if meta.get("gt") is not None else None
    upper = (meta["le"], "]") if meta.get("le") is not None else (meta["lt"], ")") if meta.get("lt") is not None else None
    if lower and upper:
        closed = lower[0] == "[" and upper[1] == "]"
        text = f"in {lower[1]}..{upper[0]}" if integer and closed else f"in {lower[0]}{lower[1]}, {upper[0]}{upper[1]}"
    elif lower:
        text = f"{'>=' if lower[0] == '[' else '>'} {lower[1]}"
    elif upper:
        text = f"{'<=' if upper[1] == ']' else '<'} {upper[0]}"
    else:
        return ""
    return f"{text} {meta['note']}" if meta.get("note") else text


def _in_range(value: float, meta: Mapping[str, Any]) -> bool:
    ge, gt, le, lt = (meta.get(k) for k in ("ge", "gt", "le", "lt"))
    return ((ge is None or value >= ge) and (gt is None or value > gt)
            and (le is None or value <= le) and (lt is None or value < lt))


# Every integer key feeds a 64-bit integer somewhere (a tensor, a sampler, numpy).
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def _check_finite(value: Any, key: str) -> None:
    """Raise ConfigError for the first NaN or infinite float, or list item that is an
    integer outside int64, in ``value`` (a config section, a list or a number); ``key``
    is its dotted name. (An integer key is held to int64 with its bounds: ``_int_bounds``.)"""
    if dataclasses.is_dataclass(value):
        for f in dataclasses.fields(value):
            _check_finite(getattr(value, f.name), f"{key}.{f.name}" if key else f.name)
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _check_finite(item, f"{key}[{i}]")
    elif isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"config key '{key}' is {value}; it must be a finite number")
    elif type(value) is int and key.endswith("]") and not INT64_MIN <= value <= INT64_MAX:
        raise ConfigError(f"config key '{key}' is {value}, which does not fit in a 64-bit integer "
                          f"(in {INT64_MIN}..{INT64_MAX})")


def _int_bounds(meta: Mapping[str, Any]) -> Mapping[str, Any]:
    """An integer key's bounds: the schema's, with int64's where the schema has none."""
    out = dict(meta)
    if out.get("ge") is None and out.get("gt") is None:
        out["ge"] = INT64_MIN
    if out.get("le") is None and out.get("lt") is None:
        out["le"] = INT64_MAX
    return out


def validate_config(cfg: Config) -> None:
    """Check values the type system cannot: every float finite, choices, ranges,
    consistent lengths. The first problem raises a one-line ``ConfigError`` naming the key."""
    _check_finite(cfg, "")
    leaves = list(_fields(cfg))
    for key, value, meta in leaves:
        choices = meta.get("choices")
        if choices and value not in choices:
            raise ConfigError(f"config key '{key}' is {value!r}; expected one of {', '.join(choices)}")
    for key, value, meta in leaves:
        meta = _int_bounds(meta) if type(value) is int else meta
        what = range_text(meta, integer=type(value) is int)
        if what and value is not None and not _in_range(value, meta):
            raise ConfigError(f"config key '{key}' must be {what}, got {value}")
    _check_model_keys(cfg)
    _check_recipe_keys(cfg)
    _check_schedule_keys(cfg)
    _check_train_keys(cfg)


# --------------------------------------------------------------------------- rules


def _check_canvas_keys(cfg: Config) -> None:
    """``model.canvas_sizes`` (distinct [height, width] multiples of the divisibility) and
    the keys that need them (``train.compile_backbone``, ``train.static_step``, and
    ``train.cuda_graphs`` on the static step; ``eval.static`` and its ``eval.cuda_graphs``)."""
    model = cfg.model
    d = model.size_divisibility
    for k, canvas in enumerate(model.canvas_sizes):
        if len(canvas) != 2 or any(v <= 0 or v % d for v in canvas):
            raise ConfigError(
                f"config key 'model.canvas_sizes' takes [height, width] pairs that are positive multiples of "
                f"model.size_divisibility ({d}), got {canvas}"
            )
        if list(canvas) in [list(c) for c in model.canvas_sizes[:k]]:  # a second compile and graph of one shape
            raise ConfigError(f"config key 'model.canvas_sizes' names {list(canvas)} twice")
    if cfg.train.compile_backbone and not model.canvas_sizes:
        raise ConfigError(
            "config key 'train.compile_backbone' needs 'model.canvas_sizes' (fixed batch shapes): without them every "
            "new batch size recompiles, measured slower than eager on the CPU and on an H100 (docs/performance.md)"
        )
    if cfg.train.static_step and not model.canvas_sizes:
        raise ConfigError("config key 'train.static_step' needs 'model.canvas_sizes' (the static step's batch shapes)")
    if cfg.train.cuda_graphs and not cfg.train.static_step:
        raise ConfigError("config key 'train.cuda_graphs' needs 'train.static_step: true'")
    if cfg.eval.static and not model.canvas_sizes:
        raise ConfigError("config key 'eval.static' needs 'model.canvas_sizes' (the batch shapes of its inference)")
    if cfg.eval.cuda_graphs and not cfg.eval.static:
        raise ConfigError("config key 'eval.cuda_graphs' needs 'eval.static: true'")
    if cfg.eval.static and cfg.roi_heads.nms.type != "hard":
        raise ConfigError("config key 'eval.static' runs greedy NMS: it cannot be combined with roi_heads.nms.type="
                          f"{cfg.roi_heads.nms.type}")
    if cfg.eval.static and cfg.eval.tta.sizes:
        raise ConfigError("config key 'eval.static' cannot be true with eval.tta.sizes: TTA runs images at sizes the "
                          "canvases do not fix")


def _check_model_keys(cfg: Config) -> None:
    """``validate_config``'s rules for ``model.*`` lists (the canvases and the keys that
    need them: ``_check_canvas_keys``)."""
    model = cfg.model
    if len(model.pixel_mean) != 3 or len(model.pixel_std) != 3:
        raise ConfigError("config keys 'model.pixel_mean' and 'model.pixel_std' need 3 values (RGB)")
    if any(s <= 0 for s in model.pixel_std):
        raise ConfigError(f"config key 'model.pixel_std' must be positive, got {model.pixel_std}")
    _check_canvas_keys(cfg)
    if model.norm == "gn":  # GroupNorm(min(groups, c), c) needs c divisible by its groups
        widths = [64, 128, 256, 512] + ([1024, 2048] if model.backbone in ("resnet50", "resnet101") else [])
        bad = sorted({c for c in (*widths, model.fpn_channels) if c % min(model.gn_groups, c)})
        if bad:
            raise ConfigError(f"config key 'model.gn_groups' ({model.gn_groups}) must divide the channels it "
                              f"normalises ({model.backbone} and model.fpn_channels={model.fpn_channels}); it does "
                              f"not divide {bad}")
    if not model.return_stages or any(s not in (1, 2, 3, 4) for s in model.return_stages):
        raise ConfigError(f"config key 'model.return_stages' takes stages from 1..4, got {model.return_stages}")
    n_levels = len(model.return_stages) + 1  # + the max-pool level
    if len(model.anchors.sizes) != n_levels:
        raise ConfigError(
            f"config key 'model.anchors.sizes' has {len(model.anchors.sizes)} levels but the FPN gives "
            f"{n_levels} (model.return_stages + 1 pooled level)"
        )
    anchors: Dict[str, Any] = {"model.anchors.sizes": model.anchors.sizes,
                               "model.anchors.aspect_ratios": model.anchors.aspect_ratios}
    for key, values in anchors.items():
        flat = [v for level in values for v in level] if key.endswith("sizes") else list(values)
        if not flat or any(v <= 0 for v in flat):
            raise ConfigError(f"config key '{key}' needs positive values, got {values}")
    per_level = {len(level) for level in model.anchors.sizes}
    if len(per_level) > 1 or 0 in per_level:  # the RPN head predicts one count of anchors at every location
        raise ConfigError(f"config key 'model.anchors.sizes' needs the same number of sizes (>= 1) at every level: "
                          f"the RPN head shares its convolutions across levels; got {model.anchors.sizes}")
    if any(not 1e-3 <= r <= 1e3 for r in model.anchors.aspect_ratios):  # 1e12: anchors of NaN size
        raise ConfigError(f"config key 'model.anchors.aspect_ratios' takes height / width ratios in 0.001..1000, "
                          f"got {model.anchors.aspect_ratios}")
    if model.norm in ("bn", "syncbn") and model.norm_eps <= 0:
        raise ConfigError(f"config key 'model.norm_eps' must be > 0 with model.norm={model.norm} (BatchNorm trains "
                          f"with it), got {model.norm_eps}; 0 suits only frozen_bn with torchvision's COCO weights")
    for key in ("rpn", "roi_heads"):
        weights = getattr(cfg, key).box_coder_weights
        if len(weights) != 4 or not all(w > 0 for w in weights):
            raise ConfigError(f"config key '{key}.box_coder_weights' takes 4 positive numbers (wx, wy, ww, wh), "
                              f"got {weights}")


def _check_sampler_thresholds(cfg: Config) -> None:
    """Every IoU matcher keeps a background range: RPN negatives are IoU < ``bg_iou_thresh``
    (0: none), RoI negatives ``bg_iou_lo <= IoU < bg_iou_hi`` (empty when ``lo >= hi``),
    and background sits below the foreground threshold. A run without negatives trained
    on positives only, exit 0."""
    rpn, roi = cfg.rpn, cfg.roi_heads
    if not 0 < rpn.bg_iou_thresh <= rpn.fg_iou_thresh:
        raise ConfigError(f"config key 'rpn.bg_iou_thresh' must be in (0, rpn.fg_iou_thresh={rpn.fg_iou_thresh:g}], "
                          f"got {rpn.bg_iou_thresh:g}: anchors below it are the RPN's background")
    if not roi.bg_iou_lo < roi.bg_iou_hi <= roi.fg_iou_thresh:
        raise ConfigError(f"config keys 'roi_heads.bg_iou_lo' ({roi.bg_iou_lo:g}) < 'roi_heads.bg_iou_hi' "
                          f"({roi.bg_iou_hi:g}) <= 'roi_heads.fg_iou_thresh' ({roi.fg_iou_thresh:g}) must hold: "
                          "proposals in [bg_iou_lo, bg_iou_hi) are the box head's background")


def _check_recipe_keys(cfg: Config) -> None:
    """``validate_config``'s rules for the sampler, data, input and solver keys."""
    _check_sampler_thresholds(cfg)
    p = cfg.rpn.positive_weight
    if not (p == -1.0 or 0.0 < p < 1.0):
        raise ConfigError(f"config key 'rpn.positive_weight' must be -1 (uniform) or in (0, 1), got {p}")
    if cfg.data.num_workers > 0 and cfg.data.prefetch_factor < 1:
        raise ConfigError(
            f"config key 'data.prefetch_factor' must be >= 1 with data.num_workers={cfg.data.num_workers}, "
            f"got {cfg.data.prefetch_factor}"
        )
    if not cfg.input.min_size_train or any(not 1 <= s <= MAX_IMAGE_SIDE for s in cfg.input.min_size_train):
        raise ConfigError(f"config key 'input.min_size_train' needs at least one size, each in 1..{MAX_IMAGE_SIDE} "
                          f"(pixels), got {cfg.input.min_size_train}")
    _check_input_sizes(cfg)
    lsj = cfg.input.lsj
    if lsj.min_scale > lsj.max_scale:
        raise ConfigError(f"config key 'input.lsj.min_scale' ({lsj.min_scale}) must be <= input.lsj.max_scale "
                          f"({lsj.max_scale})")
    if any(s < 1 for s in cfg.eval.tta.sizes):
        raise ConfigError(f"config key 'eval.tta.sizes' takes shorter-side sizes >= 1 ([] = off), got {cfg.eval.tta.sizes}")
    if cfg.eval.tta.flip and not cfg.eval.tta.sizes:  # (flip alone was dropped without a word)
        raise ConfigError(f"config key 'eval.tta.flip' needs eval.tta.sizes (e.g. [{cfg.input.min_size_test}]: the "
                          "test size, flipped and not); TTA is off while eval.tta.sizes is empty")
    if cfg.eval.tta.sizes and cfg.eval.compute_val_loss:
        raise ConfigError("config key 'eval.compute_val_loss' cannot be true with eval.tta.sizes: with TTA the "
                          "evaluation reads images at their original size, the validation loss needs them at "
                          "input.min_size_test; turn one of them off")
    if any(s < 1 for s in cfg.solver.steps):
        raise ConfigError(f"config key 'solver.steps' takes iterations >= 1, got {cfg.solver.steps}")
    _check_in_order("solver.steps", cfg.solver.steps)
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
    if cfg.data.train_extra and cfg.data.format == "shapes":  # each root would be (re)generated by data.shapes
        raise ConfigError("config key 'data.train_extra' joins coco or voc training sets; the shapes set is one "
                          "generated set: data.shapes.num_train sets its size")


def _check_input_sizes(cfg: Config) -> None:
    """A shorter-side size above its longer-side cap has no effect (the cap decides every
    image's scale): a swapped pair, or a multi-scale list that silently collapses."""
    inp = cfg.input
    rules = [("input.min_size_test", [inp.min_size_test], "input.max_size_test", inp.max_size_test),
             ("eval.tta.sizes", list(cfg.eval.tta.sizes), "input.max_size_test", inp.max_size_test)]
    if not inp.lsj.enabled:  # (large-scale jitter does not read min_size_train)
        rules.insert(0, ("input.min_size_train", list(inp.min_size_train), "input.max_size_train", inp.max_size_train))
    for key, sizes, cap_key, cap in rules:
        above = [s for s in sizes if s > cap]
        if above:
            only = f"[{cap}]" if key != "input.min_size_test" else str(cap)
            raise ConfigError(
                f"config key '{key}' has shorter-side sizes above {cap_key}={cap} ({above}): the longer side's "
                f"cap decides the scale of every image, so they act as {cap}; lower them or raise {cap_key} "
                f"(to cap the longer side only, set {key}={only})")


def _check_schedule_keys(cfg: Config) -> None:
    """Iterations or epochs, not both: ``solver.max_epochs`` needs ``solver.max_iter=0``,
    unless the trainer converted it already (``solver.iters_per_epoch`` set, as in a run's
    ``config.yaml``)."""
    s = cfg.solver
    if s.max_epochs > 0 and s.max_iter > 0 and s.iters_per_epoch == 0:
        raise ConfigError(f"config keys 'solver.max_epochs' ({s.max_epochs}) and 'solver.max_iter' ({s.max_iter}) "
                          "are both set: train by epochs with solver.max_iter=0, or by iterations with solver.max_epochs=0")
    if s.max_epochs == 0 and s.max_iter == 0:
        raise ConfigError("config key 'solver.max_iter' is 0: set it (iterations) or solver.max_epochs (epochs)")
    if s.steps_epochs and s.max_epochs == 0:
        raise ConfigError(f"config key 'solver.steps_epochs' ({s.steps_epochs}) needs solver.max_epochs "
                          "(with solver.max_iter=0); in iterations use solver.steps")
    if any(e < 1 for e in s.steps_epochs):
        raise ConfigError(f"config key 'solver.steps_epochs' takes epochs >= 1, got {s.steps_epochs}")
    _check_in_order("solver.steps_epochs", s.steps_epochs)


def _check_in_order(key: str, values: List[int]) -> None:
    """LR steps in order, as detectron2 and mmdetection take them: ``[80, 60]`` is more
    likely a typo (``[800, 600]``?) than a schedule, so it is not sorted silently."""
    for a, b in zip(values, values[1:]):
        if b < a:
            raise ConfigError(f"config key '{key}' takes values in order (each at least the one before), "
                              f"got {list(values)} ({b} after {a})")


def _check_train_keys(cfg: Config) -> None:
    """Early stopping counts periodic evaluations."""
    if cfg.train.early_stop.patience > 0 and cfg.train.eval_period <= 0:
        raise ConfigError(f"config key 'train.early_stop.patience' ({cfg.train.early_stop.patience}) needs periodic "
                          f"evaluation: set train.eval_period > 0 (got {cfg.train.eval_period})")
