"""Reading weight files: one safe reader, ``read_weights_file(path)``, for training
(``--resume`` and ``model.weights``), evaluation, inference, export and the benchmark.

It always uses ``torch.load(weights_only=True)`` and turns every way a file can be wrong
(missing, empty, truncated, corrupt, a pickle of other Python objects, not a dict, a
model exported by ``tools/export.py`` or a safetensors file) into one ``WeightsError``
line that names the file. It never passes on torch's own advice to retry with
``weights_only=False``. ``state_dict_from`` finds the state dict inside what was read.
"""

from __future__ import annotations

import os
import pickle
import re
import warnings
import zipfile
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Union

import torch
from torch import Tensor

from detector.messages import DetectorError

KEYS_SHOWN = 3  # keys named in a message (weights.py too)


class WeightsError(DetectorError, ValueError):
    """A weights file or state dict that cannot be read or does not fit the model.
    The message is one line and names the file (or ``model.weights``)."""


def _other_format(path: Path) -> Optional[str]:
    """What a file that ``torch.load`` refused is, where its bytes tell: a model that
    ``tools/export.py`` wrote (TorchScript, ONNX), or safetensors; else None."""
    try:
        with open(path, "rb") as f:
            head = f.read(64)
        names = zipfile.ZipFile(path).namelist() if zipfile.is_zipfile(path) else []
    except (OSError, zipfile.BadZipFile):
        return None
    if any("/code/" in n for n in names) and any(n.endswith("/constants.pkl") for n in names):
        return ("a TorchScript model (as tools/export.py --format torchscript writes), not weights: give the "
                "checkpoint it was exported from, or run it with torch.jit.load")
    if len(head) > 8 and head[8:9] == b"{" and int.from_bytes(head[:8], "little") < path.stat().st_size:
        return ("a safetensors file, not a torch.save file: save its tensors with torch.save("
                "safetensors.torch.load_file(path), 'weights.pth') and give that")
    onnx_suffix = path.suffix.lower() == ".onnx"
    if head[:1] == b"\x08" and (onnx_suffix or b"pytorch" in head):  # an ONNX ModelProto starts with ir_version
        return ("an ONNX model (as tools/export.py --format onnx writes), not weights: give the checkpoint it was "
                "exported from, or run it with onnxruntime")
    if onnx_suffix:
        return ("named as an ONNX model (.onnx) but not one either (corrupt or truncated?): give the training "
                "checkpoint (.pth)")
    return None


def _not_weights(path: Path, kind: str = "corrupt, or another format") -> WeightsError:
    """``<path>: not a PyTorch weights file (<kind>)``, or what it is where its bytes tell."""
    other = _other_format(path)
    return WeightsError(f"{path}: {other}" if other else f"{path}: not a PyTorch weights file ({kind})")


def _unpickling_refusal(path: Path, exc: pickle.UnpicklingError) -> WeightsError:
    """Rephrase torch's weights-only refusal without its advice to turn the check off."""
    found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(exc))
    if found:
        return WeightsError(
            f"{path}: refused to load: the file holds Python objects, not only tensors and plain data "
            f"(it needs {found.group(1)}); only weight files saved with torch.save of a state dict or "
            "training checkpoint are read"
        )
    return _not_weights(path)


def read_weights_file(path: Union[str, os.PathLike]) -> Dict[str, Any]:
    """Read a weights file or training checkpoint safely.

    Uses ``torch.load(path, map_location="cpu", weights_only=True)``: only tensors and
    plain data are unpickled, never arbitrary Python objects.

    Returns:
        the dict stored in the file (a state dict, or a training checkpoint with a
        ``model`` entry).

    Raises:
        WeightsError: one line naming the file: missing, a directory, empty, truncated,
            corrupt or of another format (an exported TorchScript or ONNX model, or
            safetensors, said as such), a pickle of other Python objects, or not a dict.
    """
    path = Path(path).expanduser()
    if not path.exists():
        raise WeightsError(f"{path}: no such file")
    if not path.is_file():
        raise WeightsError(f"{path}: not a file")
    size = path.stat().st_size
    if size == 0:
        raise WeightsError(f"{path}: empty file (0 bytes), not a weights file")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. "Detected pickle protocol 4 in the checkpoint"
            data = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise _unpickling_refusal(path, exc) from None
    except RuntimeError as exc:
        if "zip archive" in str(exc) or "central directory" in str(exc):
            raise WeightsError(f"{path}: truncated or corrupt weights file ({size} bytes; the zip archive "
                               "is incomplete, e.g. a copy or save that stopped midway)") from None
        raise _not_weights(path) from None
    except (EOFError, OSError, KeyError, ValueError, TypeError, AttributeError, IndexError) as exc:
        raise _not_weights(path, "truncated" if isinstance(exc, EOFError) else "corrupt, or another format") from None
    if not isinstance(data, dict):
        raise WeightsError(f"{path}: holds a {type(data).__name__}, not a state dict (a mapping of names to tensors)")
    return data


def state_dict_from(data: Mapping[str, Any], where: str) -> Dict[str, Tensor]:
    """The state dict inside ``data``: a training checkpoint's ``model`` (or
    ``state_dict``) entry, or ``data`` itself. ``where`` names the source in errors.

    Raises:
        WeightsError: no tensors, or values that are not tensors.
    """
    for key in ("model", "state_dict"):  # a training checkpoint
        if key in data and isinstance(data[key], Mapping):
            data = data[key]
            break
    if not isinstance(data, Mapping):
        raise WeightsError(f"{where}: holds a {type(data).__name__}, not a state dict (a mapping of names to tensors)")
    unnamed = [k for k in data if not isinstance(k, str)]
    if unnamed:
        raise WeightsError(f"{where}: not a state dict: {len(unnamed)} keys are not names (strings), "
                           f"e.g. {unnamed[:KEYS_SHOWN]}")
    others = [k for k, v in data.items() if not isinstance(v, Tensor)]
    if not data or len(others) == len(data):
        keys = list(data)[:KEYS_SHOWN]
        raise WeightsError(f"{where}: not a state dict: it holds no tensors ({len(data)} entries, e.g. {keys})")
    if others:
        raise WeightsError(f"{where}: not a state dict: {len(others)} entries are not tensors, e.g. {others[:KEYS_SHOWN]}")
    return dict(data)
