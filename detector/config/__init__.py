"""Typed configuration: the dataclass schema (``schema``), YAML loading with ``base:``
inheritance and ``key=value`` command-line overrides (``loading``), and the checks
driven by the schema (``validation``).

Every key has a type, a default and, where it has one, its range or choices, in
``schema``. A YAML file or an override that names a key the schema does not have, or
gives a value of the wrong type, raises ``ConfigError`` with the full dotted key and
the nearest valid key::

    >>> load_config("configs/tiny_cpu.yaml", ["solver.lrr=0.1"])
    ConfigError: unknown config key 'solver.lrr' (did you mean 'solver.lr'?)

What ``train.amp`` means on a device is decided in ``detector.engine.amp``; the check
of ``train.output_dir`` is ``detector.engine.run_folder.check_output_dir``.
"""

from .loading import config_from_dict, config_to_dict, config_to_yaml, default_config, load_config, save_config
from .schema import (
    AMPConfig,
    AnchorConfig,
    Config,
    CopyPasteConfig,
    DataConfig,
    EvalConfig,
    InputConfig,
    LSJConfig,
    ModelConfig,
    NMSConfig,
    ParamGroupRule,
    ROIHeadsConfig,
    RPNConfig,
    ShapesConfig,
    SolverConfig,
    SplitConfig,
    TrainConfig,
    TTAConfig,
)
from .validation import ConfigError, validate_config

__all__ = [
    "AMPConfig",
    "AnchorConfig",
    "Config",
    "ConfigError",
    "CopyPasteConfig",
    "DataConfig",
    "EvalConfig",
    "InputConfig",
    "LSJConfig",
    "ModelConfig",
    "NMSConfig",
    "ParamGroupRule",
    "ROIHeadsConfig",
    "RPNConfig",
    "ShapesConfig",
    "SolverConfig",
    "SplitConfig",
    "TrainConfig",
    "TTAConfig",
    "config_from_dict",
    "config_to_dict",
    "config_to_yaml",
    "default_config",
    "load_config",
    "save_config",
    "validate_config",
]
