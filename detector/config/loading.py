"""YAML loading with ``base:`` inheritance, ``key=value`` overrides, and writing the
resolved config back.

Resolution order, last wins: schema defaults, the chain of ``base:`` files (the
deepest base first), the file itself, then the overrides in the order given. Each
mapping is checked for unknown keys before it is merged; OmegaConf checks the types
while merging (``OmegaConf.structured`` of the schema is strict).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from pathlib import Path
from typing import Any, List, Optional, Tuple

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from detector.files import no_file_message, write_text
from detector.messages import first_line

from .schema import Config
from .validation import ConfigError, auto_keys, check_keys, validate_config
from .value_types import check_value_shapes
from .yaml_reader import YAMLRefused, load_yaml


def _read_text(path: Path) -> str:
    """A config file's text: UTF-8 (with or without a byte-order mark), or UTF-16 / UTF-32
    as YAML allows, told apart by the byte-order mark or the zero bytes of the first
    characters (``json.detect_encoding``, as the annotation files are read).

    Raises:
        ConfigError: unreadable, or not text in the detected encoding (e.g. a binary file).
    """
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{path} cannot be read: {exc.strerror or exc}") from None
    encoding = json.detect_encoding(raw)
    try:
        return raw.decode(encoding)
    except UnicodeError as exc:
        raise ConfigError(f"{path} is not valid {encoding.removesuffix('-sig')} text ({exc.reason} at byte "
                          f"{exc.start}); a config is YAML text") from None


def _read_yaml(path: Path, seen: Tuple[Path, ...] = ()) -> List[Tuple[dict, str]]:
    """Return the chain of YAML mappings to merge, the deepest ``base:`` first."""
    try:
        path = path.resolve()
    except (RuntimeError, OSError):  # a loop of links (RuntimeError before Python 3.13)
        raise ConfigError(f"config file {path} is a link to nothing (or a loop of links)") from None
    if path in seen:
        chain = " -> ".join(str(p) for p in (*seen, path))
        raise ConfigError(f"config 'base:' chain has a cycle: {chain}")
    if not path.is_file():
        raise ConfigError(no_file_message("config file", path))
    try:
        data = load_yaml(_read_text(path))
    except YAMLRefused as exc:
        raise ConfigError(f"{path}: {exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}".replace("\n", " ")) from None
    if data is None:  # more likely a file that failed to save than a wish for every default
        raise ConfigError(f"{path}: the config file holds no settings (empty, or comments only); "
                          "write {} in it to train with every default")
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    base = data.pop("base", None)
    if base is not None and not isinstance(base, str):
        raise ConfigError(f"{path}: 'base:' names one config file (a string, relative to this file), "
                          f"got {type(base).__name__} {_short(base)}")
    if base is not None and not base.strip():  # ('' meant the schema's R50 COCO 90k-iteration defaults, silently)
        raise ConfigError(f"{path}: 'base:' is empty: name a config file, or leave the key out")
    chain: List[Tuple[dict, str]] = []
    if base:
        base_path = Path(base)
        if not base_path.is_absolute():
            base_path = path.parent / base_path
        chain.extend(_read_yaml(base_path, (*seen, path)))
    chain.append((data, str(path)))
    return chain


def _auto_to_none(data: dict) -> dict:
    """``data`` with ``auto`` replaced by None at the keys that take it (in place)."""
    for key in auto_keys():
        *sections, leaf = key.split(".")
        node: Any = data
        for part in sections:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and isinstance(node.get(leaf), str) and node[leaf].strip().lower() == "auto":
            node[leaf] = None
    return data


def _parse_override(item: str) -> Tuple[str, Any]:
    """``"a.b=value"`` -> ``("a.b", value)``, the value parsed as YAML."""
    if "=" not in item:
        raise ConfigError(f"override '{item}' is not of the form key=value")
    key, _, raw = item.partition("=")
    key = key.strip()
    try:
        value = load_yaml(raw) if raw.strip() != "" else ""
    except YAMLRefused as exc:
        raise ConfigError(f"override '{_cut(item)}': the value {exc}") from None
    except yaml.YAMLError:
        value = raw
    return key, value


def _cut(text: str, limit: int = 80) -> str:
    """``text`` cut to ``limit`` characters for a one-line message."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _short(value: Any) -> str:
    """``repr(value)`` cut for a one-line message."""
    return _cut(repr(value))


def _nest(key: str, value: Any) -> dict:
    """``("a.b", v)`` -> ``{"a": {"b": v}}``."""
    out: Any = value
    for part in reversed(key.split(".")):
        out = {part: out}
    return out


@functools.lru_cache(maxsize=1)
def _schema() -> DictConfig:
    """The schema's defaults as an OmegaConf node, built once per process (about 60 ms):
    every load merges into a copy of it (``OmegaConf.merge`` copies its first argument
    and changes none)."""
    return OmegaConf.structured(Config)


def _checked_shapes(data: dict, source: str) -> dict:
    """``data``, once its values have the schema's shapes (one-line ConfigError)."""
    check_value_shapes(data, Config, source)
    return data


def _merge_all(sources: List[Tuple[dict, str]]) -> DictConfig:
    """The schema merged with every source in order, in one ``OmegaConf.merge`` (one copy
    of the schema instead of one per source); on a bad value, the source that has it is
    named (:func:`_merge_one_by_one`)."""
    try:
        return OmegaConf.merge(_schema(), *(data for data, _ in sources))
    except OmegaConfBaseException:
        return _merge_one_by_one(sources)


def _merge_one_by_one(sources: List[Tuple[dict, str]]) -> DictConfig:
    """The schema merged with each source in turn: OmegaConf's typed merge; a value of the
    wrong type or shape is a one-line ConfigError naming its source."""
    cfg = _schema()
    for data, source in sources:
        try:
            cfg = OmegaConf.merge(cfg, data)
        except OmegaConfBaseException as exc:
            key = getattr(exc, "full_key", None) or "?"
            raise ConfigError(f"{source}: bad value for config key '{key}': {first_line(exc)}") from None
    return cfg


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
            a missing file, a ``base:`` cycle, or a value out of its range.
    """
    sources: List[Tuple[dict, str]] = []  # (mapping, where it comes from), in merge order
    try:
        if path is not None:
            for data, source in _read_yaml(Path(path)):
                check_keys(data, source)
                sources.append((_checked_shapes(_auto_to_none(data), source), source))
        for item in overrides or []:
            key, value = _parse_override(item)
            nested = _nest(key, value)
            check_keys(nested, "override")
            source = f"override '{item}'"
            sources.append((_checked_shapes(_auto_to_none(nested), source), source))
    except ConfigError:
        _merge_one_by_one(sources)  # a bad value in an earlier source is reported first, as it comes first
        raise
    cfg = _merge_all(sources)
    try:
        out: Config = OmegaConf.to_object(cfg)  # type: ignore[assignment]
    except OmegaConfBaseException as exc:  # e.g. an interpolation (${oc.env:VAR}, ${other.key}) that fails
        key = getattr(exc, "full_key", None)
        where = f"config key '{key}': " if key else ""
        hint = " (a literal '${' is written '\\${')" if "interpolation" in str(exc).lower() else ""
        raise ConfigError(f"{where}{first_line(exc)}{hint}") from None
    _expand_home(out)
    validate_config(out)
    return out


def _expand_home(cfg: Any) -> None:
    """A leading ``~`` (or ``~user``) of a path key (``field_(path=True)``) becomes the
    home folder, in place: a YAML file is no shell, nor is ``key=~/x`` on a command line
    (a shell expands ``~`` at the start of a word only)."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            _expand_home(value)
        elif isinstance(value, list):
            for item in value:
                if dataclasses.is_dataclass(item):
                    _expand_home(item)
        elif f.metadata.get("path") and isinstance(value, str) and value.startswith("~"):
            setattr(cfg, f.name, os.path.expanduser(value))


def config_to_dict(cfg: Config) -> dict:
    """The config as plain Python data (for checkpoints and JSON)."""
    return dataclasses.asdict(cfg)


def _literal(data: Any) -> Any:
    """Resolved values as OmegaConf must read them back: ``${`` in a string escaped, so a
    value that holds it literally (resolved from a backslash before it) is not interpolated again."""
    if isinstance(data, dict):
        return {k: _literal(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_literal(v) for v in data]
    return data.replace("${", "\\${") if isinstance(data, str) else data


def config_from_dict(data: dict) -> Config:
    """Rebuild a Config from ``config_to_dict`` output, checking keys and types."""
    check_keys(data, "stored config")
    cfg = _merge_one_by_one([(_checked_shapes(_auto_to_none(_literal(data)), "stored config"), "stored config")])
    return OmegaConf.to_object(cfg)  # type: ignore[return-value]


def config_to_yaml(cfg: Config) -> str:
    """The config as YAML; the keys that take ``auto`` read ``auto`` where unresolved."""
    data = config_to_dict(cfg)
    for key in auto_keys():
        *sections, leaf = key.split(".")
        node = data
        for part in sections:
            node = node[part]
        if node[leaf] is None:
            node[leaf] = "auto"
    return OmegaConf.to_yaml(OmegaConf.create(_literal(data)))


def save_config(cfg: Config, path: str | os.PathLike) -> None:
    """Write the resolved config as YAML (loadable again by ``load_config``)."""
    write_text(path, config_to_yaml(cfg))
