"""Hooks of the training loop, one concern and one module each (detectron2's
``HookBase`` spirit; ``HookBase`` and ``LoopState`` are in ``detector.engine.train_loop``).

The loop (``detector.engine.train_loop.Trainer``) calls, for every hook in list order,
``before_train(state)`` once, ``after_step(state)`` after every iteration and
``after_train(state)`` once at the end (also after an error, with
``state.status == "failed"``). ``state`` is the ``LoopState`` the loop updates; a
hook reads it and may set ``stop_requested``.

The order ``detector.engine.trainer.build_trainer`` gives them, and why:

1. ``NonFiniteGuard`` (``nonfinite.py``): stops the run after
   ``train.max_nonfinite_steps`` skipped steps in a row, naming the newest finite checkpoint.
2. ``MetricsWriter`` (``metrics.py``): losses, LRs, timings to the console (a progress
   bar in a terminal), ``metrics.jsonl`` and TensorBoard.
3. ``PeriodicCheckpointer`` (``checkpoints.py``): ``iter_N.pth`` + ``last.pth`` every
   period; at the end the final checkpoint (or ``last.pth`` on a stop) BEFORE the final
   evaluation.
4. ``EvalHook`` (``evaluation.py``): evaluation every period and at the end,
   ``best.pth``; a failing evaluation is one error line naming the checkpoint to
   evaluate later.
5. ``SignalHook`` (``signals.py``): SIGTERM/SIGINT ask the loop to stop after the
   current iteration (read by the step at the start of the next one). Last, so that its
   handlers stay until every other hook has ended: after a failure the others may wait
   on a lost peer, and torchrun's SIGTERM must not end the rank before it reports the
   failure.

Collectives: hooks that reduce or gather across ranks (metrics, checkpoints, best
model) run on every rank at the same iterations, so the ranks stay in step.
"""

from detector.engine.hooks.checkpoints import PeriodicCheckpointer
from detector.engine.hooks.ema import EMAHook, PairedValidator
from detector.engine.hooks.evaluation import EvalHook, EvaluationError, Validator, log_detections
from detector.engine.hooks.metrics import MetricsWriter
from detector.engine.hooks.nonfinite import NonFiniteGuard, NonFiniteLossError
from detector.engine.hooks.signals import SignalHook

__all__ = [
    "EMAHook",
    "PairedValidator",
    "EvalHook",
    "EvaluationError",
    "MetricsWriter",
    "NonFiniteGuard",
    "NonFiniteLossError",
    "PeriodicCheckpointer",
    "SignalHook",
    "Validator",
    "log_detections",
]
