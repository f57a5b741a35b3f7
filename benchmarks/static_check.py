"""``--task static-check``: proof that the static training step is one graph without
host synchronisation, and what it costs next to the eager step.

For a config with ``train.static_step: true`` and ``model.canvas_sizes`` it builds the
model (random weights; ``model.num_classes: auto`` counts as 3 classes) and
``num_batches`` synthetic batches of ``solver.images_per_gpu`` images that fit the first
canvas, with random sizes and 0..``data.max_gt_per_image`` boxes each (different
images and ground-truth counts every batch). Then:

- ``host_syncs_per_step``: the eager static step (forward, losses, backward) runs under
  a ``TorchDispatchMode`` that counts the operators that read a device value on the
  host or whose output shape depends on the data (``SYNC_OPS``: ``.item()``/``.tolist()``
  (``_local_scalar_dense``), ``nonzero``, ``masked_select``, boolean-mask indexing, ...),
  divided by the number of steps. On CUDA the same steps also run under
  ``torch.cuda.set_sync_debug_mode("error")``, which raises on any synchronising call.
- ``graph_breaks``, ``recompiles``: ``engine.static_step.compile_static_losses``
  (``torch.compile(fullgraph=True, dynamic=False)``, backward through AOTAutograd) runs
  the batches; dynamo's counters give the unique graphs compiled (recompiles = graphs
  beyond the first) and the graph breaks (``torch._dynamo.explain`` counts them when
  ``fullgraph`` refuses the function).
- ``max_loss_rel_diff``: the largest relative difference of a loss between the
  compiled and the eager static step on the same batch and seed (``loss_rel_diff``: per
  loss). The check runs in full float32 (TF32 off for its duration): with TF32 the two
  graphs' convolutions differ by about 1e-3, enough to move a box across an IoU
  threshold or a top-k and so sample other anchors (the first H200 run: 0.15 with TF32).
- timings (seconds, medians after the first call): ``compile_s`` (the first compiled
  call with its backward), ``eager_step_s`` (the eager model), ``static_eager_step_s``,
  ``static_compiled_step_s``, all forward + backward, measured side by side.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from typing import Any, Callable, Dict, Iterator, List, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from detector.config import Config, ConfigError
from detector.engine.static_step import StaticForward
from detector.modeling import build_model
from detector.modeling.nms import resolve_method

aten = torch.ops.aten
# Operators that synchronise with the device or produce a data-dependent shape.
SYNC_OPS = {aten._local_scalar_dense.default, aten.nonzero.default, aten.nonzero_static.default,
            aten.masked_select.default, aten.is_nonzero.default, aten.equal.default, aten._unique2.default,
            aten.unique_consecutive.default, aten.bincount.default, aten.repeat_interleave.Tensor,
            aten.argwhere.default}
Batch = Tuple[List[torch.Tensor], List[Dict[str, Any]]]


class SyncCounter(TorchDispatchMode):
    """Counts ``SYNC_OPS`` calls and indexing with boolean masks (``count``), naming
    each (``names``)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.names: List[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        bool_index = func in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default) and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or ()))
        if func in SYNC_OPS or bool_index:
            self.count += 1
            self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def synthetic_batches(cfg: Config, num_batches: int, seed: int = 0) -> List[Batch]:
    """``num_batches`` batches of ``solver.images_per_gpu`` uint8 images within the first
    canvas (half to full size), each with 0..``data.max_gt_per_image`` random boxes."""
    g = torch.Generator().manual_seed(seed)
    height, width = cfg.model.canvas_sizes[0]
    classes = cfg.model.num_classes or 3
    out = []
    for _ in range(num_batches):
        images, targets = [], []
        for _ in range(cfg.solver.images_per_gpu):
            h = int(torch.randint(height // 2, height + 1, (1,), generator=g))
            w = int(torch.randint(width // 2, width + 1, (1,), generator=g))
            images.append(torch.randint(0, 256, (3, h, w), dtype=torch.uint8, generator=g))
            k = int(torch.randint(0, cfg.data.max_gt_per_image + 1, (1,), generator=g))
            xy = torch.rand(k, 2, generator=g) * torch.tensor([w * 0.75, h * 0.75])
            wh = (torch.rand(k, 2, generator=g) * 0.5 + 0.05) * torch.tensor([w / 2.0, h / 2.0]) + 1.0
            targets.append({"boxes": torch.cat((xy, torch.minimum(xy + wh, torch.tensor([w, h]))), 1),
                            "labels": torch.randint(1, classes + 1, (k,), generator=g)})
        out.append((images, targets))
    return out


def timed_step(fn: Callable[[], Dict[str, torch.Tensor]], seed: int, device: torch.device) -> Tuple[Dict, float]:
    """Run ``fn`` (losses) and its backward from ``seed``; the detached losses and seconds."""
    torch.manual_seed(seed)
    start = time.perf_counter()
    losses = fn()
    sum(losses.values()).backward()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return {k: v.detach().float() for k, v in losses.items()}, time.perf_counter() - start


def run_all(fn_of_batch: Callable[[Batch], Dict], batches: List[Batch], model: torch.nn.Module,
            device: torch.device) -> Tuple[List[Dict], List[float]]:
    """Every batch through ``fn_of_batch`` with its backward (seed = batch index)."""
    losses, times = [], []
    for i, b in enumerate(batches):
        model.zero_grad(set_to_none=True)
        out, sec = timed_step(lambda: fn_of_batch(b), i, device)
        losses.append(out)
        times.append(sec)
    return losses, times


def count_host_syncs(forward: StaticForward, batches: List[Batch], model: torch.nn.Module) -> SyncCounter:
    """``SyncCounter`` over the device part of the eager static step (``StaticForward.run``:
    losses, the samplers' statistics and the NMS count; then the backward; the
    host-side padding of each batch runs before, outside the count)."""
    counter = SyncCounter()
    for i, b in enumerate(batches):
        model.zero_grad(set_to_none=True)
        static_batch = forward.batch(*b)
        torch.manual_seed(i)
        with counter:
            losses = forward.run(static_batch)
            sum(losses.values()).backward()
    return counter


def raise_on_cuda_syncs(forward: StaticForward, batches: List[Batch], model: torch.nn.Module,
                        device: torch.device) -> None:
    """On CUDA: the device part of ``forward``'s steps under
    ``torch.cuda.set_sync_debug_mode("error")`` (a synchronising call raises)."""
    if device.type != "cuda":
        return
    prepared = [forward.batch(*b) for b in batches]
    torch.cuda.set_sync_debug_mode("error")
    try:
        for static_batch in prepared:
            model.zero_grad(set_to_none=True)
            losses = forward.run(static_batch)
            sum(losses.values()).backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def count_graph_breaks(forward: StaticForward, batch: Batch) -> int:
    """Graph breaks of the uncompiled static losses (``torch._dynamo.explain``)."""
    sb = forward.batch(*batch)
    return int(torch._dynamo.explain(forward.losses_fn)(sb).graph_break_count)


@contextlib.contextmanager
def full_float32() -> Iterator[None]:
    """TF32 off for cuDNN convolutions and CUDA matrix products, restored after."""
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


def static_check(cfg: Config, num_batches: int = 10, backend: str = "inductor") -> Dict[str, Any]:
    """The JSON of ``--task static-check`` (see the module docstring); ``backend``:
    ``torch.compile``'s ("aot_eager": the same graphs, no code generation)."""
    with full_float32():
        return _static_check(cfg, num_batches, backend)


def _static_check(cfg: Config, num_batches: int, backend: str) -> Dict[str, Any]:
    if not cfg.train.static_step:
        raise ConfigError("--task static-check needs config key 'train.static_step' true (and model.canvas_sizes)")
    if cfg.model.num_classes is None:
        cfg.model.num_classes = 3
    device = torch.device("cuda" if cfg.train.device == "auto" and torch.cuda.is_available()
                          else ("cpu" if cfg.train.device == "auto" else cfg.train.device))
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg).to(device).train()
    batches = synthetic_batches(cfg, num_batches, cfg.train.seed)
    eager_forward = StaticForward.from_config(model, cfg, compiled=False)
    counter = count_host_syncs(eager_forward, batches, model)
    static_losses, static_times = run_all(lambda b: eager_forward(*b), batches, model, device)
    raise_on_cuda_syncs(eager_forward, batches[:2], model, device)
    _, eager_times = run_all(lambda b: model(*b), batches, model, device)
    result = compiled_figures(cfg, model, batches, device, static_losses, backend)
    result.update(host_syncs_per_step=counter.count / len(batches), sync_ops=sorted(set(counter.names)),
                  eager_step_s=statistics.median(eager_times[1:]),
                  static_eager_step_s=statistics.median(static_times[1:]), device=str(device),
                  images_per_step=cfg.solver.images_per_gpu, num_batches=len(batches), backend=backend,
                  nms_method=resolve_method("auto", device))  # what the static step's proposals use
    return result


def compiled_figures(cfg: Config, model: torch.nn.Module, batches: List[Batch], device: torch.device,
                     reference: List[Dict], backend: str) -> Dict[str, Any]:
    """Graph breaks, recompiles, compile time, step time and loss differences of the
    compiled static step against ``reference`` (the eager static losses per batch)."""
    counters = torch._dynamo.utils.counters
    torch._dynamo.reset()
    counters.clear()
    forward = StaticForward.from_config(model, cfg, compiled=True, backend=backend)
    try:
        losses, times = run_all(lambda b: forward(*b), batches, model, device)
    except torch._dynamo.exc.Unsupported:
        eager = StaticForward.from_config(model, cfg, compiled=False)
        return {"graph_breaks": count_graph_breaks(eager, batches[0]), "recompiles": None,
                "max_loss_rel_diff": None, "compile_s": None, "static_compiled_step_s": None}
    raise_on_cuda_syncs(forward, batches[:2], model, device)  # compiled, after the warm-up
    graphs = int(counters["stats"]["unique_graphs"])
    diff = {k: max(float(((c[k] - r[k]).abs() / r[k].abs().clamp(min=1e-12)).item()) for c, r in zip(losses, reference))
            for k in reference[0]}
    return {"graph_breaks": int(sum(counters["graph_break"].values())), "recompiles": max(graphs - 1, 0),
            "max_loss_rel_diff": max(diff.values()), "loss_rel_diff": diff, "compile_s": times[0],
            "static_compiled_step_s": statistics.median(times[1:]) if len(times) > 1 else None}


def format_static_check(result: Dict[str, Any]) -> str:
    """One line of ``static_check``'s figures."""
    keys = ("graph_breaks", "recompiles", "host_syncs_per_step", "max_loss_rel_diff", "compile_s",
            "eager_step_s", "static_eager_step_s", "static_compiled_step_s")
    parts = [f"{k}={result[k]:.4g}" if isinstance(result[k], float) else f"{k}={result[k]}" for k in keys]
    return f"static-check ({result['device']}, {result['backend']}): " + " ".join(parts)
