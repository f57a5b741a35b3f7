"""Building a training run from the config: ``train(cfg)`` and ``build_trainer(cfg)``.

``train(cfg)``, the entry point of tools/train.py, builds a ``Trainer`` with
``build_trainer`` and runs it. ``build_trainer`` reads top-down, one piece after the
other, each made by a plain call into the module that owns it:

1. the process: distributed info, torch flags, seeds, the run folder (locked and
   checked, ``detector.engine.run_folder``);
2. the data: AMP settings for the device, the val paths, the training set,
   ``model.num_classes`` and the class names, and the val set where evaluation is on
   (all checked before the model is built);
3. the model (initial weights, a summary on rank 0), prepared for the device (SyncBN,
   DDP: ``detector.engine.setup``), the optimizer and LR schedule
   (``detector.engine.optim``), the training step (``detector.engine.step_choice``) and the training loader;
4. checkpointing (``detector.engine.checkpointing``) and, with ``--resume``, the
   restored state;
5. the run's records (``config.yaml``, ``metrics.jsonl``, TensorBoard) and the hooks
   (``detector.engine.hooks``);
6. ``Trainer(model, loader, step, hooks, state)`` (``detector.engine.train_loop``),
   which only runs the loop.

One ``Trainer`` per process. Under ``torchrun`` (or SLURM) every rank builds the same
model, wraps it in DDP and reads its own shard of the data; only rank 0 writes files.
A resumed run continues the straight run exactly (data augmentation is a function of
seed, epoch and sample index, see docs/training.md).
"""

from __future__ import annotations

import logging
import os
import sys
import zlib
from pathlib import Path
from typing import Any, Callable, List, Optional, Tuple

from torch import nn

from detector.config import Config, config_to_yaml, save_config
from detector.data import (DataError, build_dataset, check_data_paths, check_val_classes, first_other_label,
                           resolve_class_names, resolve_num_classes)
from detector.data.canvases import check_canvases, warn_of_evaluation_canvases
from detector.data.loader import build_train_loader
from detector.distributed import DistInfo, all_gather_object, init_distributed, seed_everything
from detector.engine.amp import AmpSettings, resolve_amp
from detector.engine.checkpointing import Checkpointer, TrainingState
from detector.engine.hooks import (EMAHook, EvalHook, MetricsWriter, NonFiniteGuard, PairedValidator,
                                   PeriodicCheckpointer, SignalHook, Validator)
from detector.engine.early_stop import EarlyStopping, check_best_metric
from detector.engine.ema import ModelEMA
from detector.engine.memory import check_batch_memory
from detector.engine.log import DeviceCounter, EventWriters, JSONLWriter, TensorBoardWriter
from detector.engine.resume import ResumePoint, resume_training
from detector.engine.optim import build_lr_scheduler, build_optimizer, resolve_epoch_schedule
from detector.engine.run_folder import (RunFolder, check_output_dir, check_overwrite_keeps_weights,
                                        check_run_folder_apart_from_data)
from detector.engine.setup import configure_torch, prepare_model
from detector.engine.static_step import StaticForward
from detector.engine.step_choice import build_train_step
from detector.engine.train_loop import HookBase, LoopState, Trainer, TrainResult
from detector.messages import first_line
from detector.modeling import FasterRCNN, build_model
from detector.modeling.summary import default_image_size, format_summary, write_summary
from detector.modeling.weights import load_initial_weights

logger = logging.getLogger(__name__)


def train(cfg: Config, resume: "bool | str | None" = None, overwrite: bool = False,
          dist_info: Optional[DistInfo] = None, run_folder: Optional[RunFolder] = None) -> TrainResult:
    """Build everything from ``cfg`` and train; the entry point of tools/train.py."""
    trainer = build_trainer(cfg, dist_info=dist_info, resume=resume, overwrite=overwrite, run_folder=run_folder)
    try:
        return trainer.train()
    finally:
        trainer.close()


def build_trainer(
    cfg: Config,
    dist_info: Optional[DistInfo] = None,
    resume: "bool | str | os.PathLike | None" = None,
    overwrite: bool = False,
    run_folder: Optional[RunFolder] = None,
    eager_static: bool = False,
) -> Trainer:
    """Build the training run ``cfg`` describes (see the module docstring).

    Args:
        cfg: the resolved config.
        dist_info: from ``init_distributed``; None initialises from the environment.
        resume: None/False: a fresh start (refused where checkpoints exist, unless
            ``overwrite``); True: continue the run folder's newest checkpoint, or start
            fresh when there is none; a path: continue from that file.
        overwrite: a fresh start deletes the checkpoints and records of the folder's run.
        run_folder: a folder already opened by the caller (``RunFolder.open``); by
            default ``train.output_dir`` is opened (locked) until ``Trainer.close()``.
        eager_static: run ``train.static_step`` uncompiled and ``train.cuda_graphs``
            uncaptured: the same step, eagerly, on any device (to debug it; the CPU
            tests of the captured step's wiring).
    """
    if cfg.solver.max_iter <= 0 and cfg.solver.max_epochs <= 0:
        raise ValueError(f"solver.max_iter must be > 0 (or solver.max_epochs), got {cfg.solver.max_iter}")
    check_best_metric(cfg)
    dist = dist_info or init_distributed(cfg.train.device, backend=cfg.train.dist_backend,
                                         timeout_s=cfg.train.dist_timeout_s)
    configure_torch(cfg, dist.device)
    seed_everything(cfg.train.seed, dist.rank)
    if run_folder is None:
        check_output_dir(cfg.train.output_dir)
        check_run_folder_apart_from_data(cfg)
        check_overwrite_keeps_weights(cfg, overwrite)
    folder = run_folder or RunFolder.open(Path(cfg.train.output_dir), resume, overwrite, dist.rank == 0,
                                          dist.world_size)
    on_close: List[Callable[[], None]] = [folder.close] if run_folder is None else []
    try:
        return _build_in_folder(cfg, dist, folder, on_close, eager_static)
    except BaseException:
        for close in reversed(on_close):
            close()
        raise


def _build_in_folder(cfg: Config, dist: DistInfo, folder: RunFolder, on_close: List[Callable[[], None]],
                     eager_static: bool = False) -> Trainer:
    """Steps 2-6 of the module docstring, in the run folder this process holds.
    ``on_close`` gets the writers to close (before the folder is released)."""
    is_main, output_dir = dist.rank == 0, Path(cfg.train.output_dir)
    amp = resolve_amp(cfg.train.amp, dist.device)  # float16 on a CPU is refused before anything is built
    # A batch that cannot fit is refused before anything is built (ranks on the CPU share the host's memory).
    check_batch_memory(cfg, dist.device, dist.local_world_size if dist.device.type == "cpu" else 1)
    cfg, train_set, val_set = _training_data(cfg)
    _check_one_training_set(train_set, dist)
    check_canvases(cfg, train_set)  # the static step: every batch the loader can form fits a canvas
    if val_set is not None and is_main:
        warn_of_evaluation_canvases(cfg, val_set)  # train.compile_backbone: evaluation batches too
    loader = build_train_loader(cfg, train_set, dist.rank, dist.world_size)
    cfg = resolve_epoch_schedule(cfg, len(loader))  # before the scheduler, config.yaml and checkpoints
    model = _initial_model(cfg, output_dir, is_main, list(train_set.class_names))
    model, model_without_ddp = prepare_model(model, cfg, dist.device, dist.world_size)
    optimizer = build_optimizer(model, cfg, dist.world_size)
    scheduler = build_lr_scheduler(optimizer, cfg)
    step = build_train_step(cfg, model, model_without_ddp, optimizer, scheduler, amp, dist.world_size, eager_static)
    static = step.forward if isinstance(step.forward, StaticForward) else None

    state = LoopState(max_iter=cfg.solver.max_iter)
    training_state = TrainingState(model_without_ddp, optimizer, scheduler, step.scaler, state, cfg, dist.world_size)
    checkpointer = Checkpointer(output_dir, training_state, is_main, cfg.train.keep_last, dist.world_size)
    resumed: Optional[ResumePoint] = None
    if folder.resume_from is not None:
        resumed = resume_training(folder.resume_from, training_state, checkpointer, dist.rank, len(loader))
        state.iteration, state.epoch, state.epoch_position = resumed.iteration, resumed.epoch, resumed.epoch_position

    folder.clear_previous_run()  # built and checked: the old run's files may go
    writers = _open_run_records(cfg, output_dir, state.iteration, resumed is not None, is_main)
    on_close.insert(0, writers.close)
    ema = _build_ema(cfg, model_without_ddp, training_state, resumed)
    eval_hook = _build_eval_hook(cfg, dist, model_without_ddp, ema, amp, writers, checkpointer, resumed, val_set)
    training_state.extras["early_stop"] = eval_hook.early_stop_state
    training_state.best = eval_hook  # checkpoints record its best value
    hooks = ([EMAHook(ema, model_without_ddp)] if ema is not None else []) + \
        _build_hooks(cfg, dist, checkpointer, writers, step, eval_hook, static.counters() if static else [])
    return Trainer(model, loader, step, hooks, state, data_seed=cfg.train.seed * 1000003 + dist.rank,
                   accumulate_steps=cfg.solver.accumulate_steps,
                   rng_state=resumed.rng_state if resumed is not None else None, output_dir=output_dir,
                   on_close=on_close, dist_info=dist)


def _build_ema(cfg: Config, model: nn.Module, training_state: TrainingState,
               resumed: Optional[ResumePoint]) -> Optional[ModelEMA]:
    """The weights' moving average (``train.ema``), restored from a resumed checkpoint;
    registered with the checkpoints. None where it is off."""
    if not cfg.train.ema.enabled:
        return None
    ema = ModelEMA(model, cfg.train.ema.decay, cfg.train.ema.warmup)
    stored = (resumed.extras or {}).get("ema") if resumed is not None else None
    if stored is not None:
        ema.load_state_dict(stored)
    elif resumed is not None:
        logger.warning("train.ema: the checkpoint holds no EMA weights; the average starts from the resumed weights")
    training_state.extras["ema"] = ema.state_dict
    return ema


def _build_eval_hook(cfg: Config, dist: DistInfo, model: nn.Module, ema: Optional[ModelEMA], amp: AmpSettings,
                     writers: EventWriters, checkpointer: Checkpointer, resumed: Optional[ResumePoint],
                     val_set: Any) -> EvalHook:
    """``EvalHook`` on the raw or (``eval.use_ema``) the EMA weights, the other ones
    evaluated alongside (``raw/`` or ``ema/`` metrics), on ``val_set``; early stopping
    restored."""
    is_main, output_dir = dist.rank == 0, Path(cfg.train.output_dir)
    main_model = ema.module if ema is not None and cfg.eval.use_ema else model
    evaluate: Any = Validator(main_model, cfg, amp, writers, output_dir, is_main, dataset=val_set)
    if ema is not None:
        other, prefix = (model, "raw") if cfg.eval.use_ema else (ema.module, "ema")
        evaluate = PairedValidator(evaluate, Validator(other, cfg, amp, writers, output_dir, is_main, dataset=val_set,
                                                       eval_name=f"eval_{prefix}", draw=False), prefix)
    early_stopping = EarlyStopping(cfg.train.best_metric, cfg.train.early_stop.patience, cfg.train.early_stop.min_delta)
    early_stopping.load_state_dict((resumed.extras or {}).get("early_stop") if resumed is not None else None)
    return EvalHook(
        evaluate, checkpointer, cfg.train.eval_period,
        cfg.train.best_metric, writers, resumed.best_value if resumed is not None else None,
        eval_command=f"python tools/eval.py --config {output_dir / 'config.yaml'} --weights {{weights}}",
        is_main=is_main, world_size=dist.world_size, early_stopping=early_stopping,
    )


def _training_data(cfg: Config) -> Tuple[Config, Any, Any]:
    """Checks the val paths (where evaluation is on), builds the training set and
    resolves ``model.num_classes`` (auto: from the training set) and the class names
    (the training set's, so that the val set is read by name: ``data.classes``). Where
    evaluation is on, the val set is built too, so that its faults (a val file whose
    labels would name other classes, a bad annotation) stop the run before any work
    rather than at the first evaluation. Returns ``(cfg with num_classes and class
    names, training set, val set or None)``."""
    evaluates = cfg.train.eval_period >= 0
    if evaluates:
        check_data_paths(cfg, "val")
    train_set = build_dataset(cfg, "train", True)
    cfg = resolve_class_names(resolve_num_classes(cfg, train_set), train_set)
    if not evaluates:
        return cfg, train_set, None
    check_val_classes(cfg, train_set)
    return cfg, train_set, build_dataset(cfg, "val", False)


def _check_one_training_set(train_set: Any, dist: DistInfo) -> None:
    """Every rank reads the same training set (the sampler splits one set's indices): a
    rank whose copy differs (node-local data) trained on silently, or converted an epoch
    schedule to another ``max_iter`` and waited on the others until the timeout.

    Raises:
        DataError: one line naming the first rank that differs from rank 0.
    """
    if dist.world_size <= 1:
        return
    a = train_set.records.arrays
    mine = (len(train_set), int(len(a["boxes"])), zlib.crc32(a["image_ids"].tobytes()))
    seen = all_gather_object(mine)
    other = next((r for r, s in enumerate(seen) if s != seen[0]), None)
    if other is not None:
        raise DataError(f"data.train: rank {other} reads another training set than rank 0 ({seen[other][0]} images, "
                        f"{seen[other][1]} boxes against {seen[0][0]} and {seen[0][1]}, or other image ids): every rank "
                        "must read the same set (the sampler splits it); check data.train on every node")


def _initial_model(cfg: Config, output_dir: Path, is_main: bool, class_names: List[str]) -> FasterRCNN:
    """``build_model(cfg)`` with ``model.weights`` loaded; rank 0 logs its summary.
    ``class_names``: the training set's, label 1..K (``_warn_other_classes``)."""
    model = build_model(cfg)
    if cfg.model.weights:
        report = load_initial_weights(model, cfg.model.weights)
        if is_main:
            _warn_other_classes(report.trained_classes, class_names, cfg.model.weights)
    if is_main:
        _write_summary(model, cfg, output_dir)
    return model


def _warn_other_classes(trained: List[str], class_names: List[str], source: str) -> None:
    """One warning when ``model.weights`` is a checkpoint of a run whose K labels named
    other classes (or the same ones in another order) than this run's: its box predictor
    is loaded label by label, so each class starts from another class's weights. (With
    another K the predictor starts fresh, and the load report says so.)"""
    label = first_other_label(trained, class_names) if len(trained) == len(class_names) else None
    if label is None:
        return
    how = "the same classes in another order" if sorted(trained) == sorted(class_names) else "other classes"
    logger.warning("model.weights %s: its run named the labels otherwise (%s; label %d was %r, here %r): the box "
                   "predictor is loaded label by label, so those classes start from another class's weights",
                   source, how, label, trained[label - 1], class_names[label - 1])


def _write_summary(model: FasterRCNN, cfg: Config, output_dir: Path) -> None:
    """Rank 0: parameters per module, FLOPs of one test-size image and the weights
    size, logged once and written to ``summary.json`` next to ``config.yaml``. Runs
    before the model is moved, compiled or wrapped (the counts do not depend on it);
    the global RNG is not used. A failure is a warning: training goes on."""
    path = output_dir / "summary.json"
    try:
        summary = write_summary(model, default_image_size(cfg), path)
    except (RuntimeError, ValueError, OSError) as exc:
        logger.warning("model summary skipped: %s", first_line(exc))
        return
    logger.info("model summary (%s):\n%s", path, format_summary(summary))


def _open_run_records(cfg: Config, output_dir: Path, iteration: int, resumed: bool, is_main: bool) -> EventWriters:
    """Rank 0: ``config.yaml``, ``metrics.jsonl`` (records past ``iteration`` dropped)
    and, with ``train.tensorboard``, the TensorBoard writer (events past ``iteration``
    purged on a resume). Other ranks: writers that write nothing."""
    writers = EventWriters()
    if not is_main:
        return writers
    save_config(cfg, output_dir / "config.yaml")
    writers.jsonl = JSONLWriter(output_dir / "metrics.jsonl")
    dropped = writers.jsonl.truncate_after(iteration)
    if dropped:
        logger.info("metrics.jsonl: dropped %d records past iteration %d", dropped, iteration)
    if cfg.train.tensorboard:
        writers.tb = TensorBoardWriter(output_dir / "tb", purge_step=iteration + 1 if resumed else None)
        writers.tb.text("config", "```\n" + config_to_yaml(cfg) + "\n```", iteration)
    return writers


def _build_hooks(cfg: Config, dist: DistInfo, checkpointer: Checkpointer, writers: EventWriters, step: Any,
                 eval_hook: EvalHook, counters: List[DeviceCounter]) -> List[HookBase]:
    """The hooks in their order (see ``detector.engine.hooks``); ``counters``: the step's
    device counts, for the metrics."""
    is_main, world_size = dist.rank == 0, dist.world_size
    return [
        NonFiniteGuard(cfg.train.max_nonfinite_steps, checkpointer, world_size, cfg.train.log_period),
        MetricsWriter(cfg.train.log_period, step.optimizer, writers, dist.device, world_size, step.scaler,
                      progress_bar=is_main and sys.stderr.isatty(), is_main=is_main, counters=counters,
                      scheduler=step.scheduler),
        PeriodicCheckpointer(checkpointer, cfg.train.checkpoint_period),
        eval_hook,  # after the checkpointer: the final checkpoint comes before the final evaluation
        # Last: its handlers stay until every other hook has ended. After a failure the other
        # hooks may wait on a lost peer, and torchrun's SIGTERM must not kill this rank
        # silently before it has reported the failure.
        SignalHook(),
    ]
