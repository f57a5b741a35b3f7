"""The timed tasks: the model (train or infer, against torchvision), the training step
fed by the real loader, loader throughput, COCO scoring, and an exported file against
the eager model (``tools/export.py --time N``)."""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import json
import logging
import os
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import torch
from torch import Tensor, nn

from detector.config import Config
from detector.data import build_dataset
from detector.data.loader import build_train_loader
from detector.distributed import resolve_device
from detector.evaluation.coco import COCO_METRIC_NAMES, coco_evaluate
from detector.evaluation import score_detections
from detector.evaluation.inference import inference_run
from detector.modeling.export import load_exported
from detector.modeling.faster_rcnn import FasterRCNN

from .batches import Batch, cached_batches, cycle_epochs
from .coco_case import generate_case, pycocotools_direct
from .steps import apply_speed_options, build_ours, make_ours_train_step, make_step
from .timing import Runner, machine_info, run_interleaved
from .torchvision_ref import build_torchvision_model, copy_matching_weights

logger = logging.getLogger(__name__)


def _ratio(ours: Dict[str, Any], theirs: Dict[str, Any]) -> Dict[str, float]:
    """ours / torchvision in images per second, from medians and pair by pair."""
    pairs = [b / a for a, b in zip(ours["times_s"], theirs["times_s"]) if a > 0]
    return {
        "ratio": ours["images_per_s"] / theirs["images_per_s"] if theirs["images_per_s"] > 0 else float("nan"),
        "ratio_pairwise_median": float(np.median(pairs)) if pairs else float("nan"),
        "ratio_cpu_time": theirs["cpu_median_s"] / ours["cpu_median_s"] if ours["cpu_median_s"] > 0 else float("nan"),
    }


def _model_info(model: nn.Module) -> Dict[str, int]:
    return {
        "params": sum(p.numel() for p in model.parameters()),
        "trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
    }


def benchmark_model(
    cfg: Config,
    task: str,
    iters: int,
    warmup: int,
    compare_torchvision: bool,
    num_batches: int = 4,
    synthetic: bool = False,
    same_weights: bool = True,
    torchvision_options: bool = False,
) -> Dict[str, Any]:
    """Time the training step (``task="train"``) or inference (``"infer"``) of our
    model on batches cached in memory, alternating with torchvision's if asked.

    Ours trains through the engine's ``TrainStep`` (the real hot loop, with the ``train.*``
    speed options of ``cfg``); torchvision's through :func:`make_train_step`, at its
    defaults unless ``torchvision_options`` (then with the same ``train.*`` options).
    ``same_weights``: copy our weights into torchvision's model where names and shapes
    match, so both see the same proposals and detections."""
    device = resolve_device(cfg.train.device)
    is_train = task == "train"
    torch.manual_seed(cfg.train.seed)
    batches = cached_batches(cfg, is_train, num_batches, synthetic, pin=device.type == "cuda")
    ours = build_ours(cfg, device)
    models: Dict[str, nn.Module] = {"ours": ours}
    out: Dict[str, Any] = {"models": {"ours": _model_info(ours)}}
    if compare_torchvision:
        tv = build_torchvision_model(cfg).to(device)
        if same_weights:
            copied, total = copy_matching_weights(ours, tv)
            out["torchvision_weights_copied"] = f"{copied}/{total}"
        if torchvision_options:
            tv = apply_speed_options(tv, cfg, device)
        models["torchvision"] = tv
        out["models"]["torchvision"] = _model_info(tv)
    out["torchvision_options"] = "same as ours" if torchvision_options else "torchvision defaults"

    if is_train:
        out["ours_step"] = ("detector.engine.graphed_train_step.GraphedTrainStep" if cfg.train.cuda_graphs
                            else "detector.engine.step.TrainStep")
        out["static_step"] = bool(cfg.train.static_step)
    runners, skipped = _runners(models, batches, cfg, device, task)
    # torchvision's reference loop stops at a non-finite loss (make_train_step raises):
    # its runner leaves, ours goes on and the result says why there is no ratio.
    # Inference: the run of batches as run_inference holds it (autocast's weight casts kept).
    with inference_run(device, cfg.eval.amp) if not is_train else contextlib.nullcontext():
        run_interleaved(runners, iters, warmup, stop_on=(FloatingPointError,))
    out["runs"] = {r.name: r.summary() for r in runners}
    if is_train:  # ours's steps skipped as non-finite, warm-up included (timed all the same)
        out["ours_nonfinite_steps"] = int(skipped["ours"])
    out["images_per_iter"] = out["runs"]["ours"].get("images_per_iter")
    out["batch_shapes"] = [[list(img.shape) for img in b[0]] for b in batches]
    if compare_torchvision and not out["runs"]["torchvision"].get("stopped"):
        out.update(_ratio(out["runs"]["ours"], out["runs"]["torchvision"]))
    return out


def _skipped(result: Any) -> Any:
    """1 if ``result`` (ours's ``StepResult``) is a step skipped as non-finite, else 0:
    a device tensor for the CUDA-graph step (its ``nonfinite_flag``, read once at the end)."""
    flag = getattr(result, "nonfinite_flag", None)
    return flag if flag is not None else int(bool(getattr(result, "nonfinite", False)))


def _runners(models: Dict[str, nn.Module], batches: List[Batch], cfg: Config, device: torch.device,
             task: str) -> Tuple[List[Runner], Dict[str, Any]]:
    """A ``Runner`` per model: its step (``make_step``) on the cached batches in turn; and
    per model the count of its steps skipped as non-finite (``_skipped``), kept up to date."""
    runners, skipped = [], {}
    for name, model in models.items():
        # The optimizer's log line once per benchmark: ours here, not the later builds.
        step, models[name] = make_step(model, cfg, device, task, torchvision_api=name == "torchvision",
                                       log_optimizer=name == "ours")
        skipped[name] = 0

        def fn(i: int, step=step, name=name) -> int:
            batch = batches[i % len(batches)]
            skipped[name] = skipped[name] + _skipped(step(batch))
            return len(batch[0])

        runners.append(Runner(name, fn, device))
    return runners, skipped


def benchmark_train_loader(cfg: Config, iters: int, warmup: int) -> Dict[str, Any]:
    """The training step fed by the real loader (workers, pinned memory): time per
    iteration including the wait for the next batch, and that wait alone."""

    device = resolve_device(cfg.train.device)
    torch.manual_seed(cfg.train.seed)
    dataset = build_dataset(cfg, "train", is_train=True)
    loader = build_train_loader(cfg, dataset, 0, 1)
    step, _ = make_ours_train_step(build_ours(cfg, device), cfg, device)
    waits: List[float] = []
    batches = cycle_epochs(loader)

    def fn(i: int) -> int:
        t0 = time.perf_counter()
        batch = next(batches)
        if i >= warmup:
            waits.append(time.perf_counter() - t0)
        step(batch)
        return len(batch[0])

    runner = Runner("ours_loader", fn, device)
    run_interleaved([runner], iters, warmup)
    summary = runner.summary()
    summary["data_wait_median_s"] = float(np.median(waits)) if waits else 0.0
    summary["data_wait_max_s"] = float(np.max(waits)) if waits else 0.0
    summary["num_workers"] = cfg.data.num_workers
    batches.close()  # shuts the loader's workers down
    return {"runs": {"ours_loader": summary}}


def benchmark_data(cfg: Config, iters: int, warmup: int) -> Dict[str, Any]:
    """Loader throughput: time per batch of ``build_train_loader`` (decoding, the
    albumentations pipeline, collate, ``cfg.data.num_workers`` workers), no model."""

    device = torch.device("cpu")
    dataset = build_dataset(cfg, "train", is_train=True)
    loader = build_train_loader(cfg, dataset, 0, 1)
    batches = cycle_epochs(loader)

    def fn(i: int) -> int:
        images, _ = next(batches)
        return len(images)

    runner = Runner("loader", fn, device)
    run_interleaved([runner], iters, warmup)
    summary = runner.summary()
    # Workers deliver in bursts (most batches are already waiting, every k-th is not), so
    # the median batch says nothing of the rate: the rate is total images / total time.
    summary["images_per_s"] = summary["images_per_iter"] / summary["mean_s"] if summary["mean_s"] > 0 else float("inf")
    summary["images_per_s_from"] = "mean"
    summary["num_workers"] = cfg.data.num_workers
    summary["dataset_len"] = len(dataset)
    batches.close()
    return {"runs": {"loader": summary}, "images_per_iter": summary["images_per_iter"]}


def benchmark_eval(
    cfg: Config,
    iters: int,
    warmup: int,
    gt_file: Optional[str] = None,
    results_file: Optional[str] = None,
    num_images: int = 500,
    boxes_per_image: int = 30,
) -> Dict[str, Any]:
    """COCO scoring speed, interleaved: pycocotools called directly (the documented
    sequence, ``coco_case.pycocotools_direct``) against our
    ``coco_evaluate`` with each backend and ``score_detections`` (every metric: COCO,
    VOC, IoU, confusion matrix). Inputs are a given gt/results pair or the evaluation
    helper's synthetic COCO-like case (``generate_case``); fresh copies of them are made
    outside the timed region. Checks that the 12 COCO numbers agree."""

    device = torch.device("cpu")
    if gt_file:
        with open(gt_file) as f:
            gt = json.load(f)
        with open(results_file) as f:  # type: ignore[arg-type]
            results = json.load(f)
        source: Dict[str, Any] = {"gt": gt_file, "results": results_file}
    else:
        gt, results = generate_case(num_images, boxes_per_image, seed=cfg.train.seed)
        source = {"generated_images": num_images, "boxes_per_image": boxes_per_image}
    source.update(images=len(gt["images"]), gt_boxes=len(gt["annotations"]), detections=len(results))
    n_img = len(gt["images"])
    stats: Dict[str, np.ndarray] = {}
    inputs: Dict[str, Any] = {}

    def fresh(i: int) -> None:
        inputs["gt"], inputs["results"] = copy.deepcopy(gt), copy.deepcopy(results)

    def twelve(metrics: Dict[str, float]) -> np.ndarray:
        return np.array([metrics[k] for k in COCO_METRIC_NAMES])

    scorers: Dict[str, Callable[[Dict[str, Any], List[Dict[str, Any]]], np.ndarray]] = {
        "pycocotools_direct": lambda g, r: np.asarray(pycocotools_direct(g, r))[:12],
        "ours_pycocotools": lambda g, r: twelve(coco_evaluate(g, r, backend="pycocotools").metrics),
    }
    if importlib.util.find_spec("faster_coco_eval") is not None:  # the optional backend
        scorers["ours_faster"] = lambda g, r: twelve(coco_evaluate(g, r, backend="faster").metrics)
    else:
        logger.warning("faster-coco-eval is not installed; timing the pycocotools backend only")
    scorers["ours_all_metrics"] = lambda g, r: twelve(score_detections(g, r, backend=cfg.eval.backend).metrics)

    runners = []
    for name, scorer in scorers.items():
        def run(i: int, name=name, scorer=scorer) -> int:
            stats[name] = scorer(inputs["gt"], inputs["results"])
            return n_img

        runners.append(Runner(name, run, device, prepare=fresh))
    run_interleaved(runners, iters, warmup)
    out: Dict[str, Any] = {"runs": {r.name: r.summary() for r in runners}, "source": source, "images_per_iter": n_img}
    ref = stats["pycocotools_direct"]
    out["max_abs_diff_vs_pycocotools"] = {k: float(np.max(np.abs(v - ref))) for k, v in stats.items()}
    ref_ips = out["runs"]["pycocotools_direct"]["images_per_s"]
    out["ratio_vs_pycocotools"] = {k: r["images_per_s"] / ref_ips for k, r in out["runs"].items()}
    return out


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


def format_timing(result: Dict[str, Any]) -> str:
    """``benchmark_exported``'s result as text: one line per run (median and CPU time per
    image) and the speed ratio (``tools/export.py --time``)."""
    h, w = result["image_size"]
    lines = [f"{name}: median {r['median_s'] * 1e3:.1f} ms/image ({r['iters']} runs, "
             f"CPU {r['cpu_median_s'] * 1e3:.1f} ms)" for name, r in result["runs"].items()]
    lines.append(f"eager / exported time: {result['ratio']:.2f} (CPU time {result['ratio_cpu_time']:.2f}) "
                 f"on one {h}x{w} image, {result['machine']['torch_threads']} threads, "
                 f"load average {result['machine'].get('loadavg')}")
    return "\n".join(lines)
