"""The static training step's forward for ``TrainStep`` (``train.static_step: true``).

``StaticForward(model, cfg)`` is called like the model in training,
``forward(images, targets) -> losses``, but pads the batch to fixed shapes on the host
(``modeling.static_forward.make_static_batch``) and runs
``modeling.static_forward.static_losses``, optionally compiled as one graph
(``compile_static_losses``: ``torch.compile(fullgraph=True, dynamic=False)``, one graph
per canvas of ``model.canvas_sizes``). It returns the model's ``TrainingLosses`` (the
samplers' statistics in ``stats``). The proposal NMS's non-convergence count is kept on
the device (``nms_unconverged``), to be read at logging points (``counters``). With
``train.cuda_graphs`` the trainer runs it through ``engine.graphed_train_step``.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from detector.config import Config
from detector.engine.graphed_step import check_cuda_graphs
from detector.engine.log import DeviceCounter
from detector.modeling.faster_rcnn import FasterRCNN
from detector.modeling.static_forward import StaticBatch, make_static_batch, static_losses
from detector.modeling.training_stats import TrainingLosses

LossFn = Callable[[StaticBatch], Tuple[Dict[str, Tensor], Dict[str, Tensor], Tensor]]


def compile_static_losses(model: FasterRCNN, nms_max_iters: int, backend: str = "inductor") -> LossFn:
    """``static_losses(model, batch, nms_max_iters)`` compiled as one graph (no graph
    breaks allowed, static shapes) by ``backend`` (``torch.compile``'s; "aot_eager"
    traces the same forward and backward graphs without generating code: a fast check).
    Random draws fall back to torch's generator (inductor's ``fallback_random``), so a
    seed gives the samples of the eager static step; the backward is compiled by
    AOTAutograd when the caller calls ``backward``."""
    fn = partial(static_losses, model, nms_max_iters=nms_max_iters)
    options = {"fallback_random": True} if backend == "inductor" else None
    return torch.compile(fn, fullgraph=True, dynamic=False, backend=backend, options=options)


def unwrap(model: nn.Module) -> FasterRCNN:
    """The ``FasterRCNN`` inside ``model`` (itself, or a DDP wrapper's ``module``)."""
    inner = getattr(model, "module", model)
    if not isinstance(inner, FasterRCNN):
        raise ValueError(f"train.static_step needs the FasterRCNN model, got {type(inner).__name__}")
    return inner


class StaticForward:
    """``forward(images, targets) -> {"loss_rpn_cls", ...}`` (a ``TrainingLosses``) through
    the static step.

    Args:
        model: the ``FasterRCNN`` (in training mode, on its device).
        max_gt: ``data.max_gt_per_image``.
        nms_max_iters: ``rpn.nms_max_iters``.
        compiled: run ``compile_static_losses`` (else the eager static losses).
        backend: ``torch.compile``'s backend when compiled.

    Attributes:
        nms_unconverged: 0-d int64 device tensor, the proposal NMS runs (image x level)
            that did not converge since construction, updated in place. Never read here.
    """

    def __init__(self, model: FasterRCNN, max_gt: int, nms_max_iters: int, compiled: bool = False,
                 backend: str = "inductor") -> None:
        if not model.canvas_sizes:
            raise ValueError("config key 'train.static_step' needs 'model.canvas_sizes' (the static step's batch shapes)")
        self.model = model
        self.max_gt = int(max_gt)
        self.nms_max_iters = int(nms_max_iters)
        self.losses_fn: LossFn = (compile_static_losses(model, nms_max_iters, backend) if compiled
                                  else partial(static_losses, model, nms_max_iters=nms_max_iters))
        self.nms_unconverged = torch.zeros((), dtype=torch.int64, device=model.device)

    @classmethod
    def from_config(cls, model: nn.Module, cfg: Config, compiled: bool = False,
                    backend: str = "inductor") -> "StaticForward":
        """From ``data.max_gt_per_image`` and ``rpn.nms_max_iters``."""
        return cls(unwrap(model), cfg.data.max_gt_per_image, cfg.rpn.nms_max_iters, compiled, backend)

    def batch(self, images: Sequence[Tensor], targets: Sequence[Dict[str, Any]]) -> StaticBatch:
        """The host-side preparation (``make_static_batch``)."""
        return make_static_batch(self.model, images, targets, self.max_gt)

    def __call__(self, images: List[Tensor], targets: List[Dict[str, Any]]) -> TrainingLosses:
        return self.run(self.batch(images, targets))

    def run(self, batch: StaticBatch) -> TrainingLosses:
        """The device part of a call: the losses (statistics in ``stats``) of a prepared
        batch; the NMS count grows on the device."""
        losses, stats, unconverged = self.losses_fn(batch)
        self.nms_unconverged.add_(unconverged.sum())
        return TrainingLosses(losses, stats)

    def counters(self) -> List[DeviceCounter]:
        """``static/nms_unconverged`` for ``MetricsWriter``: its warning names
        ``rpn.nms_max_iters``, the bound of the NMS iterations."""
        return [DeviceCounter(
            "static/nms_unconverged", self.nms_unconverged,
            "static step: the proposal NMS did not converge {count} times (image x level) since the last "
            f"record: raise config key 'rpn.nms_max_iters' (now {self.nms_max_iters})")]


def static_forward(cfg: Config, model: nn.Module, world_size: int, eager: bool = False) -> Optional[StaticForward]:
    """The trainer's static forward: a compiled ``StaticForward`` when
    ``train.static_step`` is on, else None (the model itself). ``eager``: uncompiled
    (debugging, the CPU tests) and, with ``train.cuda_graphs``, not captured, so any
    device will do. With several processes the static forward calls the model's parts
    directly, past DDP's hooks: ``TrainStep(average_gradients=True)`` then does DDP's
    buffer broadcast and gradient averaging. Refused in one line: ``train.cuda_graphs``
    off CUDA (unless ``eager``), and SyncBatchNorm layers (``model.norm=syncbn`` on CUDA
    with several processes), whose collectives in the forward pass are not part of the
    static graph."""
    if not cfg.train.static_step:
        return None
    if not eager:
        check_cuda_graphs(cfg, unwrap(model).device)
    if any(isinstance(m, nn.SyncBatchNorm) for m in unwrap(model).modules()):
        raise ValueError(f"config key 'model.norm' is {cfg.model.norm} (SyncBatchNorm across {world_size} processes), "
                         "which train.static_step does not run: use bn (statistics per process), gn or frozen_bn")
    return StaticForward.from_config(model, cfg, compiled=not eager)
