"""Bad weight files: one reader (``read_weights_file``) gives one line naming the file for
an empty, truncated, corrupt, non-weights or tensor-less file and for another
architecture; tools/eval.py and tools/infer.py print it and exit 1, with no traceback
and never torch's advice to load with ``weights_only=False``. Also: with ``--weights``
the tools never load the run's ``model.weights``."""

from __future__ import annotations

import os
import pickle
import warnings
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from detector.config import load_config
from detector.modeling import build_model
from detector.modeling import weights as weights_module
from detector.modeling.weights import WeightsError, read_weights_file
from conftest import TINY_CONFIG, load_tool, tiny_overrides

from conftest import ROOT  # noqa: E402


class NotWeights:
    """Any class: a pickle of it is not a weights file."""

    def __init__(self):
        self.x = 1


def _write_bad_files(folder: Path) -> dict:
    """name -> (path, the words the message must contain)."""
    folder.mkdir(parents=True, exist_ok=True)
    good = folder / "good.pth"
    torch.save({"model": {"a": torch.zeros(100)}}, good)
    data = good.read_bytes()
    files = {
        "empty": (b"", "empty file"),
        "truncated": (data[: len(data) // 2], "truncated or corrupt"),
        "random": (np.random.default_rng(0).bytes(4096), "not a PyTorch weights file"),
        "text": (b"hello, not weights\n", "not a PyTorch weights file"),
    }
    out = {}
    for name, (blob, words) in files.items():
        (folder / f"{name}.pth").write_bytes(blob)
        out[name] = (folder / f"{name}.pth", words)
    torch.save({"model": NotWeights()}, folder / "object.pth")
    out["object"] = (folder / "object.pth", "refused to load: the file holds Python objects")
    (folder / "pickle.pkl").write_bytes(pickle.dumps({"model": NotWeights()}))
    out["pickle"] = (folder / "pickle.pkl", "not a PyTorch weights file")
    torch.save({"model": {"lr": 0.1, "name": "x"}, "iteration": 3}, folder / "no_tensors.pth")
    out["no_tensors"] = (folder / "no_tensors.pth", "not a state dict: it holds no tensors")
    torch.save([torch.zeros(2)], folder / "list.pth")
    out["list"] = (folder / "list.pth", "holds a list, not a state dict")
    torch.save({1: torch.zeros(1), "a": torch.zeros(1)}, folder / "int_keys.pth")  # was an AttributeError traceback
    out["int_keys"] = (folder / "int_keys.pth", "not a state dict: 1 keys are not names (strings), e.g. [1]")
    return out


def test_read_weights_file_one_line_per_case(tmp_path):
    from detector.modeling.weights import load_weights

    model = build_model(load_config(TINY_CONFIG))
    for name, (path, words) in _write_bad_files(tmp_path).items():
        with pytest.raises(WeightsError) as e:
            load_weights(model, path)
        msg = str(e.value)
        assert msg.startswith(str(path)) and words in msg, (name, msg)
        assert "\n" not in msg and "weights_only" not in msg, (name, msg)
    with pytest.raises(WeightsError, match="nope.pth: no such file"):
        read_weights_file(tmp_path / "nope.pth")
    assert read_weights_file(tmp_path / "good.pth")["model"]["a"].shape == (100,)


def test_a_model_file_of_another_format_is_named_as_such(tmp_path):
    """An exported model passed as --weights (the TorchScript or ONNX file tools/export.py
    wrote), or a safetensors file, was 'not a PyTorch weights file (corrupt, or another
    format)': now what it is and what to give instead. Other bytes keep the old line."""
    import json
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.jit.script is deprecated
        torch.jit.script(torch.nn.Linear(2, 2)).save(tmp_path / "model.pt")
    (tmp_path / "model_onnx.pth").write_bytes(b"\x08\x08\x12\x07pytorch\x1a\x062.14.1:" + bytes(64))
    (tmp_path / "model.onnx").write_bytes(b"\x08\x07\x12\x05other" + bytes(16))  # another producer's ONNX
    (tmp_path / "bad.onnx").write_bytes(b"not even protobuf")
    header = json.dumps({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode()
    (tmp_path / "w.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + bytes(8))
    (tmp_path / "noise.pth").write_bytes(b"\x01\x02" * 40)
    expected = {
        "model.pt": "a TorchScript model (as tools/export.py --format torchscript writes), not weights: give the "
                    "checkpoint it was exported from, or run it with torch.jit.load",
        "model_onnx.pth": "an ONNX model (as tools/export.py --format onnx writes), not weights",
        "model.onnx": "an ONNX model",
        "bad.onnx": "named as an ONNX model (.onnx) but not one either (corrupt or truncated?)",
        "w.safetensors": "a safetensors file, not a torch.save file: save its tensors with torch.save(",
        "noise.pth": "not a PyTorch weights file (corrupt, or another format)",
    }
    for name, words in expected.items():
        with pytest.raises(WeightsError) as e:
            read_weights_file(tmp_path / name)
        assert str(e.value).startswith(f"{tmp_path / name}: {words}"), (name, str(e.value))


@pytest.fixture(scope="module")
def tool_setup(tmp_path_factory):
    """A tiny model's weights, a config, a val set of 2 generated images, one input
    image, the bad files, and the weights of another architecture."""
    root = tmp_path_factory.mktemp("weight_files")
    data = root / "shapes"
    overrides = tiny_overrides(data, None, "data.shapes.num_train=1", "data.shapes.num_val=2")
    cfg = load_config(TINY_CONFIG, overrides)
    torch.manual_seed(0)
    torch.save(build_model(cfg).state_dict(), root / "good.pth")
    wide = build_model(load_config(TINY_CONFIG, [*overrides, "model.fpn_channels=48"]))
    torch.save({"model": wide.state_dict(), "iteration": 5}, root / "other_arch.pth")
    image = root / "in.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (80, 90, 3), dtype=np.uint8)).save(image)
    files = _write_bad_files(root / "bad")
    files["other_arch"] = (root / "other_arch.pth", "does not fit the model")
    # Weights that fit by name and shape but not by value: a NaN, a sparse or a quantized tensor.
    good = torch.load(root / "good.pth", weights_only=True)
    fc = "roi_heads.box_head.fc6.weight"
    nan = dict(good, **{"backbone.fpn.inner_blocks.0.1.bias": torch.full_like(good[
        "backbone.fpn.inner_blocks.0.1.bias"], float("nan"))})
    torch.save(nan, root / "nan.pth")
    files["nan"] = (root / "nan.pth", "'backbone.fpn.inner_blocks.0.1.bias' holds NaN or Inf values")
    torch.save(dict(good, **{fc: good[fc].to_sparse()}), root / "sparse.pth")
    files["sparse"] = (root / "sparse.pth", f"'{fc}' is a sparse_coo tensor; weights must be dense float tensors")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantized tensors are deprecated; files with them still exist
        torch.save(dict(good, **{fc: torch.quantize_per_tensor(good[fc], 0.01, 0, torch.qint8)}),
                   root / "quantized.pth")
    files["quantized"] = (root / "quantized.pth", f"'{fc}' is a quantized tensor")
    return root, overrides, image, files


def _tool_args(tool: str, weights: Path, root: Path, overrides, image: Path) -> list:
    args = [str(ROOT / "tools" / f"{tool}.py"), "--config", str(TINY_CONFIG), "--weights", str(weights),
            "--output-dir", str(root / f"out_{tool}")]
    if tool == "infer":
        args += ["--input", str(image)]
    return args + list(overrides)


CASES = ["empty", "truncated", "random", "object", "no_tensors", "int_keys", "other_arch", "nan", "sparse", "quantized"]


def _check_error(stderr: str, path: Path, words: str, case: str) -> None:
    assert "Traceback" not in stderr and "weights_only=False" not in stderr
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and str(path) in errors[0] and words in errors[0], stderr[-2000:]
    if case == "other_arch":  # the first mismatched keys and shapes are named
        assert "backbone.fpn." in errors[0] and "[48," in errors[0] and "[32," in errors[0], errors[0]


@pytest.mark.parametrize("tool", ["eval", "infer"])
@pytest.mark.parametrize("case", CASES)
def test_tools_bad_weights_one_line(tool_setup, tool, case, capsys):
    root, overrides, image, files = tool_setup
    path, words = files[case]
    assert load_tool(tool).main(_tool_args(tool, path, root, overrides, image)[1:]) == 1
    _check_error(capsys.readouterr().err, path, words, case)


@pytest.mark.slow
@pytest.mark.parametrize("tool, case", [("eval", "random"), ("infer", "object")])
def test_tools_bad_weights_one_line_subprocess(tool_setup, tool, case):
    """The two cases where torch's own message suggests ``weights_only=False``, each from
    a real process of one tool (every tool and case runs in process above)."""
    root, overrides, image, files = tool_setup
    path, words = files[case]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, *_tool_args(tool, path, root, overrides, image)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Traceback" not in proc.stdout
    _check_error(proc.stderr, path, words, case)


@pytest.mark.parametrize("tool", ["eval", "infer"])
@pytest.mark.parametrize("weights", ["missing_file.pth", "FasterRCNN_ResNet50_FPN_Weights.COCO_V1"])
def test_weights_flag_never_loads_model_weights(tool_setup, tool, weights, monkeypatch):
    """A run whose config names a model.weights that cannot be loaded (a missing file, or
    torchvision weights with no network) still evaluates and infers with --weights."""
    import torchvision.models._api as api

    def no_download(*args, **kwargs):
        raise AssertionError("model.weights was loaded although --weights was given")

    monkeypatch.setattr(api, "load_state_dict_from_url", no_download)
    root, overrides, image, _ = tool_setup
    source = str(root / weights) if weights.endswith(".pth") else weights
    args = _tool_args(tool, root / "good.pth", root, [*overrides, f"model.weights={source}"], image)
    assert load_tool(tool).main(args[1:]) == 0


@pytest.mark.parametrize("tool", ["eval", "infer"])
def test_weights_flag_takes_a_torchvision_weights_name(tool_setup, tool, monkeypatch, capsys):
    """``--weights FasterRCNN_ResNet50_FPN_Weights.COCO_V1`` fetches torchvision's weights
    (here a stand-in: no download in tests) and loads them strictly; an unknown name is
    one line naming ``--weights``."""
    root, overrides, image, _ = tool_setup
    asked = []

    def fetch(source, key, instead):
        asked.append((source, key))
        return read_weights_file(root / "good.pth")

    monkeypatch.setattr(weights_module, "torchvision_state_dict", fetch)
    name = "FasterRCNN_ResNet50_FPN_Weights.COCO_V1"
    assert load_tool(tool).main(_tool_args(tool, name, root, overrides, image)[1:]) == 0
    assert asked == [(name, "--weights")]
    monkeypatch.undo()
    capsys.readouterr()
    bad = "FasterRCNN_ResNet50_FPN_Weights.NO_SUCH"
    assert load_tool(tool).main(_tool_args(tool, bad, root, overrides, image)[1:]) == 1
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "--weights: unknown torchvision weights name" in errors[0] and bad in errors[0]
