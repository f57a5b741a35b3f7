"""What ``train.amp`` means on one device: autocast on or off, its dtype, and whether a
GradScaler is needed.

- ``enabled: auto`` is on for CUDA and off for anything else;
- ``dtype: auto`` is bfloat16 where the device supports it, else float16
  (``detector.distributed.amp_dtype``, shared with the evaluation's ``eval.amp``);
- float16 trains with a GradScaler, and float16 autocast on a CPU device is refused.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from detector.config import AMPConfig, ConfigError
from detector.distributed import amp_dtype


@dataclass(frozen=True)
class AmpSettings:
    """What ``train.amp`` means on one device (``resolve_amp``): autocast ``enabled``
    with ``dtype``. float16 needs a GradScaler (it is refused on the CPU)."""

    enabled: bool = False
    dtype: torch.dtype = torch.float16

    @property
    def uses_scaler(self) -> bool:
        return self.enabled and self.dtype == torch.float16


def resolve_amp(amp: AMPConfig, device: torch.device | str) -> AmpSettings:
    """Resolve ``train.amp`` for training on ``device``: ``enabled: auto`` is on for
    CUDA and off for anything else; the dtype as in ``detector.distributed.amp_dtype``.

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
