"""Evaluation during training: ``EvalHook`` (periodic and final evaluation, ``best.pth``),
``Validator`` (the evaluation it runs: the val split, reports and images to
TensorBoard) and ``log_detections``."""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Any, Callable, Dict, Optional

import torch

from detector.config import Config
from detector.data import build_dataset
from detector.distributed import all_gather_object
from detector.engine.checkpointing import Checkpointer
from detector.engine.log import EventWriters, TensorBoardWriter
from detector.engine.amp import AmpSettings
from detector.engine.early_stop import EarlyStopping, metric_value
from detector.engine.train_loop import HookBase, LoopState
from detector.evaluation import draw_detections, evaluate as default_evaluate, write_report
from detector.messages import DetectorError, typed_first_line

logger = logging.getLogger(__name__)


class EvaluationError(DetectorError, RuntimeError):
    """The final evaluation failed (the final checkpoint is saved): one line."""


class EvalHook(HookBase):
    """Evaluates every ``period`` iterations (``0``: only at the end, ``< 0``: never)
    and at the end of a finished run; keeps ``best.pth`` at the best ``best_metric``.

    A failing evaluation (any exception inside ``evaluate``) is one error line naming
    the checkpoint to evaluate later; training goes on after a periodic one, and a
    failed final evaluation raises ``EvaluationError`` (the run exits non-zero) after
    the final checkpoint was written.

    Args:
        evaluate: ``evaluate(iteration) -> metrics`` (rank 0's metrics; ``{}`` elsewhere).
        checkpointer: writes ``best.pth``.
        period: ``train.eval_period``.
        best_metric: ``train.best_metric``, larger is better.
        best_value: the best value so far (from a resumed checkpoint).
        writers: eval records go to JSONL (``type: eval``) and TensorBoard (``eval/<k>``).
        eval_command: how to evaluate a checkpoint by hand; ``{weights}`` is replaced.
        early_stopping: patience on ``best_metric`` at the periodic evaluations
            (``train.early_stop``); when it runs out the hook sets ``state.early_stop`` and
            the loop ends the run as finished (final checkpoint, ``last.pth``).
    """

    def __init__(
        self,
        evaluate: Callable[[int], Dict[str, float]],
        checkpointer: Checkpointer,
        period: int,
        best_metric: str,
        writers: EventWriters,
        best_value: Optional[float] = None,
        eval_command: str = "python tools/eval.py --weights {weights}",
        is_main: bool = True,
        world_size: int = 1,
        early_stopping: Optional[EarlyStopping] = None,
    ) -> None:
        self.evaluate = evaluate
        self.checkpointer = checkpointer
        self.period = period
        self.best_metric = best_metric
        self.writers = writers
        self.best_value = best_value
        self.eval_command = eval_command
        self.is_main = is_main
        self.world_size = world_size
        self.last_metrics: Dict[str, float] = {}
        self.last_iteration: Optional[int] = None
        self.early_stopping = early_stopping

    def early_stop_state(self) -> Optional[Dict[str, Any]]:
        """The patience counter, for checkpoints (None: early stopping is off)."""
        return self.early_stopping.state_dict() if self.early_stopping is not None else None

    def before_train(self, state: LoopState) -> None:
        es = self.early_stopping
        if es is not None and es.exhausted:  # resumed from a run that had stopped early
            state.early_stop = es.reason(state.iteration)
            logger.warning("%s (resumed)", state.early_stop)

    def after_step(self, state: LoopState) -> None:
        if self.period > 0 and state.iteration % self.period == 0 and state.iteration < state.max_iter \
                and not state.stopping:
            self.run(state.iteration, periodic=True)
            state.metrics = dict(self.last_metrics)
            es = self.early_stopping
            if es is not None and es.exhausted:
                state.early_stop = es.reason(state.iteration)
                if self.is_main:
                    logger.warning("%s; best.pth and last.pth are kept", state.early_stop)

    def after_train(self, state: LoopState) -> None:
        if state.early_stop is not None and self.last_iteration == state.iteration:
            return  # evaluated at this iteration already (the evaluation that stopped the run)
        if state.status == "finished" and self.period >= 0:
            error = self.run(state.iteration)
            state.metrics = dict(self.last_metrics)
            if error is not None:
                raise EvaluationError(error)

    def run(self, iteration: int, periodic: bool = False) -> Optional[str]:
        """Evaluate and keep the best (and, ``periodic``, count the patience); returns the
        one-line error of a failure, else None."""
        t0 = time.perf_counter()
        metrics: Dict[str, float] = {}
        error: Optional[str] = None
        try:
            metrics = self.evaluate(iteration) or {}
        except Exception as exc:  # noqa: BLE001 - any failure inside evaluation becomes one line
            at = self._checkpoint_at(iteration)
            error = (f"evaluation at iteration {iteration} failed ({typed_first_line(exc)}); "
                     f"no checkpoint is lost: evaluate later with: {self.eval_command.format(weights=at)}")
            logger.debug("evaluation failure", exc_info=True)  # the traceback goes to log.txt only
        if self.world_size > 1:
            # A failure on one rank (rank 0's scoring, say) is every rank's: all take the same
            # branch, since _keep_best and the next steps are collective.
            error = next((e for e in all_gather_object(error) if e is not None), None)
        if error is not None:
            logger.error(error)
            return error
        metrics = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}
        self.last_metrics = metrics
        if self.is_main:
            # The evaluator's table showed every metric; this line is the headline for the log.
            head = [k for k in (self.best_metric, "AP", "AP50", "mAP_voc07") if k in metrics]
            logger.info("evaluation at iteration %d (%.1fs): %s", iteration,
                        time.perf_counter() - t0, "  ".join(f"{k} {metrics[k]:.4f}" for k in dict.fromkeys(head)))
            self.writers.write({"iteration": iteration, "type": "eval", **metrics},
                               {f"eval/{k}": v for k, v in metrics.items()}, iteration)
            if self.writers.tb is not None:
                self.writers.tb.flush()
        self.last_iteration = iteration
        self._keep_best(metrics, iteration, periodic)
        return None

    def _checkpoint_at(self, iteration: int) -> str:
        """The checkpoint holding ``iteration`` (or the newest one, with its iteration)."""
        for name in ("last.pth", *sorted(self.checkpointer.saved, reverse=True)):
            if self.checkpointer.saved.get(name) == iteration:
                return str(self.checkpointer.directory / name)
        newest = self.checkpointer.newest
        if newest is None:
            return f"<no checkpoint yet; the next one in {self.checkpointer.directory}>"
        return f"{newest} (iteration {self.checkpointer.newest_iteration})"

    def _keep_best(self, metrics: Dict[str, float], iteration: int, periodic: bool) -> None:
        """``best.pth`` at a new best measured ``best_metric``; the patience counted first,
        so that the files rewritten here carry it (a checkpoint of this iteration was
        written before this evaluation)."""
        value = self._measured_value(metrics)
        es = self.early_stopping if periodic else None
        wait = es.wait if es is not None else None
        if es is not None:
            es.update(value, iteration)
        same = [n for n, it in self.checkpointer.saved.items() if it == iteration and n != "best.pth"]
        if value is None or (self.best_value is not None and value <= self.best_value):
            if es is not None and es.enabled and same and es.wait != wait:
                self.checkpointer.save(same, iteration)  # they carry the new patience count
            return
        self.best_value = value
        # Files already holding this iteration are rewritten too, so they carry the new best value.
        self.checkpointer.save(["best.pth", *same], iteration)
        if self.is_main:
            logger.info("new best %s %.4f at iteration %d", self.best_metric, value, iteration)

    def _measured_value(self, metrics: Dict[str, float]) -> Optional[float]:
        """Rank 0's measured ``best_metric`` (``metric_value``) on every rank; None where missing."""
        value: Optional[float] = None
        if self.is_main and metrics:
            if self.best_metric not in metrics:
                logger.warning("train.best_metric=%r is not among the evaluation metrics %s; best.pth not written",
                               self.best_metric, sorted(metrics))
            else:
                value = metric_value(metrics, self.best_metric)
                if value is None:
                    logger.warning("%s is %s, not measured (e.g. no ground truth in the val set): no improvement, "
                                   "best.pth not written", self.best_metric, metrics[self.best_metric])
        return value if self.world_size == 1 else all_gather_object(value)[0]


class Validator:
    """Callable ``(iteration) -> metrics``: evaluates ``model`` on the val split (every
    rank takes part; metrics on rank 0) into ``<output_dir>/eval/iter_N``, and on rank 0
    writes the per-class curves and ``train.vis_images`` images with boxes to TensorBoard.
    The model is put back in training mode afterwards.

    Args:
        model: the model without the DDP wrapper.
        cfg: the resolved config (``data.val``, ``eval.*``, ``train.vis_images``).
        amp: the training AMP settings (evaluation uses them where ``eval.amp``).
        writers: TensorBoard (rank 0).
        output_dir: the run folder.
        is_main: this process writes files.
        dataset: the val dataset (the trainer builds it before training); by default
            ``build_dataset(cfg, "val", False)`` at the first evaluation.
        evaluate_fn: ``detector.evaluation.evaluate`` by default.
        eval_name: the folder under ``output_dir`` for the reports (``eval``).
        draw: write the per-class curves and images to TensorBoard (off for a second
            model evaluated alongside, ``PairedValidator``).
    """

    def __init__(self, model: torch.nn.Module, cfg: Config, amp: AmpSettings, writers: EventWriters, output_dir: Path,
                 is_main: bool = True, dataset: Any = None, evaluate_fn: Callable[..., Any] = default_evaluate,
                 eval_name: str = "eval", draw: bool = True) -> None:
        self.model = model
        self.cfg = cfg
        self.amp = amp
        self.writers = writers
        self.output_dir = Path(output_dir)
        self.is_main = is_main
        self.dataset = dataset
        self.evaluate_fn = evaluate_fn
        self.eval_name = eval_name
        self.draw = draw

    def __call__(self, iteration: int) -> Dict[str, float]:
        cfg, model = self.cfg, self.model
        try:
            if self.dataset is None:
                self.dataset = build_dataset(cfg, "val", False)
            out = self.output_dir / self.eval_name / f"iter_{iteration:07d}"
            metrics = self.evaluate_fn(model, self.dataset, cfg, output_dir=out if self.is_main else None)
            report = getattr(metrics, "report", None)  # per-class curves (detector.evaluation.evaluate)
            tb = self.writers.tb if self.is_main and self.draw else None
            if tb is not None and report is not None:
                write_report(tb.writer, report, iteration)
            if tb is not None and cfg.train.vis_images > 0:
                log_detections(model, self.dataset, tb, iteration, cfg.train.vis_images, cfg.eval.score_thresh,
                               dataclasses.replace(self.amp, enabled=self.amp.enabled and cfg.eval.amp))
        finally:
            model.train()
        return metrics or {}


def log_detections(model: torch.nn.Module, dataset: Any, tb: TensorBoardWriter, iteration: int, num_images: int,
                   score_thresh: float, amp: AmpSettings) -> None:
    """Ground truth and predictions (score >= ``score_thresh``) of the first
    ``num_images`` images of ``dataset`` as TensorBoard images ``val/detections_<i>``."""
    model.eval()
    device = next(model.parameters()).device
    names = list(getattr(dataset, "class_names", []))
    with torch.no_grad():
        for i in range(min(num_images, len(dataset))):
            image, target = dataset[i]
            with torch.autocast(device.type, dtype=amp.dtype, enabled=amp.enabled):
                pred = model([image.to(device)])[0]
            keep = pred["scores"] >= score_thresh
            captions = [f"{names[label - 1] if 0 < label <= len(names) else label} {score:.2f}"
                        for label, score in zip(pred["labels"][keep].tolist(), pred["scores"][keep].tolist())]
            drawn = draw_detections(image, target["boxes"], pred["boxes"][keep].float(), captions,
                                    gt_classes=target["labels"], pred_classes=pred["labels"][keep], class_names=names)
            tb.image(f"val/detections_{i}", drawn, iteration)
