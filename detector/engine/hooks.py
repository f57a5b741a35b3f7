"""Hooks of the training loop, one concern each (detectron2's ``HookBase`` spirit).

The loop (``detector.engine.trainer``) calls, for every hook in list order,
``before_train(state)`` once, ``after_step(state)`` after every iteration and
``after_train(state)`` once at the end (also after an error, with
``state.status == "failed"``). ``state`` is the ``LoopState`` the loop updates; a
hook reads it and may set ``stop_requested``.

The trainer's order, and why:

1. ``NonFiniteGuard``: stops the run after ``train.max_nonfinite_steps`` skipped steps
   in a row, naming the newest finite checkpoint.
2. ``MetricsWriter``: losses, LRs, timings to the console (a progress bar in a
   terminal), ``metrics.jsonl`` and TensorBoard.
3. ``PeriodicCheckpointer``: ``iter_N.pth`` + ``last.pth`` every period; at the end the
   final checkpoint (or ``last.pth`` on a stop) BEFORE the final evaluation.
4. ``EvalHook``: evaluation every period and at the end, ``best.pth``; a failing
   evaluation is one error line naming the checkpoint to evaluate later.
5. ``SignalHook``: SIGTERM/SIGINT ask the loop to stop after the current iteration
   (read by the step at the start of the next one). Last, so that its handlers stay
   until every other hook has ended: after a failure the others may wait on a lost
   peer, and torchrun's SIGTERM must not end the rank before it reports the failure.

Collectives: hooks that reduce or gather across ranks (metrics, checkpoints, best
model) run on every rank at the same iterations, so the ranks stay in step.
"""

from __future__ import annotations

import logging
import math
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist
from tqdm import tqdm

from detector.engine import checkpoint as ckpt
from detector.engine.checkpointer import Checkpointer
from detector.distributed import all_gather_object
from detector.engine.log import (
    JSONLWriter,
    TensorBoardWriter,
    draw_detections,
    format_console_line,
    format_eta,
    peak_memory_mb,
)
from detector.engine.step import AmpSettings, StepResult
from detector.messages import typed_first_line

logger = logging.getLogger(__name__)


class NonFiniteLossError(RuntimeError):
    """``train.max_nonfinite_steps`` non-finite losses in a row: one line."""


class EvaluationError(RuntimeError):
    """The final evaluation failed (the final checkpoint is saved): one line."""


@dataclass
class LoopState:
    """What the loop knows, shared with the hooks.

    Attributes:
        max_iter: iterations to train (``solver.max_iter``).
        iteration: iterations done.
        start_iter: ``iteration`` when this process started (0, or the resumed one).
        epoch: the current epoch of the data loader.
        epoch_position: batches of ``epoch`` already done.
        step: the last ``TrainStep`` result (None before the first step).
        data_time: seconds spent waiting for the last batch.
        batch_images: images in the last batch on this rank.
        stop_requested: set (to the reason, e.g. ``"SIGTERM"``) to stop after the next
            step; the step shares it across ranks, so ``step.stop`` is what stops.
        status: ``running``, then ``finished``, ``interrupted`` or ``failed``.
        error: the one-line error of a failed run.
    """

    max_iter: int
    iteration: int = 0
    start_iter: int = 0
    epoch: int = 0
    epoch_position: int = 0
    step: Optional[StepResult] = None
    data_time: float = 0.0
    batch_images: int = 0
    stop_requested: Optional[str] = None
    status: str = "running"
    error: Optional[str] = None

    @property
    def stopping(self) -> bool:
        """Some rank asked to stop, and the loop will stop after this iteration."""
        return self.step is not None and self.step.stop and self.iteration < self.max_iter


class HookBase:
    """Base class: override any of the three methods."""

    def before_train(self, state: LoopState) -> None:
        pass

    def after_step(self, state: LoopState) -> None:
        pass

    def after_train(self, state: LoopState) -> None:
        pass


@dataclass
class EventWriters:
    """Where records go (rank 0; None elsewhere or when turned off)."""

    jsonl: Optional[JSONLWriter] = None
    tb: Optional[TensorBoardWriter] = None

    def write(self, record: Dict[str, Any], scalars: Dict[str, float], step: int) -> None:
        if self.jsonl is not None:
            self.jsonl.write(record)
        if self.tb is not None:
            self.tb.scalars({k: v for k, v in scalars.items() if math.isfinite(v)}, step)


def _rank0_decides(value: Any, world_size: int) -> Any:
    """Rank 0's ``value`` on every rank."""
    return value if world_size == 1 else all_gather_object(value)[0]


# --------------------------------------------------------------------------- signals


class SignalHook(HookBase):
    """SIGTERM / SIGINT: stop after the current iteration (the checkpointer then writes
    ``last.pth``). A second signal raises ``KeyboardInterrupt`` at once. Handlers are
    installed only in the main thread and restored at the end."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self._previous: Dict[int, Any] = {}

    def before_train(self, state: LoopState) -> None:
        if threading.current_thread() is not threading.main_thread():
            return

        def handler(signum: int, frame: Any) -> None:
            if state.stop_requested is not None:
                raise KeyboardInterrupt
            state.stop_requested = signal.Signals(signum).name
            logger.warning("received %s: stopping after this iteration and saving a checkpoint", state.stop_requested)

        for sig in self.SIGNALS:
            self._previous[sig] = signal.signal(sig, handler)

    def after_train(self, state: LoopState) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()


# --------------------------------------------------------------------------- non-finite guard


class NonFiniteGuard(HookBase):
    """Warns at each non-finite step (skipped by ``TrainStep``) and stops the run after
    ``max_in_row`` in a row with ``NonFiniteLossError``, naming the checkpoint to resume
    from. That is the newest finite checkpoint holding a state at least two iterations
    before the first failing step: resuming from the state just before it would
    repeat the same forward pass on the same batch, whatever the LR. Failing that, the
    newest finite checkpoint; failing that, the current state is saved if it is finite
    (the skipped steps did not change the weights)."""

    def __init__(self, max_in_row: int, checkpointer: Checkpointer, world_size: int = 1) -> None:
        if max_in_row <= 0:
            raise ValueError(f"train.max_nonfinite_steps must be > 0, got {max_in_row}")
        self.max_in_row = max_in_row
        self.checkpointer = checkpointer
        self.world_size = world_size
        self.in_row = 0

    def after_step(self, state: LoopState) -> None:
        step = state.step
        if step is None or not step.nonfinite:
            self.in_row = 0
            return
        self.in_row += 1
        values = ", ".join(f"{k}={v:.4g}" for k, v in zip(step.loss_names, step.losses.tolist()))
        logger.warning("iteration %d: non-finite loss or gradient (%s); step skipped (%d in a row)",
                       state.iteration, values, self.in_row)
        if self.in_row >= self.max_in_row:
            k = self.max_in_row
            raise NonFiniteLossError(
                f"{k} non-finite losses in a row (train.max_nonfinite_steps={k}) at iteration {state.iteration}; "
                f"stopped; {self._resume_point(state.iteration - k + 1, state.iteration)}. "
                "Lower solver.lr, enable solver.clip_grad_norm, or check the data"
            )

    def _resume_point(self, first_bad: int, iteration: int) -> str:
        # Rank 0 sees the files; every rank must take the same branch (save is collective).
        found = _rank0_decides(self.checkpointer.newest_at_most(first_bad - 2), self.world_size)
        if found is not None:
            return f"resume from the newest finite checkpoint before the failing steps: {found[0]} (iteration {found[1]})"
        ck = self.checkpointer
        if ck.newest is None and ck.save(["last.pth"], iteration) is not None:
            return f"the weights before the failing steps are saved in {ck.newest} (iteration {ck.newest_iteration})"
        if ck.newest is not None:
            return f"newest finite checkpoint: {ck.newest} (iteration {ck.newest_iteration})"
        return "no finite checkpoint was written (the weights were not finite)"


# --------------------------------------------------------------------------- metrics


def _named_lrs(groups: List[Dict[str, Any]]) -> Dict[str, float]:
    return {str(g.get("name", i)): float(g["lr"]) for i, g in enumerate(groups)}


class MetricsWriter(HookBase):
    """Every ``period`` iterations (and at a stop or the end): the window's mean losses
    and gradient norm (over iterations and ranks; non-finite steps left out), each group's
    LR, iteration and data time, images/s, peak memory and the AMP scale, to the
    console, ``metrics.jsonl`` and TensorBoard. Per iteration it only keeps the step's
    device tensors: nothing is read back outside logging points.

    Console: with ``progress_bar`` a tqdm bar with ETA (the log line then goes to
    ``log.txt`` only); otherwise one log line with ETA per period.

    Args:
        period: iterations between records (``train.log_period``).
        optimizer: its groups' LRs (``name`` of each group) are recorded.
        writers: JSONL / TensorBoard (rank 0).
        device: for the peak-memory figure.
        world_size: > 1: losses are averaged over ranks (all ranks take part).
        scaler: a GradScaler whose scale is recorded when it is enabled.
        progress_bar: show a tqdm bar on stderr (rank 0 in a terminal).
    """

    def __init__(
        self,
        period: int,
        optimizer: torch.optim.Optimizer,
        writers: EventWriters,
        device: torch.device,
        world_size: int = 1,
        scaler: Optional[torch.amp.GradScaler] = None,
        progress_bar: bool = False,
        is_main: bool = True,
    ) -> None:
        if period <= 0:
            raise ValueError(f"train.log_period must be > 0, got {period}")
        self.period = period
        self.optimizer = optimizer
        self.writers = writers
        self.device = device
        self.world_size = world_size
        self.scaler = scaler
        self.progress_bar = progress_bar
        self.is_main = is_main
        self._bar: Optional[tqdm] = None
        self._reset(time.perf_counter())
        self._recent_iter_times: List[float] = []

    def _reset(self, now: float) -> None:
        self._losses: List[torch.Tensor] = []
        self._grad_norms: List[torch.Tensor] = []
        self._names: tuple = ()
        self._skipped = 0
        self._images = 0
        self._data_time = 0.0
        self._count = 0
        self._window_start = now

    def before_train(self, state: LoopState) -> None:
        self._reset(time.perf_counter())
        if self.progress_bar:
            self._bar = tqdm(total=state.max_iter, initial=state.iteration, desc="train", unit="it",
                             dynamic_ncols=True, mininterval=0.5)

    def after_step(self, state: LoopState) -> None:
        step = state.step
        assert step is not None
        self._count += 1
        self._images += state.batch_images
        self._data_time += state.data_time
        self._names = step.loss_names
        if step.nonfinite:
            self._skipped += 1
        else:
            self._losses.append(step.losses)
        if not step.skipped:  # (a float16 overflow has finite losses but no finite norm)
            self._grad_norms.append(step.grad_norm)
        if self._bar is not None:
            self._bar.update(1)
        if state.iteration % self.period == 0 or state.iteration == state.max_iter or state.stopping:
            self.write(state)

    def after_train(self, state: LoopState) -> None:
        if state.status in ("finished", "interrupted") and self._count:
            self.write(state)  # the part-window before a stop
        if state.status == "failed" and self.is_main and self.writers.jsonl is not None:
            self.writers.jsonl.write({"iteration": state.iteration, "type": "stopped", "reason": state.error or ""})
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def write(self, state: LoopState) -> Dict[str, Any]:
        """Reduce the window, write the record and start a new window; returns the record."""
        now = time.perf_counter()
        names = list(self._names)
        n = len(names)
        nan = torch.full((1,), float("nan"), device=self.device)
        mean = torch.stack(self._losses).mean(0) if self._losses else nan.expand(n)
        grad_norm = torch.stack(self._grad_norms).mean().reshape(1) if self._grad_norms else nan
        counts = torch.tensor([float(self._images), float(self._skipped)], device=mean.device)
        stats = torch.cat([mean.float(), grad_norm.float(), counts])
        if self.world_size > 1:
            dist.all_reduce(stats)
            stats[: n + 1] /= self.world_size
        values = stats.tolist()  # the read-back of a logging point
        elapsed = now - self._window_start
        iter_time = elapsed / max(1, self._count)
        self._recent_iter_times = (self._recent_iter_times + [iter_time])[-5:]
        eta = sum(self._recent_iter_times) / len(self._recent_iter_times) * (state.max_iter - state.iteration)
        lrs = _named_lrs(self.optimizer.param_groups)
        record: Dict[str, Any] = {
            "iteration": state.iteration,
            "type": "train",
            "epoch": state.epoch,
            **dict(zip(names, values[:n])),
            "grad_norm": values[n],
            "lr": lrs.get("default", next(iter(lrs.values()))),
            **{f"lr/{k}": v for k, v in lrs.items()},
            "time": iter_time,
            "data_time": self._data_time / max(1, self._count),
            "images_per_sec": values[n + 1] / max(elapsed, 1e-9),
            "memory_mb": peak_memory_mb(self.device),
            "nonfinite_skipped": int(values[n + 2]),
        }
        if self.scaler is not None and self.scaler.is_enabled():
            record["amp_scale"] = float(self.scaler.get_scale())
        self._reset(time.perf_counter())
        if not self.is_main:
            return record
        line = format_console_line(record, state.max_iter, eta, lrs)
        if self._bar is not None:
            logger.debug(line)  # to log.txt; the bar shows the figures
            self._bar.set_postfix_str(f"loss {record.get('total_loss', float('nan')):.4f}  "
                                      f"lr {record['lr']:.3g}  eta {format_eta(eta)}", refresh=False)
        else:
            logger.info(line)
        scalars = {f"loss/{k}": record[k] for k in names}
        scalars.update({f"lr/{k}": v for k, v in lrs.items()})
        scalars.update({
            "train/grad_norm": record["grad_norm"], "time/iter": record["time"], "time/data": record["data_time"],
            "train/images_per_sec": record["images_per_sec"], "memory/peak_mb": record["memory_mb"],
        })
        if "amp_scale" in record:
            scalars["train/amp_scale"] = record["amp_scale"]
        self.writers.write(record, scalars, state.iteration)
        return record


# --------------------------------------------------------------------------- checkpoints


class PeriodicCheckpointer(HookBase):
    """``iter_N.pth`` and ``last.pth`` every ``period`` iterations (``<= 0``: none); at
    the end of a finished run the final ``iter_N.pth`` + ``last.pth``, and on a stop
    ``last.pth``. As the hook before ``EvalHook``, it writes the final checkpoint
    before the final evaluation."""

    def __init__(self, checkpointer: Checkpointer, period: int) -> None:
        self.checkpointer = checkpointer
        self.period = period

    def after_step(self, state: LoopState) -> None:
        if state.step is not None and state.step.nonfinite:
            return  # the state of a skipped step: keep the older checkpoints rather than prune them
        if self.period > 0 and state.iteration % self.period == 0 and state.iteration < state.max_iter:
            self.checkpointer.save([ckpt.numbered_checkpoint_name(state.iteration), "last.pth"], state.iteration)

    def after_train(self, state: LoopState) -> None:
        if self.checkpointer.saved.get("last.pth") == state.iteration:
            return  # this state is saved already
        if state.status == "finished":
            self.checkpointer.save([ckpt.numbered_checkpoint_name(state.iteration), "last.pth"], state.iteration)
        elif state.status == "interrupted":
            self.checkpointer.save(["last.pth"], state.iteration)


# --------------------------------------------------------------------------- evaluation


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

    def after_step(self, state: LoopState) -> None:
        if self.period > 0 and state.iteration % self.period == 0 and state.iteration < state.max_iter \
                and not state.stopping:
            self.run(state.iteration)

    def after_train(self, state: LoopState) -> None:
        if state.status == "finished" and self.period >= 0:
            error = self.run(state.iteration)
            if error is not None:
                raise EvaluationError(error)

    def run(self, iteration: int) -> Optional[str]:
        """Evaluate and keep the best; returns the one-line error of a failure, else None."""
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
            logger.info("evaluation at iteration %d (%.1fs): %s", iteration, time.perf_counter() - t0,
                        "  ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
            self.writers.write({"iteration": iteration, "type": "eval", **metrics},
                               {f"eval/{k}": v for k, v in metrics.items()}, iteration)
            if self.writers.tb is not None:
                self.writers.tb.flush()
        self._keep_best(metrics, iteration)
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

    def _keep_best(self, metrics: Dict[str, float], iteration: int) -> None:
        value: Optional[float] = None
        if self.is_main and metrics:
            if self.best_metric not in metrics:
                logger.warning("train.best_metric=%r is not among the evaluation metrics %s; best.pth not written",
                               self.best_metric, sorted(metrics))
            elif math.isfinite(metrics[self.best_metric]) and (
                    self.best_value is None or metrics[self.best_metric] > self.best_value):
                value = metrics[self.best_metric]
        value = _rank0_decides(value, self.world_size)
        if value is None:
            return
        self.best_value = value
        # Files already holding this iteration are rewritten too, so they carry the new best value.
        same = [n for n, it in self.checkpointer.saved.items() if it == iteration and n != "best.pth"]
        self.checkpointer.save(["best.pth", *same], iteration)
        if self.is_main:
            logger.info("new best %s %.4f at iteration %d", self.best_metric, value, iteration)


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
            drawn = draw_detections(image, target["boxes"], pred["boxes"][keep].float(), captions)
            tb.image(f"val/detections_{i}", drawn, iteration)
