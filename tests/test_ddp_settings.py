"""train.ddp_bucket_cap_mb and train.ddp_gradient_as_bucket_view reach the
DistributedDataParallel wrapper; a bucket size <= 0 is a one-line config error."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from detector.config import ConfigError, load_config
from detector.engine.setup import prepare_model
from detector.modeling import build_model
from conftest import TINY_CONFIG


def test_ddp_settings_reach_the_wrapper(tmp_path):
    cfg = load_config(TINY_CONFIG, ["train.ddp_bucket_cap_mb=7.5", "train.ddp_gradient_as_bucket_view=true"])
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        ddp, plain = prepare_model(build_model(cfg), cfg, torch.device("cpu"), world_size=2)
        assert isinstance(ddp, torch.nn.parallel.DistributedDataParallel) and ddp.module is plain
        assert ddp.bucket_bytes_cap == int(7.5 * 1024 * 1024)
        assert ddp.gradient_as_bucket_view is True
    finally:
        dist.destroy_process_group()
    defaults = load_config(TINY_CONFIG).train
    assert defaults.ddp_bucket_cap_mb == 25.0 and defaults.ddp_gradient_as_bucket_view is False


def test_bucket_size_must_be_positive():
    with pytest.raises(ConfigError, match=r"config key 'train.ddp_bucket_cap_mb' must be > 0, got 0"):
        load_config(TINY_CONFIG, ["train.ddp_bucket_cap_mb=0"])
