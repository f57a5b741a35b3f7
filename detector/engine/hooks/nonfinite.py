"""``NonFiniteGuard``: warns at each skipped non-finite step and stops a run that keeps
failing, naming the checkpoint to resume from."""

from __future__ import annotations

import logging
from typing import Optional

import torch
from torch import Tensor

from detector.distributed import all_gather_object
from detector.engine.checkpointing import Checkpointer
from detector.engine.train_loop import HookBase, LoopState
from detector.messages import DetectorError

logger = logging.getLogger(__name__)


class NonFiniteLossError(DetectorError, RuntimeError):
    """``train.max_nonfinite_steps`` non-finite losses in a row: one line."""


class NonFiniteGuard(HookBase):
    """Warns at each non-finite step (skipped by ``TrainStep``) and stops the run after
    ``max_in_row`` in a row with ``NonFiniteLossError``, naming the checkpoint to resume
    from. That is the newest finite checkpoint holding a state at least two iterations
    before the first failing step: resuming from the state just before it would
    repeat the same forward pass on the same batch, whatever the LR. Failing that, the
    newest finite checkpoint; failing that, the current state is saved if it is finite
    (the skipped steps did not change the weights).

    A run whose every step was skipped, fewer than ``max_in_row`` of them (a short run,
    or a resumed one near ``solver.max_iter``), stops the same way at its last step:
    it trained nothing, and must not end as ``finished``.

    A step that decides on the device (``train.cuda_graphs``: ``StepResult.nonfinite_flag``)
    is counted on the device: the run of skipped steps in a row, and the iteration where
    it first reached ``max_in_row``. Those are read every ``period`` iterations (the
    logging points, ``train.log_period``) and at the end, so the stop comes at the next
    logging point; the skipped steps in between changed nothing."""

    def __init__(self, max_in_row: int, checkpointer: Checkpointer, world_size: int = 1, period: int = 1) -> None:
        if max_in_row <= 0:
            raise ValueError(f"train.max_nonfinite_steps must be > 0, got {max_in_row}")
        self.max_in_row = max_in_row
        self.checkpointer = checkpointer
        self.world_size = world_size
        self.period = max(1, int(period))
        self.in_row = 0
        # Device counters: [iteration, skipped in a row, iteration the limit was reached (-1: not), window skips]
        self._counters: Optional[Tensor] = None

    def after_step(self, state: LoopState) -> None:
        step = state.step
        flag = getattr(step, "nonfinite_flag", None)  # (a float16 overflow is no non-finite step)
        if flag is not None:
            self._count_on_device(flag, state)
            return
        if step is None or not step.nonfinite:
            self.in_row = 0
            return
        self.in_row += 1
        values = ", ".join(f"{k}={v:.4g}" for k, v in zip(step.loss_names, step.losses.tolist()))
        logger.warning("iteration %d: non-finite loss or gradient (%s); step skipped (%d in a row)",
                       state.iteration, values, self.in_row)
        if self.in_row >= self.max_in_row:
            raise self._stopped(state.iteration, state.iteration, f"at iteration {state.iteration}")
        if self._nothing_trained(state, self.in_row):
            raise self._stopped(state.iteration, state.iteration, f"at iteration {state.iteration}", self.in_row)

    def _count_on_device(self, flag: Tensor, state: LoopState) -> None:
        """Update the device counters with this step's ``flag``; at a logging point read
        them, warn about the skipped steps and stop when the limit was reached."""
        if self._counters is None:
            self._counters = torch.tensor([state.iteration - 1, 0.0, -1.0, 0.0], device=flag.device)
        it, row, reached, window = self._counters.unbind()
        it.add_(1)
        row.add_(1).mul_(flag)
        reached.copy_(torch.where((row >= self.max_in_row) & (reached < 0), it, reached))
        window.add_(flag)
        if state.iteration % self.period and state.iteration < state.max_iter and not state.stopping:
            return
        _, row, at, skipped = self._counters.tolist()  # the read-back of a logging point
        window.zero_()
        if skipped:
            logger.warning("iterations up to %d: %d non-finite steps skipped (loss or gradient not finite)",
                           state.iteration, int(skipped))
        if at >= 0:
            raise self._stopped(int(at), state.iteration, f"at iteration {int(at)}, seen at iteration {state.iteration}")
        if self._nothing_trained(state, int(row)):
            raise self._stopped(state.iteration, state.iteration, f"at iteration {state.iteration}", int(row))

    @staticmethod
    def _nothing_trained(state: LoopState, in_row: int) -> bool:
        """This is the run's last step, and every step of this process was skipped."""
        done = state.iteration - state.start_iter
        return state.iteration >= state.max_iter and 0 < done <= in_row

    def _stopped(self, reached_at: int, iteration: int, when: str, every: int = 0) -> NonFiniteLossError:
        """The one-line stop: ``max_in_row`` skipped steps ending at ``reached_at`` (or,
        with ``every`` > 0, all ``every`` steps of this run), noticed at ``iteration``
        (``when`` says both), with the checkpoint to resume from."""
        k = self.max_in_row
        what = (f"all {every} steps of this run had a non-finite loss or gradient and were skipped "
                "(nothing was trained)" if every else f"{k} non-finite losses in a row (train.max_nonfinite_steps={k})")
        return NonFiniteLossError(
            f"{what} {when}; stopped; "
            f"{self._resume_point(reached_at - (every or k) + 1, iteration)}. "
            "Lower solver.lr, enable solver.clip_grad_norm, or check the data"
        )

    def _resume_point(self, first_bad: int, iteration: int) -> str:
        # Rank 0 sees the files; every rank must take the same branch (save is collective).
        found = self.checkpointer.newest_at_most(first_bad - 2)
        if self.world_size > 1:
            found = all_gather_object(found)[0]
        if found is not None:
            return f"resume from the newest finite checkpoint before the failing steps: {found[0]} (iteration {found[1]})"
        ck = self.checkpointer
        if ck.newest is None and ck.save(["last.pth"], iteration) is not None:
            return f"the weights before the failing steps are saved in {ck.newest} (iteration {ck.newest_iteration})"
        if ck.newest is not None:
            return f"newest finite checkpoint: {ck.newest} (iteration {ck.newest_iteration})"
        return "no finite checkpoint was written (the weights were not finite)"
