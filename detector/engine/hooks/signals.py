"""``SignalHook``: SIGTERM / SIGINT stop the run after the current iteration."""

from __future__ import annotations

import logging
import os
import signal
import threading
from typing import Any, Dict

from detector.engine.train_loop import HookBase, LoopState

logger = logging.getLogger(__name__)


class SignalHook(HookBase):
    """SIGTERM / SIGINT: stop after the current iteration (the checkpointer then writes
    ``last.pth``). A second signal raises ``KeyboardInterrupt`` at once; so does a signal
    once the loop has ended (``_as_outside_the_loop``: during the final evaluation). A
    SIGTERM while the run ends after an error changes nothing: the error is reported.
    Handlers are installed only in the main thread and restored at the end. Forked data-loader
    workers inherit the handlers and get the terminal's Ctrl-C too: there the handler
    does nothing (the main process stops them), so a signal is logged once."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self._previous: Dict[int, Any] = {}

    def before_train(self, state: LoopState) -> None:
        if threading.current_thread() is not threading.main_thread():
            return

        owner = os.getpid()

        def handler(signum: int, frame: Any) -> None:
            if os.getpid() != owner:  # a forked worker
                return
            if state.status == "finished":
                self._as_outside_the_loop(signum, frame)
                return
            if state.status == "failed" and signum == signal.SIGTERM:
                # The run is ending with an error, which the tool reports next (a lost peer:
                # torchrun's SIGTERM to the survivors comes now). Nothing is left to stop.
                logger.debug("received SIGTERM while ending after an error: %s", state.error)
                return
            if state.stop_requested is not None:
                raise KeyboardInterrupt
            state.stop_requested = signal.Signals(signum).name
            logger.warning("received %s: stopping after this iteration and saving a checkpoint", state.stop_requested)

        for sig in self.SIGNALS:
            self._previous[sig] = signal.signal(sig, handler)

    def _as_outside_the_loop(self, signum: int, frame: Any) -> None:
        """A signal after the loop ended (the final checkpoint is written; the final
        evaluation may be running): no iteration is left to stop after, so it does what
        it does outside the loop: the previous handler (a tool's: ``error: stopped by
        SIGTERM``, 143), Ctrl-C's ``KeyboardInterrupt``, or the default action (one of
        several ranks). It was only logged, and the evaluation ran on to exit 0."""
        previous = self._previous.get(signum)
        if callable(previous):
            previous(signum, frame)
        elif previous == signal.SIG_IGN:
            return
        elif signum == signal.SIGINT:
            raise KeyboardInterrupt
        else:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    def after_train(self, state: LoopState) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()
