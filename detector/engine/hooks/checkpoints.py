"""``PeriodicCheckpointer``: the periodic, final and on-stop checkpoints."""

from __future__ import annotations

import logging

from detector.engine.checkpointing import Checkpointer, numbered_checkpoint_name
from detector.engine.train_loop import HookBase, LoopState

logger = logging.getLogger(__name__)


class PeriodicCheckpointer(HookBase):
    """``iter_N.pth`` and ``last.pth`` every ``period`` iterations (``<= 0``: none); at
    the end of a finished run the final ``iter_N.pth`` + ``last.pth``, and on a stop
    ``last.pth``, and then says where to resume from. As the hook before ``EvalHook``,
    it writes the final checkpoint before the final evaluation."""

    def __init__(self, checkpointer: Checkpointer, period: int) -> None:
        self.checkpointer = checkpointer
        self.period = period

    def after_step(self, state: LoopState) -> None:
        if state.step is not None and state.step.nonfinite:
            return  # the state of a skipped step: keep the older checkpoints rather than prune them
        if self.period > 0 and state.iteration % self.period == 0 and state.iteration < state.max_iter:
            self.checkpointer.save([numbered_checkpoint_name(state.iteration), "last.pth"], state.iteration)

    def after_train(self, state: LoopState) -> None:
        if self.checkpointer.saved.get("last.pth") != state.iteration:  # else this state is saved already
            if state.status == "finished":
                self.checkpointer.save([numbered_checkpoint_name(state.iteration), "last.pth"], state.iteration)
            elif state.status == "interrupted":
                self.checkpointer.save(["last.pth"], state.iteration)
        if state.status == "interrupted":
            logger.warning("stopped by %s at iteration %d; resume with --resume (checkpoint %s)",
                           state.stop_requested or "a signal", state.iteration, self.checkpointer.newest)
