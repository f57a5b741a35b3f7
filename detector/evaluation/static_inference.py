"""``eval.static`` and ``eval.cuda_graphs``: inference batches through
``modeling.static_detect`` instead of the model's eager forward.

``StaticDetector(images)`` returns what ``model(images)`` returns in eval mode (the same
detections, ``tests/test_static_detect.py``), but the batch runs with fixed shapes and
without a host read until its detections are unpacked (one read of the counts). With
``capture=True`` (CUDA only) the first batch of each shape ``(B, H, W)`` on a canvas of
``model.canvas_sizes`` is run a few times on a side stream and captured into a
``torch.cuda.CUDAGraph``; each later batch of that shape copies its images into the
graph's input tensors and replays it, so a batch costs one graph launch on the host
instead of about 2,700 operator calls (R50-FPN).

A detector lives for one inference run (``run_inference`` builds it): its graphs read the
model's weights in place, and under autocast they cast them inside the graph (no autocast
weight cache is captured), so they stay valid while the weights do not change.
"""

from __future__ import annotations

import logging
from typing import Dict, List, NamedTuple, Optional, Set, Tuple

import torch
from torch import Tensor, nn

from detector.config import Config, EvalConfig, RPNConfig
from detector.modeling.static_detect import StaticDetections, check_static_heads, detections_list, static_detect

logger = logging.getLogger(__name__)
WARMUP_RUNS = 2


class StaticSettings(NamedTuple):
    """``eval.static_candidates``, ``rpn.nms_max_iters`` and ``eval.cuda_graphs``."""

    max_candidates: int = EvalConfig.static_candidates
    nms_max_iters: int = RPNConfig.nms_max_iters
    capture: bool = False


def static_settings(cfg: Config) -> Optional[StaticSettings]:
    """The config's ``StaticSettings``, or None when ``eval.static`` is off."""
    if not cfg.eval.static:
        return None
    return StaticSettings(cfg.eval.static_candidates, cfg.rpn.nms_max_iters, cfg.eval.cuda_graphs)


class StaticDetector:
    """Callable: a list of ``[3, H_i, W_i]`` images -> per image ``{"boxes", "scores",
    "labels"}`` on the model's device, as the eval forward of ``model`` (a ``FasterRCNN``
    in eval mode) returns them.

    Attributes:
        truncated_images: images so far whose candidates ``max_candidates`` cut
            (``StaticDetections.truncated``).
        unconverged_images: images so far with an NMS that did not converge.
        uncaptured_shapes: with ``capture``, the batch shapes ``(H, W)`` that fit no canvas
            of ``model.canvas_sizes`` and so ran uncaptured (same detections, slower).
    """

    def __init__(self, model: nn.Module, settings: StaticSettings) -> None:
        check_static_heads(model.roi_heads)
        self.model = model
        self.settings = settings
        self.device = next(model.parameters()).device
        if settings.capture and self.device.type != "cuda":
            raise ValueError(f"config key 'eval.cuda_graphs' needs a CUDA device, got {self.device}")
        self.graphs: Dict[Tuple[int, ...], Tuple["torch.cuda.CUDAGraph", Tensor, Tensor, StaticDetections]] = {}
        self.pool = None  # one memory pool for all of its graphs (see _capture)
        self.truncated_images = 0
        self.unconverged_images = 0
        self.uncaptured_shapes: Set[Tuple[int, int]] = set()

    def __call__(self, images: List[Tensor]) -> List[Dict[str, Tensor]]:
        batch, sizes = self.model.preprocess(images)
        image_sizes = torch.tensor(sizes, dtype=torch.int64).to(self.device, non_blocking=True)
        on_canvas = tuple(batch.shape[-2:]) in self.model.canvas_sizes
        if self.settings.capture and not on_canvas:  # the same detections, uncaptured
            self.uncaptured_shapes.add(tuple(batch.shape[-2:]))
        capture = self.settings.capture and on_canvas
        dets = self._replay(batch, image_sizes) if capture else self._run(batch, image_sizes)
        # One host read per batch: the detections per image and the two flags' counts.
        flags = torch.stack((dets.truncated, dets.nms_unconverged)).sum(dim=1)
        read = torch.cat((dets.valid.sum(dim=1), flags)).tolist()
        self.truncated_images += read[-2]
        self.unconverged_images += read[-1]
        return detections_list(dets, read[:-2])

    def _run(self, batch: Tensor, image_sizes: Tensor) -> StaticDetections:
        s = self.settings
        return static_detect(self.model, batch, image_sizes, s.max_candidates, s.nms_max_iters)

    def _replay(self, batch: Tensor, image_sizes: Tensor) -> StaticDetections:
        key = tuple(batch.shape)
        if key not in self.graphs:
            self.graphs[key] = self._capture(batch, image_sizes)
        graph, images_in, sizes_in, outputs = self.graphs[key]
        images_in.copy_(batch, non_blocking=True)
        sizes_in.copy_(image_sizes, non_blocking=True)
        graph.replay()
        # The next replay writes into the same memory: hand out copies.
        return StaticDetections(*(t.clone() for t in outputs))

    def _capture(self, batch: Tensor, image_sizes: Tensor
                 ) -> Tuple["torch.cuda.CUDAGraph", Tensor, Tensor, StaticDetections]:
        """Warm up on a side stream, then capture ``_run`` on copies of the inputs: the
        graph, its input tensors and its outputs. Under autocast the weight casts are
        captured too (``cache_enabled=False``): a cached cast made outside the graph could
        be freed while the graph still reads it.

        The graphs share one memory pool, whatever order they replay in: a capture reuses
        only blocks free at that time, and what a graph reads before writing (its inputs,
        allocated outside the pool, and its outputs, kept referenced here) is never free;
        each replay's outputs are copied before the next replay."""
        with torch.inference_mode(False):  # plain tensors: later copies may run outside inference mode
            images_in, sizes_in = batch.clone(), image_sizes.clone()
        device_type = self.device.type
        autocast = torch.autocast(device_type, dtype=torch.get_autocast_dtype(device_type),
                                  enabled=torch.is_autocast_enabled(device_type), cache_enabled=False)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream), autocast:
            for _ in range(WARMUP_RUNS):
                self._run(images_in, sizes_in)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool), autocast:
            outputs = self._run(images_in, sizes_in)
        return graph, images_in, sizes_in, outputs

    def report(self) -> None:
        """One warning line per flag that some image or batch of the run raised."""
        if self.uncaptured_shapes:
            logger.warning("eval.cuda_graphs: batches of %s px fit no canvas of model.canvas_sizes %s and ran "
                           "uncaptured (the same detections, slower); add canvases that hold them",
                           sorted(self.uncaptured_shapes), [list(c) for c in self.model.canvas_sizes])
        if self.truncated_images:
            logger.warning("eval.static: %d image(s) had more than eval.static_candidates=%d candidates and kept "
                           "fewer than roi_heads.detections_per_img among them: their detections may lack some "
                           "of the eager forward's; raise eval.static_candidates", self.truncated_images,
                           self.settings.max_candidates)
        if self.unconverged_images:
            logger.warning("eval.static: the NMS of %d image(s) did not converge within rpn.nms_max_iters=%d: "
                           "their detections may differ from the eager forward's; raise it",
                           self.unconverged_images, self.settings.nms_max_iters)
