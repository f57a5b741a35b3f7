"""Config loading: unknown keys, wrong types, ``base:`` inheritance, overrides, round trips."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch

from detector.config import (
    Config,
    ConfigError,
    config_from_dict,
    config_to_dict,
    load_config,
    save_config,
)

from conftest import ROOT, TINY_CONFIG  # noqa: E402


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_unknown_override_names_key_and_suggests():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["solver.lrr=0.1"])
    msg = str(e.value)
    assert "'solver.lrr'" in msg and "did you mean 'solver.lr'" in msg
    assert "\n" not in msg


def test_unknown_key_in_yaml_names_file_and_key(tmp_path):
    f = _write(tmp_path / "c.yaml", "solver:\n  max_iters: 10\n")
    with pytest.raises(ConfigError) as e:
        load_config(f)
    msg = str(e.value)
    assert str(f) in msg and "'solver.max_iters'" in msg and "'solver.max_iter'" in msg


def test_unknown_section_and_param_group_key(tmp_path):
    with pytest.raises(ConfigError, match=r"'sovler'.*did you mean 'solver'"):
        load_config(None, ["sovler.lr=0.1"])
    f = _write(tmp_path / "c.yaml", "solver:\n  param_groups:\n    - {match: backbone, lr_mul: 0.1}\n")
    with pytest.raises(ConfigError, match=r"solver\.param_groups\[0\]\.lr_mul.*lr_mult"):
        load_config(f)


def test_string_for_float_names_key(tmp_path):
    with pytest.raises(ConfigError, match=r"solver\.lr"):
        load_config(None, ["solver.lr=fast"])
    f = _write(tmp_path / "c.yaml", "solver:\n  max_iter: many\n")
    with pytest.raises(ConfigError) as e:
        load_config(f)
    assert "solver.max_iter" in str(e.value) and str(f) in str(e.value)


def test_override_without_equals_is_an_error():
    with pytest.raises(ConfigError, match="key=value"):
        load_config(None, ["solver.lr"])


def test_base_chain_and_override_order(tmp_path):
    (tmp_path / "sub").mkdir()
    _write(tmp_path / "a.yaml", "solver:\n  lr: 0.1\n  max_iter: 100\n  steps: [50]\nmodel:\n  backbone: resnet34\n")
    _write(tmp_path / "sub" / "b.yaml", "base: ../a.yaml\nsolver:\n  lr: 0.2\n  warmup_iters: 7\n")
    c = _write(tmp_path / "c.yaml", "base: sub/b.yaml\nsolver:\n  max_iter: 300\n")
    cfg = load_config(c)
    assert cfg.solver.lr == 0.2  # b over a
    assert cfg.solver.max_iter == 300  # c over a
    assert cfg.solver.warmup_iters == 7 and cfg.solver.steps == [50] and cfg.model.backbone == "resnet34"
    assert cfg.solver.gamma == Config().solver.gamma  # schema default
    cfg = load_config(c, ["solver.lr=0.3", "solver.lr=0.4", "solver.steps=[10,20]", "train.amp.enabled=true"])
    assert cfg.solver.lr == 0.4 and cfg.solver.steps == [10, 20] and cfg.train.amp.enabled is True


def test_base_cycle_and_missing_file(tmp_path):
    _write(tmp_path / "a.yaml", "base: b.yaml\n")
    _write(tmp_path / "b.yaml", "base: a.yaml\n")
    with pytest.raises(ConfigError, match="cycle"):
        load_config(tmp_path / "a.yaml")
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")


def test_yaml_is_read_safely(tmp_path):
    f = _write(tmp_path / "evil.yaml", "solver: !!python/object/apply:os.system ['echo hi']\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(f)


def test_round_trip_yaml_and_checkpoint_data(tmp_path):
    cfg = load_config(TINY_CONFIG, ["solver.param_groups=[{match: backbone.body, lr_mult: 0.1}]"])
    save_config(cfg, tmp_path / "config.yaml")
    assert load_config(tmp_path / "config.yaml") == cfg
    torch.save({"config": config_to_dict(cfg)}, tmp_path / "c.pth")
    data = torch.load(tmp_path / "c.pth", weights_only=True)["config"]
    assert config_from_dict(data) == cfg
    assert dataclasses.asdict(cfg) == data


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_loads(path):
    cfg = load_config(path)
    assert isinstance(cfg, Config)
    assert cfg.solver.max_iter > 0 or (cfg.solver.max_epochs > 0 and cfg.solver.steps_epochs)  # iterations, or epochs


@pytest.mark.parametrize(
    "override, key",
    [
        ("solver.steps={a: 1}", "solver.steps"),
        ("model.anchors.sizes=[[32],{a: 1}]", "model.anchors.sizes"),
        ("solver.param_groups={match: backbone}", "solver.param_groups"),
    ],
)
def test_a_mapping_for_a_list_key_names_the_key(override, key):
    """A mapping where a list belongs was a TypeError from OmegaConf's merge (or a later
    comparison); it is one line naming the key."""
    with pytest.raises(ConfigError) as e:
        load_config(None, [override])
    msg = str(e.value)
    assert f"config key '{key}' takes a list" in msg and "\n" not in msg


def _bounded_keys(section, prefix=""):
    """(dotted key, field metadata) of every key whose field carries bounds."""
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if dataclasses.is_dataclass(value):
            yield from _bounded_keys(value, f"{prefix}{f.name}.")
        elif any(f.metadata.get(b) is not None for b in ("ge", "gt", "le", "lt")):
            yield f"{prefix}{f.name}", f.metadata


def test_every_bound_next_to_a_field_is_enforced():
    """Just outside each bound of the schema: one line naming the key and the range."""
    keys = list(_bounded_keys(Config()))
    assert len(keys) >= 55  # the old range table's rows, and more
    for key, meta in keys:
        outside = [meta["ge"] - 1 if meta["ge"] is not None else None, meta["gt"],
                   meta["le"] + 1 if meta["le"] is not None else None, meta["lt"]]
        for bad in (v for v in outside if v is not None):
            with pytest.raises(ConfigError, match=rf"^config key '{re.escape(key)}' must be .*, got "):
                load_config(None, [f"{key}={bad}"])


@pytest.mark.parametrize("given, nearest", [
    ("solver.base_lr", "solver.lr"),            # an alias (detectron2's name), not solver.scale_lr
    ("solver.learning_rate", "solver.lr"),
    ("solver.max_iters", "solver.max_iter"),
    ("solver.ims_per_batch", "solver.images_per_gpu"),
    ("solver.momentum_sgd", "solver.momentum"),  # a sibling that is one of its parts
    ("solver.lrr", "solver.lr"),
    ("model.num_clases", "model.num_classes"),
    ("sovler", "solver"),
])
def test_unknown_key_suggests_the_nearest_key_of_its_section(given, nearest):
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"{given}=1"])
    assert f"unknown config key '{given}' (did you mean '{nearest}'?)" in str(err.value)


@pytest.mark.parametrize("groups, fpn", [(32, 64), (7, 64), (48, 64), (16, 96), (96, 96), (128, 64), (3, 96)])
def test_group_norm_groups_are_checked_against_the_model(groups, fpn):
    """``model.gn_groups`` is refused in one line naming it exactly when the network's
    GroupNorm layers could not be built with it (the model itself is the reference)."""
    from detector.modeling import build_model

    keys = ["model.norm=gn", "model.backbone=resnet18", f"model.fpn_channels={fpn}"]
    reference = load_config(TINY_CONFIG, keys)
    reference.model.gn_groups = groups  # past the validation: what the model alone says
    try:
        build_model(reference)
        builds = True
    except ValueError:
        builds = False
    if builds:
        assert load_config(TINY_CONFIG, [*keys, f"model.gn_groups={groups}"]).model.gn_groups == groups
    else:
        with pytest.raises(ConfigError, match=rf"^config key 'model.gn_groups' \({groups}\) must divide"):
            load_config(TINY_CONFIG, [*keys, f"model.gn_groups={groups}"])
    assert builds == (groups in (32, 16, 128)), (groups, fpn)  # both outcomes are exercised


def test_loads_share_no_state_and_report_the_first_bad_source(tmp_path):
    """Every load merges into a copy of one schema node (built once per process): a load,
    a failed one included, changes neither that node nor another load's result; with a bad
    value in the file and an unknown key in an override, the file's error comes first, as
    when each source was merged in turn."""
    from omegaconf import OmegaConf

    from detector.config import loading

    before = OmegaConf.to_yaml(loading._schema())
    a = load_config(TINY_CONFIG, ["solver.lr=0.5", "input.min_size_train=[64,72]"])
    with pytest.raises(ConfigError):
        load_config(TINY_CONFIG, ["solver.lr=fast"])
    b = load_config(TINY_CONFIG)
    assert OmegaConf.to_yaml(loading._schema()) == before
    assert (a.solver.lr, b.solver.lr) == (0.5, load_config(TINY_CONFIG).solver.lr) and a.solver.lr != b.solver.lr
    assert a.input.min_size_train == [64, 72] and b.input.min_size_train != [64, 72]
    a.input.min_size_train.append(80)
    assert load_config(TINY_CONFIG, ["input.min_size_train=[64,72]"]).input.min_size_train == [64, 72]
    bad = tmp_path / "bad.yaml"
    bad.write_text(f"base: {TINY_CONFIG}\nsolver:\n  max_iter: many\n")
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(bad))}: bad value for config key 'solver.max_iter'"):
        load_config(bad, ["solver.lrr=0.1"])
    with pytest.raises(ConfigError, match=r"^override 'solver.max_iter=many': bad value .*'solver.max_iter'"):
        load_config(TINY_CONFIG, ["solver.lr=0.1", "solver.max_iter=many", "solver.warmup_iters=x"])
