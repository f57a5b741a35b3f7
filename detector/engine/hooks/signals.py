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
    ``last.pth``). A second signal raises ``KeyboardInterrupt`` at once. Handlers are
    installed only in the main thread and restored at the end. Forked data-loader
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
