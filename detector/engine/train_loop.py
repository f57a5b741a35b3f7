"""The training loop: ``Trainer`` runs a ``TrainStep`` per batch, then the hooks.

``Trainer`` only runs: it is given the model, the loader, the step, the hooks and
where to start, all built by ``detector.engine.trainer.build_trainer``. For every
hook in list order the loop calls ``before_train(state)`` once, ``after_step(state)``
after every iteration and ``after_train(state)`` at the end (also after an
error, with ``state.status == "failed"``; see ``HookBase``). ``state`` is the ``LoopState`` the loop
updates; a hook reads it and may set ``stop_requested``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

import torch
from torch import nn

from detector.distributed import barrier, watch
from detector.engine.checkpointing import set_rng_state
from detector.engine.step import StepResult, TrainStep
from detector.messages import first_line

logger = logging.getLogger(__name__)


@dataclass
class LoopState:
    """What the loop knows, shared with the hooks.

    Attributes:
        max_iter: iterations (optimizer steps) to train (``solver.max_iter``).
        iteration: iterations done.
        start_iter: ``iteration`` when this process started (0, or the resumed one).
        epoch: the current epoch of the data loader.
        epoch_position: loader batches of ``epoch`` already done (``accumulate_steps`` per
            iteration).
        step: the last ``TrainStep`` result (None before the first step).
        data_time: seconds spent waiting for the last batch.
        batch_images: images in the last iteration's micro-batches on this rank.
        stop_requested: set (to the reason, e.g. ``"SIGTERM"``) to stop after the next
            step; the step shares it across ranks, so ``step.stop`` is what stops.
        status: ``running``, then ``finished``, ``interrupted`` or ``failed``.
        error: the one-line error of a failed run.
        metrics: the last evaluation's metrics (set by the evaluation hook).
        early_stop: set by a hook (the evaluation hook's patience) to the one-line reason
            to end the run now; it ends as ``finished``.
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
    metrics: Dict[str, float] = field(default_factory=dict)
    early_stop: Optional[str] = None

    @property
    def stopping(self) -> bool:
        """Some rank asked to stop, and the loop will stop after this iteration."""
        return self.step is not None and self.step.stop and self.iteration < self.max_iter


class HookBase:
    """Base class: override any of the three methods. ``after_train`` is called once the
    loop ends, with ``state.status`` ``finished`` or ``interrupted``; when the loop or a
    hook's ``after_train`` (the final evaluation) raises, it is called with ``failed``
    (so a hook may see ``finished``, then ``failed``)."""

    def before_train(self, state: LoopState) -> None:
        pass

    def after_step(self, state: LoopState) -> None:
        pass

    def after_train(self, state: LoopState) -> None:
        pass


@dataclass
class TrainResult:
    """What ``Trainer.train`` returns. ``status``: ``finished`` or ``interrupted``;
    ``stop_reason``: what stopped an interrupted run (``SIGTERM``, ``SIGINT``, ...)."""

    iteration: int
    status: str
    metrics: Dict[str, float] = field(default_factory=dict)
    output_dir: Optional[Path] = None
    stop_reason: Optional[str] = None


class Trainer:
    """Runs the loop until ``state.max_iter`` or a stop signal.

    Args:
        model: the model ``step`` trains (DDP-wrapped under ``torchrun``).
        loader: the training loader; its ``batch_sampler`` has ``set_epoch`` and
            ``set_start`` (batches of an epoch to skip).
        step: one training iteration (``TrainStep``; ``GraphedTrainStep`` for ``train.cuda_graphs``).
        hooks: called in list order (see the module docstring).
        state: where to start (``LoopState(max_iter)``, or a resumed position).
        data_seed: seeds the loader's worker generator each epoch (with the epoch), so
            a resumed run draws the same worker seeds.
        rng_state: RNG states to restore once the first epoch's iterator exists (a
            resumed run, ``detector.engine.checkpointing.set_rng_state``).
        output_dir: reported in the ``TrainResult``.
        on_close: called by ``close()`` in order (writers, the run folder).
        accumulate_steps: loader batches (micro-batches) per optimizer step
            (``solver.accumulate_steps``); an iteration is one optimizer step.
        dist_info: the process's ``DistInfo``: with more than one rank, a step slow to
            complete (a rank that does not answer) is logged (``detector.distributed.watch``).
    """

    def __init__(self, model: nn.Module, loader: Any, step: TrainStep, hooks: Sequence[Any], state: LoopState,
                 data_seed: int = 0, rng_state: Optional[Dict[str, Any]] = None, output_dir: Optional[Path] = None,
                 on_close: Sequence[Callable[[], None]] = (), accumulate_steps: int = 1,
                 dist_info: Optional[Any] = None) -> None:
        self.model = model
        self.loader = loader
        self.step = step
        self.hooks: List[Any] = list(hooks)
        self.state = state
        self.data_seed = data_seed
        self.output_dir = output_dir
        self._pending_rng = rng_state
        self._on_close = list(on_close)
        self.accumulate_steps = int(accumulate_steps)
        self.dist_info = dist_info

    @property
    def model_without_ddp(self) -> nn.Module:
        return self.model.module if isinstance(self.model, nn.parallel.DistributedDataParallel) else self.model

    @property
    def iteration(self) -> int:
        return self.state.iteration

    @property
    def epoch(self) -> int:
        return self.state.epoch

    @property
    def epoch_position(self) -> int:
        return self.state.epoch_position

    def train(self) -> TrainResult:
        """Run until ``state.max_iter`` or a stop signal.

        Raises:
            NonFiniteLossError: too many non-finite losses in a row.
            EvaluationError: the final evaluation failed (the final checkpoint is saved).
            CheckpointWriteError: a checkpoint could not be written.
        """
        state = self.state
        state.start_iter = state.iteration
        logger.info("start training at iteration %d of %d (world size %d, device %s)",
                    state.iteration, state.max_iter, self.step.world_size, self.step.device)
        try:
            for hook in self.hooks:
                hook.before_train(state)
            self._loop(state)
            ended = state.iteration >= state.max_iter or state.early_stop is not None
            state.status = "finished" if ended else "interrupted"
            for hook in self.hooks:
                hook.after_train(state)
        except BaseException as exc:
            # Also a hook's own after_train (the final evaluation failing): every hook then
            # ends a failed run, as after a failure in the loop (the "stopped" record).
            state.status, state.error = "failed", first_line(exc)
            for hook in self.hooks:
                try:
                    hook.after_train(state)
                except Exception:  # noqa: BLE001 - the original error is the one to report
                    logger.debug("hook %s failed after an error", type(hook).__name__, exc_info=True)
            raise
        barrier(self.dist_info)
        return TrainResult(state.iteration, state.status, dict(state.metrics), self.output_dir,
                           state.stop_requested if state.status == "interrupted" else None)

    def _epoch_batches(self) -> Iterator[Any]:
        """Batches of the current epoch from the current position on."""
        batch_sampler = self.loader.batch_sampler
        batch_sampler.set_epoch(self.state.epoch)
        batch_sampler.set_start(self.state.epoch_position)
        if getattr(self.loader, "generator", None) is None:
            self.loader.generator = torch.Generator()
        # Worker seeds from a generator seeded by (data seed, epoch): the global RNG is
        # not consumed, and a resumed run draws the same.
        self.loader.generator.manual_seed((self.data_seed * 1000003 + self.state.epoch) % (2**63))
        return iter(self.loader)

    def _loop(self, state: LoopState) -> None:
        n_batches, n = len(self.loader), self.accumulate_steps
        if n_batches == 0:
            raise ValueError("the training loader yields no batches: check data.train and solver.images_per_gpu")
        if n_batches < n:
            raise ValueError(f"the training loader yields {n_batches} batches an epoch, fewer than "
                             f"solver.accumulate_steps={n}: lower solver.accumulate_steps or solver.images_per_gpu")
        while state.iteration < state.max_iter and state.early_stop is None:
            if state.epoch_position + n > n_batches:
                state.epoch, state.epoch_position = state.epoch + 1, 0
            batches = self._epoch_batches()
            if self._pending_rng is not None:  # after the iterator, as in the straight run
                set_rng_state(self._pending_rng)
                self._pending_rng = None
            while state.iteration < state.max_iter:
                micro = self._next_micro_batches(batches, state, n_batches)
                if micro is None:
                    break
                with watch(f"the training step of iteration {state.iteration + 1}", self.dist_info):
                    state.step = self.step.accumulate(micro, stop_requested=state.stop_requested is not None)
                state.iteration += 1
                state.epoch_position += len(micro)
                if state.step.stop and state.stop_requested is None:
                    state.stop_requested = "a signal to another rank"
                for hook in self.hooks:
                    hook.after_step(state)
                if state.stopping or state.early_stop is not None:
                    return
            if state.iteration < state.max_iter and state.epoch_position + n <= n_batches:
                logger.warning("epoch %d ended after %d of %d batches", state.epoch, state.epoch_position, n_batches)
                state.epoch_position = n_batches

    def _next_micro_batches(self, batches: Iterator[Any], state: LoopState, n_batches: int) -> Optional[List[Any]]:
        """The ``accumulate_steps`` batches of the next optimizer step, or None at the end of
        the epoch. The last ``n_batches mod accumulate_steps`` batches of an epoch are not
        used (not even loaded): an optimizer step never spans two epochs."""
        if state.epoch_position + self.accumulate_steps > n_batches:
            return None
        t0, micro = time.perf_counter(), []
        for _ in range(self.accumulate_steps):
            batch = next(batches, None)
            if batch is None:
                return None
            micro.append(batch)
        state.data_time = time.perf_counter() - t0
        state.batch_images = sum(len(images) for images, _ in micro)
        return micro

    def close(self) -> None:
        """Release what the builder handed over (``on_close``: writers, the run folder)
        and the loader's persistent workers."""
        close_loader = getattr(self.loader, "close", None)
        if close_loader is not None:
            close_loader()
        callbacks, self._on_close = self._on_close, []
        for close in callbacks:
            close()

