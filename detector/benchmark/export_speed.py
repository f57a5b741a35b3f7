"""Inference time of an exported file (TorchScript or ONNX Runtime) next to the eager
model, on the same image, on the CPU (``tools/export.py --time N``)."""

from __future__ import annotations

import os
from typing import Any, Dict

import torch
from torch import Tensor

from ..modeling.export import load_exported
from ..modeling.faster_rcnn import FasterRCNN
from .timing import Runner, machine_info, run_interleaved


def benchmark_exported(model: FasterRCNN, fmt: str, path: str | os.PathLike, image: Tensor,
                       iters: int, warmup: int = 2) -> Dict[str, Any]:
    """Time ``model([image])`` (eager, ``torch.inference_mode``) and the exported file on
    one ``[3, H, W]`` uint8 image, alternating iteration by iteration (the benchmark's
    recipe: warm-up, medians, CPU time). ONNX Runtime gets as many intra-op threads as
    torch (``torch.get_num_threads()``), so both use the same cores.

    Returns ``{"runs": {"eager": summary, fmt: summary}, "ratio": eager median /
    exported median (> 1: the file is faster), "ratio_cpu_time": the same from the
    process's CPU time (steadier on a shared machine), "image_size", "machine"}``.
    """
    if iters < 1:
        raise ValueError(f"--time needs at least 1 iteration, got {iters}")
    device = torch.device("cpu")
    model = model.eval()
    run = load_exported(fmt, path, threads=torch.get_num_threads())

    def eager(_i: int) -> int:
        with torch.inference_mode():
            model([image])
        return 1

    def exported(_i: int) -> int:
        run(image)
        return 1

    runners = [Runner("eager", eager, device), Runner(fmt, exported, device)]
    run_interleaved(runners, iters, warmup)
    runs = {r.name: r.summary() for r in runners}
    return {
        "runs": runs,
        "ratio": runs["eager"]["median_s"] / runs[fmt]["median_s"],
        "ratio_cpu_time": runs["eager"]["cpu_median_s"] / runs[fmt]["cpu_median_s"],
        "image_size": list(image.shape[-2:]),
        "machine": machine_info(device),
    }
