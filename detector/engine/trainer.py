"""The training loop: a ``TrainStep`` per iteration, then the hooks.

One ``Trainer`` per process. Under ``torchrun`` (or SLURM) every rank builds the same
model, wraps it in DDP (after SyncBN conversion) and reads its own shard of the data;
only rank 0 writes files. The step does the work of an iteration
(``detector.engine.step``); logging, checkpoints, evaluation, the non-finite guard and
signals are hooks (``detector.engine.hooks``); the run folder is locked and checked by
``detector.engine.run_folder``.

Checkpoints hold model, optimizer, scheduler, AMP scaler, iteration, epoch and the
batches done in it, every rank's python/numpy/torch RNG state, the best metric and the
config, so a resumed run continues the straight run exactly (data augmentation is a
function of seed, epoch and sample index, see docs/training.md).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional

import torch
from torch import nn

from detector.config import Config, config_to_dict, config_to_yaml, save_config
from detector.engine.amp import AmpSettings, resolve_amp
from detector.data import build_dataset, check_data_paths, resolve_num_classes
from detector.data.loader import build_train_loader
from detector.engine import checkpoint as ckpt
from detector.distributed import DistInfo, all_gather_object, barrier, init_distributed, seed_everything
from detector.engine.checkpointer import Checkpointer
from detector.engine.hooks import (  # noqa: F401 (NonFiniteLossError, EvaluationError: public here too)
    EvalHook,
    EvaluationError,
    EventWriters,
    HookBase,
    LoopState,
    MetricsWriter,
    NonFiniteGuard,
    NonFiniteLossError,
    PeriodicCheckpointer,
    SignalHook,
    log_detections,
)
from detector.engine.log import JSONLWriter, TensorBoardWriter
from detector.engine.optim import build_lr_scheduler, build_optimizer
from detector.engine.resume import load_training_state
from detector.engine.run_folder import RunFolder
from detector.engine.setup import apply_norm_policy, configure_torch, prepare_model  # noqa: F401 (apply_norm_policy: public here too)
from detector.engine.step import StepResult, TrainStep
from detector.evaluation import evaluate as default_evaluate
from detector.evaluation.tensorboard import write_report
from detector.messages import first_line
from detector.modeling import FasterRCNN, build_model
from detector.modeling.summary import default_image_size, format_summary, write_summary
from detector.modeling.weights import load_initial_weights

logger = logging.getLogger(__name__)

EvaluateFn = Callable[..., Dict[str, float]]


@dataclass
class TrainResult:
    """What ``Trainer.train`` returns. ``status``: ``finished`` or ``interrupted``."""

    iteration: int
    status: str
    metrics: Dict[str, float] = field(default_factory=dict)
    output_dir: Optional[Path] = None


class Trainer:
    """Train a detector as ``cfg`` says.

    Args:
        cfg: the resolved config.
        dist_info: from ``init_distributed``; None initialises from the environment.
        model: a model to train instead of ``build_model(cfg)`` (tests).
        train_loader: a loader instead of ``build_train_loader`` (its ``batch_sampler``
            must have ``set_epoch`` and ``set_start``).
        val_dataset: a dataset instead of ``build_dataset(cfg, "val", False)``.
        evaluate_fn: instead of ``detector.evaluation.evaluate``.
        resume: None/False: a fresh start (refused where checkpoints exist, unless
            ``overwrite``); True: continue the run folder's newest checkpoint, or start
            fresh when there is none; a path: continue from that file.
        overwrite: a fresh start deletes the checkpoints and records of the folder's run.
        run_folder: a folder already opened by the caller (``RunFolder.open``); by
            default the trainer opens (locks) ``train.output_dir`` until ``close()``.
    """

    def __init__(
        self,
        cfg: Config,
        dist_info: Optional[DistInfo] = None,
        model: Optional[nn.Module] = None,
        train_loader: Optional[Any] = None,
        val_dataset: Optional[Any] = None,
        evaluate_fn: Optional[EvaluateFn] = None,
        resume: "bool | str | os.PathLike | None" = None,
        overwrite: bool = False,
        run_folder: Optional[RunFolder] = None,
    ) -> None:
        if cfg.solver.max_iter <= 0:
            raise ValueError(f"solver.max_iter must be > 0, got {cfg.solver.max_iter}")
        self.cfg = cfg
        self.dist = dist_info or init_distributed(cfg.train.device, backend=cfg.train.dist_backend)
        self.device = self.dist.device
        self.rank, self.world_size = self.dist.rank, self.dist.world_size
        self.is_main = self.rank == 0
        self.output_dir = Path(cfg.train.output_dir)
        configure_torch(cfg)
        seed_everything(cfg.train.seed, self.rank)
        self._own_folder = run_folder is None
        self.folder = run_folder or RunFolder.open(self.output_dir, resume, overwrite, self.is_main, self.world_size)
        try:
            self._build(model, train_loader, val_dataset, evaluate_fn)
        except BaseException:
            self.close()
            raise

    def _build(self, model: Optional[nn.Module], train_loader: Any, val_dataset: Any, evaluate_fn: Any) -> None:
        cfg = self.cfg
        # Checked before the model is built: AMP for this device (float16 on a CPU is
        # refused), the data paths, and model.num_classes (auto: from the training set).
        self.amp: AmpSettings = resolve_amp(cfg.train.amp, self.device)
        train_set = None
        if train_loader is None:
            if val_dataset is None and cfg.train.eval_period >= 0:
                check_data_paths(cfg, "val")
            train_set = build_dataset(cfg, "train", True)
            cfg = self.cfg = resolve_num_classes(cfg, train_set)
        elif cfg.model.num_classes is None:
            cfg = self.cfg = resolve_num_classes(cfg)
        if model is None:
            model = build_model(cfg)
            if cfg.model.weights:
                load_initial_weights(model, cfg.model.weights)
        if self.is_main and isinstance(model, FasterRCNN):
            self._write_summary(model)
        self.model, self.model_without_ddp = prepare_model(model, cfg, self.device, self.world_size)
        self.optimizer = build_optimizer(self.model, cfg, self.world_size)
        self.scheduler = build_lr_scheduler(self.optimizer, cfg)
        self.step = TrainStep(self.model, self.optimizer, self.scheduler, self.amp, cfg.solver.clip_grad_norm, self.world_size)
        self.scaler = self.step.scaler
        if train_loader is None:
            train_loader = build_train_loader(cfg, train_set, self.rank, self.world_size)
        self.train_loader = train_loader
        self._val_dataset = val_dataset
        self._evaluate_fn = evaluate_fn or default_evaluate

        self.state = LoopState(max_iter=cfg.solver.max_iter)
        self.checkpointer = Checkpointer(self.output_dir, self.checkpoint_state, self.is_main, cfg.train.keep_last, self.world_size)
        self._pending_rng: Optional[Dict[str, Any]] = None
        best_value = None
        if self.folder.resume_from is not None:
            best_value = self._resume(self.folder.resume_from)

        self.writers = EventWriters()
        if self.is_main:
            save_config(cfg, self.output_dir / "config.yaml")
            self.writers.jsonl = JSONLWriter(self.output_dir / "metrics.jsonl")
            dropped = self.writers.jsonl.truncate_after(self.state.iteration)
            if dropped:
                logger.info("metrics.jsonl: dropped %d records past iteration %d", dropped, self.state.iteration)
            if cfg.train.tensorboard:
                purge = self.state.iteration + 1 if self.folder.resume_from is not None else None
                self.writers.tb = TensorBoardWriter(self.output_dir / "tb", purge_step=purge)
                self.writers.tb.text("config", "```\n" + config_to_yaml(cfg) + "\n```", self.state.iteration)

        self.eval_hook = EvalHook(
            self._evaluate, self.checkpointer, cfg.train.eval_period, cfg.train.best_metric, self.writers, best_value,
            eval_command=f"python tools/eval.py --config {self.output_dir / 'config.yaml'} --weights {{weights}}",
            is_main=self.is_main, world_size=self.world_size,
        )
        self.hooks: List[HookBase] = [
            NonFiniteGuard(cfg.train.max_nonfinite_steps, self.checkpointer, self.world_size),
            MetricsWriter(cfg.train.log_period, self.optimizer, self.writers, self.device, self.world_size, self.scaler,
                          progress_bar=self.is_main and _stderr_is_terminal(), is_main=self.is_main),
            PeriodicCheckpointer(self.checkpointer, cfg.train.checkpoint_period),
            self.eval_hook,  # after the checkpointer: the final checkpoint comes before the final evaluation
            # Last: its handlers stay until every other hook has ended. After a failure the other
            # hooks may wait on a lost peer, and torchrun's SIGTERM must not kill this rank
            # silently before it has reported the failure.
            SignalHook(),
        ]

    def _write_summary(self, model: FasterRCNN) -> None:
        """Rank 0: parameters per module, FLOPs of one test-size image and the weights
        size, logged once and written to ``summary.json`` next to ``config.yaml``. Runs
        before the model is moved, compiled or wrapped (the counts do not depend on it);
        the global RNG is not used. A failure is a warning: training goes on."""
        path = self.output_dir / "summary.json"
        try:
            summary = write_summary(model, default_image_size(self.cfg), path)
        except (RuntimeError, ValueError, OSError) as exc:
            logger.warning("model summary skipped: %s", first_line(exc))
            return
        logger.info("model summary (%s):\n%s", path, format_summary(summary))

    # ------------------------------------------------------------------ state

    @property
    def iteration(self) -> int:
        return self.state.iteration

    @property
    def epoch(self) -> int:
        return self.state.epoch

    @property
    def epoch_position(self) -> int:
        return self.state.epoch_position

    def checkpoint_state(self) -> Dict[str, Any]:
        """Everything needed to resume, as tensors and plain data (every rank calls it:
        the RNG states are gathered)."""
        rng = ckpt.get_rng_state()
        per_rank = all_gather_object(rng) if self.world_size > 1 else [rng]
        eval_hook = getattr(self, "eval_hook", None)
        return {
            "model": self.model_without_ddp.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler.is_enabled() else {},
            "iteration": self.state.iteration,
            "epoch": self.state.epoch,
            "epoch_position": self.state.epoch_position,
            "best_value": eval_hook.best_value if eval_hook is not None else None,
            "best_metric": self.cfg.train.best_metric,
            "rng": {"per_rank": per_rank},
            "config": config_to_dict(self.cfg),
            "world_size": self.world_size,
        }

    def _resume(self, path: Path) -> Optional[float]:
        """Load the training state of ``path``; returns its best metric value."""
        state = load_training_state(path, self.model_without_ddp, self.optimizer, self.scheduler, self.scaler, self.cfg)
        self.state.iteration = int(state["iteration"])
        self.state.epoch = int(state.get("epoch", 0))
        self.state.epoch_position = int(state.get("epoch_position", 0))
        per_rank = (state.get("rng") or {}).get("per_rank") or []
        if len(per_rank) != self.world_size:
            logger.warning("resume: checkpoint written by %d ranks, now %d; RNG streams restart", len(per_rank), self.world_size)
        self._pending_rng = per_rank[self.rank] if self.rank < len(per_rank) else None
        self.checkpointer.register_existing(path, self.state.iteration)
        logger.info("resumed from %s at iteration %d (epoch %d, batch %d)", path, self.state.iteration,
                    self.state.epoch, self.state.epoch_position)
        return state.get("best_value")

    def run_step(self, images: List[torch.Tensor], targets: List[Dict[str, Any]]) -> StepResult:
        """One training iteration outside the loop (used by the benchmark): ``self.step``."""
        return self.step(images, targets)

    # ------------------------------------------------------------------ evaluation

    def _evaluate(self, iteration: int) -> Dict[str, float]:
        """Evaluate on the val split (every rank takes part); metrics on rank 0."""
        model = self.model_without_ddp
        try:
            if self._val_dataset is None:
                self._val_dataset = build_dataset(self.cfg, "val", False)
            out = self.output_dir / "eval" / f"iter_{iteration:07d}"
            metrics = self._evaluate_fn(model, self._val_dataset, self.cfg, output_dir=out if self.is_main else None)
            report = getattr(metrics, "report", None)  # per-class curves (detector.evaluation.evaluate)
            if self.is_main and self.writers.tb is not None and report is not None:
                write_report(self.writers.tb.writer, report, iteration)
            if self.is_main and self.writers.tb is not None and self.cfg.train.vis_images > 0:
                log_detections(model, self._val_dataset, self.writers.tb, iteration, self.cfg.train.vis_images,
                               self.cfg.eval.score_thresh, dataclasses.replace(self.amp, enabled=self.amp.enabled and self.cfg.eval.amp))
        finally:
            model.train()
        return metrics or {}

    # ------------------------------------------------------------------ the loop

    def _epoch_batches(self) -> Iterator[Any]:
        """Batches of the current epoch from the current position on."""
        batch_sampler = self.train_loader.batch_sampler
        batch_sampler.set_epoch(self.state.epoch)
        batch_sampler.set_start(self.state.epoch_position)
        if getattr(self.train_loader, "generator", None) is None:
            self.train_loader.generator = torch.Generator()
        # Worker seeds from a generator seeded by (seed, rank, epoch): the global RNG is
        # not consumed, and a resumed run draws the same.
        seed = ((self.cfg.train.seed * 1000003 + self.rank) * 1000003 + self.state.epoch) % (2**63)
        self.train_loader.generator.manual_seed(seed)
        return iter(self.train_loader)

    def train(self) -> TrainResult:
        """Run until ``solver.max_iter`` or a stop signal.

        Raises:
            NonFiniteLossError: too many non-finite losses in a row.
            EvaluationError: the final evaluation failed (the final checkpoint is saved).
            CheckpointWriteError: a checkpoint could not be written.
        """
        state = self.state
        state.start_iter = state.iteration
        logger.info("start training at iteration %d of %d (world size %d, device %s)",
                    state.iteration, state.max_iter, self.world_size, self.device)
        try:
            for hook in self.hooks:
                hook.before_train(state)
            self._loop(state)
            state.status = "interrupted" if state.iteration < state.max_iter else "finished"
        except BaseException as exc:
            state.status, state.error = "failed", first_line(exc)
            for hook in self.hooks:
                try:
                    hook.after_train(state)
                except Exception:  # noqa: BLE001 - the original error is the one to report
                    logger.debug("hook %s failed after an error", type(hook).__name__, exc_info=True)
            raise
        for hook in self.hooks:
            hook.after_train(state)
        barrier()
        if state.status == "interrupted":
            logger.warning("stopped by %s at iteration %d; resume with --resume (checkpoint %s)",
                           state.stop_requested or "a signal", state.iteration, self.checkpointer.newest)
        return TrainResult(state.iteration, state.status, dict(self.eval_hook.last_metrics), self.output_dir)

    def _loop(self, state: LoopState) -> None:
        n_batches = len(self.train_loader)
        if n_batches == 0:
            raise ValueError("the training loader yields no batches: check data.train and solver.images_per_gpu")
        while state.iteration < state.max_iter:
            if state.epoch_position >= n_batches:
                state.epoch, state.epoch_position = state.epoch + 1, 0
            batches = self._epoch_batches()
            if self._pending_rng is not None:  # after the iterator, as in the straight run
                ckpt.set_rng_state(self._pending_rng)
                self._pending_rng = None
            while state.iteration < state.max_iter:
                t0 = time.perf_counter()
                batch = next(batches, None)
                if batch is None:
                    break
                images, targets = batch
                state.data_time, state.batch_images = time.perf_counter() - t0, len(images)
                state.step = self.step(images, targets, stop_requested=state.stop_requested is not None)
                state.iteration += 1
                state.epoch_position += 1
                if state.step.stop and state.stop_requested is None:
                    state.stop_requested = "a signal to another rank"
                for hook in self.hooks:
                    hook.after_step(state)
                if state.stopping:
                    return
            if state.iteration < state.max_iter and state.epoch_position < n_batches:
                logger.warning("epoch %d ended after %d of %d batches", state.epoch, state.epoch_position, n_batches)
                state.epoch_position = n_batches

    def close(self) -> None:
        """Close the writers and release the run folder (if this trainer opened it)."""
        writers = getattr(self, "writers", None)
        if writers is not None and writers.tb is not None:
            writers.tb.close()
            writers.tb = None
        if self._own_folder and self.folder is not None:
            self.folder.close()


def _stderr_is_terminal() -> bool:
    return sys.stderr.isatty()


def train(cfg: Config, resume: "bool | str | None" = None, overwrite: bool = False,
          dist_info: Optional[DistInfo] = None, run_folder: Optional[RunFolder] = None) -> TrainResult:
    """Build everything from ``cfg`` and train; the entry point of tools/train.py."""
    trainer = Trainer(cfg, dist_info=dist_info, resume=resume, overwrite=overwrite, run_folder=run_folder)
    try:
        return trainer.train()
    finally:
        trainer.close()
