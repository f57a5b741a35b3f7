"""The training loop: iteration-based SGD/AdamW over an epoch-based loader.

One ``Trainer`` per process. Under ``torchrun`` (or SLURM) every rank builds the same
model, wraps it in DDP (after SyncBN conversion) and reads its own shard of the data;
only rank 0 writes files.

Per iteration the loop keeps the losses on the device: it reads back one flag (the
non-finite / stop-request check, all-reduced across ranks in DDP) and nothing else.
Loss values, gradient norm and timings are reduced and read at logging points only.

Checkpoints (``<output_dir>/checkpoints``): ``last.pth`` and ``iter_XXXXXXX.pth`` every
``train.checkpoint_period`` iterations (the newest ``train.keep_last`` numbered ones
are kept), ``best.pth`` at the best ``train.best_metric`` of the periodic evaluations,
and ``last.pth`` again at the end or on SIGTERM/SIGINT. ``resume`` restores model,
optimizer, scheduler, AMP scaler, iteration, epoch and position in it, and the RNG
states, so a resumed run continues the straight run exactly (given a deterministic
data pipeline, see docs/training.md).
"""

from __future__ import annotations

import logging
import math
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist
from torch import nn

from detector.config import Config, config_from_dict, config_to_dict, config_to_yaml, save_config
from detector.engine import checkpoint as ckpt
from detector.distributed import (
    DistInfo,
    barrier,
    init_distributed,
    seed_everything,
)
from detector.engine.log import (
    JSONLWriter,
    TensorBoardWriter,
    draw_detections,
    format_console_line,
    peak_memory_mb,
)
from detector.engine.optim import build_lr_scheduler, build_optimizer
from detector.modeling.weights import load_initial_weights, load_weights

logger = logging.getLogger(__name__)

EvaluateFn = Callable[..., Dict[str, float]]


class NonFiniteLossError(RuntimeError):
    """``train.max_nonfinite_steps`` non-finite losses in a row."""


@dataclass
class TrainResult:
    """What ``Trainer.train`` returns. ``status``: ``finished`` or ``interrupted``."""

    iteration: int
    status: str
    metrics: Dict[str, float] = field(default_factory=dict)
    output_dir: Optional[Path] = None


# --------------------------------------------------------------------------- model set-up


def _revert_sync_batchnorm(module: nn.Module) -> nn.Module:
    """Replace ``nn.SyncBatchNorm`` layers by ``nn.BatchNorm2d`` with the same state."""
    out = module
    if isinstance(module, nn.SyncBatchNorm):
        out = nn.BatchNorm2d(module.num_features, module.eps, module.momentum, module.affine, module.track_running_stats)
        out.load_state_dict(module.state_dict())
        out.train(module.training)
        if module.affine:
            out.weight.requires_grad_(module.weight.requires_grad)
            out.bias.requires_grad_(module.bias.requires_grad)
    for name, child in module.named_children():
        out.add_module(name, _revert_sync_batchnorm(child))
    return out


def apply_norm_policy(model: nn.Module, cfg: Config, device: torch.device, world_size: int) -> nn.Module:
    """``model.norm: syncbn``: convert BatchNorm layers to ``nn.SyncBatchNorm`` on CUDA.

    PyTorch's SyncBatchNorm runs only on GPUs, so on a CPU device the model keeps
    plain BatchNorm (statistics per process) and a warning says so. FrozenBN layers
    are not BatchNorm and stay frozen.
    """
    if cfg.model.norm != "syncbn":
        return model
    if device.type != "cuda":
        logger.warning(
            "model.norm=syncbn: SyncBatchNorm needs CUDA; on %s the model uses plain BatchNorm "
            "(per-process batch statistics)", device.type,
        )
        return _revert_sync_batchnorm(model)
    if world_size > 1:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        logger.info("converted BatchNorm layers to SyncBatchNorm across %d processes", world_size)
    return model


def _unwrap(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


# --------------------------------------------------------------------------- trainer


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
        resume: None/False: start fresh (metrics.jsonl and checkpoints in the output
            folder are overwritten); True: continue from
            ``<output_dir>/checkpoints/last.pth`` if it exists; a path: from that file.
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
    ) -> None:
        self.cfg = cfg
        self.dist = dist_info or init_distributed(cfg.train.device)
        self.device = self.dist.device
        self.rank, self.world_size = self.dist.rank, self.dist.world_size
        self.is_main = self.rank == 0
        self.output_dir = Path(cfg.train.output_dir)
        self.ckpt_dir = ckpt.checkpoint_dir(self.output_dir)
        self.max_iter = cfg.solver.max_iter
        self._check_config()

        if cfg.train.deterministic:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True, warn_only=True)
            torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = cfg.train.cudnn_benchmark and not cfg.train.deterministic
        seed_everything(cfg.train.seed, self.rank)

        # Model: build, initial weights, SyncBN, device, DDP; optimizer from the wrapped model.
        if model is None:
            from detector.modeling import build_model

            model = build_model(cfg)
            if cfg.model.weights:
                load_initial_weights(model, cfg.model.weights)
        model = apply_norm_policy(model, cfg, self.device, self.world_size)
        model.to(self.device)
        if cfg.train.channels_last:
            model.to(memory_format=torch.channels_last)
        if cfg.train.compile_backbone and hasattr(model, "backbone"):
            model.backbone.compile()  # in place: state-dict keys unchanged
        model.train()
        if self.world_size > 1:
            model = nn.parallel.DistributedDataParallel(
                model, device_ids=[self.device] if self.device.type == "cuda" else None
            )
        self.model = model
        self.model_without_ddp = _unwrap(model)
        self.optimizer = build_optimizer(self.model, cfg, self.world_size)
        self.params: List[torch.Tensor] = [p for g in self.optimizer.param_groups for p in g["params"]]
        self.scheduler = build_lr_scheduler(self.optimizer, cfg)

        amp = cfg.train.amp
        self.amp_enabled = amp.enabled
        self.amp_dtype = {"float16": torch.float16, "bfloat16": torch.bfloat16}[amp.dtype]
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=amp.enabled and amp.dtype == "float16")

        # Data.
        self._train_dataset = None
        if train_loader is None:
            from detector.data import build_dataset
            from detector.data.loader import build_train_loader

            self._train_dataset = build_dataset(cfg, "train", True)
            train_loader = build_train_loader(cfg, self._train_dataset, self.rank, self.world_size)
        self.train_loader = train_loader
        self._val_dataset = val_dataset
        self._evaluate_fn = evaluate_fn

        # State.
        self.iteration = 0
        self.epoch = 0
        self.epoch_position = 0  # batches of self.epoch already consumed
        self.best_value: Optional[float] = None
        self.last_metrics: Dict[str, float] = {}
        self._pending_rng: Optional[Dict[str, Any]] = None
        self._pending_data_rng: Optional[List[Dict[str, Any]]] = None
        self._stop_signal: Optional[int] = None
        self._nonfinite_in_row = 0

        resume_path = self._resume_path(resume)
        if resume_path is not None:
            self._load_resume(resume_path)

        # Writers (rank 0 only).
        self.jsonl: Optional[JSONLWriter] = None
        self.tb: Optional[TensorBoardWriter] = None
        if self.is_main:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            save_config(cfg, self.output_dir / "config.yaml")
            self.jsonl = JSONLWriter(self.output_dir / "metrics.jsonl")
            if resume_path is not None:
                dropped = self.jsonl.truncate_after(self.iteration)
                if dropped:
                    logger.info("metrics.jsonl: dropped %d records past iteration %d", dropped, self.iteration)
            elif self.jsonl.path.exists():
                self.jsonl.path.unlink()
            if cfg.train.tensorboard:
                self.tb = TensorBoardWriter(self.output_dir / "tb", purge_step=self.iteration + 1 if resume_path else None)
                self.tb.text("config", "```\n" + config_to_yaml(cfg) + "\n```", self.iteration)

    # ------------------------------------------------------------------ set-up helpers

    def _check_config(self) -> None:
        c = self.cfg
        if c.solver.max_iter <= 0:
            raise ValueError(f"solver.max_iter must be > 0, got {c.solver.max_iter}")
        if c.train.log_period <= 0:
            raise ValueError(f"train.log_period must be > 0, got {c.train.log_period}")
        if c.train.amp.dtype not in ("float16", "bfloat16"):
            raise ValueError(f"train.amp.dtype must be 'float16' or 'bfloat16', got {c.train.amp.dtype!r}")
        if c.train.max_nonfinite_steps <= 0:
            raise ValueError(f"train.max_nonfinite_steps must be > 0, got {c.train.max_nonfinite_steps}")

    def _resume_path(self, resume: "bool | str | os.PathLike | None") -> Optional[Path]:
        if resume is None or resume is False:
            return None
        if resume is True or resume == "":
            found = ckpt.find_resume_checkpoint(self.output_dir)
            if found is None:
                logger.info("--resume: no checkpoint in %s; starting from scratch", self.ckpt_dir)
            return found
        path = Path(resume)
        if not path.is_file():
            raise ckpt.CheckpointError(f"--resume: checkpoint not found: {path}")
        return path

    def _load_resume(self, path: Path) -> None:
        state = ckpt.load_checkpoint(path)
        missing = [k for k in ("model", "optimizer", "scheduler", "iteration") if k not in state]
        if missing:
            raise ckpt.CheckpointError(f"{path} is not a training checkpoint (no {', '.join(missing)}); use --weights for weights only")
        load_weights(self.model_without_ddp, state["model"], strict=True, name=str(path))
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if state.get("scaler") and self.scaler.is_enabled():
            self.scaler.load_state_dict(state["scaler"])
        self.iteration = int(state["iteration"])
        self.epoch = int(state.get("epoch", 0))
        self.epoch_position = int(state.get("epoch_position", 0))
        self.best_value = state.get("best_value")
        rng = state.get("rng")
        if rng is not None:
            per_rank = rng.get("per_rank") if isinstance(rng, dict) else None
            self._pending_rng = per_rank[self.rank] if per_rank and self.rank < len(per_rank) else None
            self._pending_data_rng = rng.get("data") if isinstance(rng, dict) and self.world_size == 1 else None
            if per_rank and len(per_rank) != self.world_size:
                logger.warning("resume: checkpoint written by %d ranks, now %d; RNG streams restart", len(per_rank), self.world_size)
        stored = state.get("config")
        if isinstance(stored, dict):
            try:
                old = config_to_dict(config_from_dict(stored))
                changed = _diff(old, config_to_dict(self.cfg))
                if changed:
                    logger.warning("resume: config differs from the checkpoint's in: %s", ", ".join(changed))
            except ValueError as exc:
                logger.warning("resume: stored config not readable (%s)", exc)
        logger.info("resumed from %s at iteration %d (epoch %d, batch %d)", path, self.iteration, self.epoch, self.epoch_position)

    # ------------------------------------------------------------------ checkpoints

    def checkpoint_state(self) -> Dict[str, Any]:
        """Everything needed to resume, as tensors and plain data."""
        rng = ckpt.get_rng_state()
        if self.world_size > 1:
            from detector.distributed import all_gather_object

            per_rank = all_gather_object(rng)
        else:
            per_rank = [rng]
        return {
            "model": self.model_without_ddp.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler.is_enabled() else {},
            "iteration": self.iteration,
            "epoch": self.epoch,
            "epoch_position": self.epoch_position,
            "best_value": self.best_value,
            "best_metric": self.cfg.train.best_metric,
            "rng": {"per_rank": per_rank, "data": self._data_rng_state()},
            "config": config_to_dict(self.cfg),
            "world_size": self.world_size,
        }

    def save(self, names: List[str]) -> None:
        """Write the checkpoint under each of ``names`` (e.g. ``["last.pth"]``); rank 0 only.
        Every rank must call it (the RNG states are gathered)."""
        state = self.checkpoint_state()
        if self.is_main:
            first = ckpt.save_checkpoint(self.ckpt_dir / names[0], state)
            for name in names[1:]:  # the same bytes under another name: a hard link if possible
                ckpt.link_or_copy_checkpoint(first, self.ckpt_dir / name)
            if any(n.startswith("iter_") for n in names):
                for p in ckpt.prune_checkpoints(self.ckpt_dir, self.cfg.train.keep_last):
                    logger.debug("removed old checkpoint %s", p)
            logger.info("saved checkpoint %s at iteration %d", ", ".join(names), self.iteration)

    # ------------------------------------------------------------------ evaluation

    def _val_data(self) -> Any:
        if self._val_dataset is None:
            from detector.data import build_dataset

            self._val_dataset = build_dataset(self.cfg, "val", False)
        return self._val_dataset

    def evaluate(self) -> Dict[str, float]:
        """Evaluate on the val split (every rank takes part); metrics on rank 0."""
        fn = self._evaluate_fn
        if fn is None:
            from detector.evaluation import evaluate as fn
        out = self.output_dir / "eval" / f"iter_{self.iteration:07d}"
        model = self.model_without_ddp
        t0 = time.perf_counter()
        try:
            metrics = fn(model, self._val_data(), self.cfg, output_dir=out if self.is_main else None) or {}
            if self.is_main and self.tb is not None and self.cfg.train.vis_images > 0:
                self._visualise()
        finally:
            model.train()
        metrics = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}
        if self.is_main:
            logger.info(
                "evaluation at iteration %d (%.1fs): %s", self.iteration, time.perf_counter() - t0,
                "  ".join(f"{k} {v:.4f}" for k, v in metrics.items()),
            )
            if self.jsonl is not None:
                self.jsonl.write({"iteration": self.iteration, "type": "eval", **metrics})
            if self.tb is not None:
                self.tb.scalars({f"eval/{k}": v for k, v in metrics.items() if math.isfinite(v)}, self.iteration)
                self.tb.flush()
        self.last_metrics = metrics
        return metrics

    @torch.no_grad()
    def _visualise(self) -> None:
        """Ground truth and predictions of the first ``train.vis_images`` val images to TensorBoard."""
        dataset = self._val_data()
        model = self.model_without_ddp
        model.eval()
        names = list(getattr(dataset, "class_names", []))
        for i in range(min(self.cfg.train.vis_images, len(dataset))):
            image, target = dataset[i]
            with torch.autocast(self.device.type, dtype=self.amp_dtype, enabled=self.amp_enabled and self.cfg.eval.amp):
                pred = model([image.to(self.device)])[0]
            keep = pred["scores"] >= self.cfg.eval.score_thresh
            labels = pred["labels"][keep].tolist()
            scores = pred["scores"][keep].tolist()
            captions = [f"{names[l - 1] if 0 < l <= len(names) else l} {s:.2f}" for l, s in zip(labels, scores)]
            img = draw_detections(image, target["boxes"], pred["boxes"][keep].float(), captions)
            self.tb.image(f"val/detections_{i}", img, self.iteration)  # type: ignore[union-attr]

    # ------------------------------------------------------------------ the loop

    def _install_signal_handlers(self) -> Dict[int, Any]:
        old: Dict[int, Any] = {}
        if threading.current_thread() is not threading.main_thread():
            return old

        def handler(signum: int, frame: Any) -> None:
            if self._stop_signal is not None:  # second signal: stop now
                raise KeyboardInterrupt
            self._stop_signal = signum
            logger.warning("received %s: stopping after this iteration and saving a checkpoint", signal.Signals(signum).name)

        for sig in (signal.SIGTERM, signal.SIGINT):
            old[sig] = signal.signal(sig, handler)
        return old

    def _set_epoch(self) -> Any:
        bs = self.train_loader.batch_sampler
        bs.set_epoch(self.epoch)
        bs.set_start(self.epoch_position)
        gen = getattr(self.train_loader, "generator", None)
        if gen is None:
            gen = torch.Generator()
            self.train_loader.generator = gen
        # Worker seeds drawn from a generator seeded by (seed, rank, epoch): they do not
        # consume the global RNG and are the same in a resumed run.
        gen.manual_seed(((self.cfg.train.seed * 1000003 + self.rank) * 1000003 + self.epoch) % (2**63))
        return iter(self.train_loader)

    def _augmentation_pipeline(self) -> Any:
        """The albumentations pipeline that draws the training augmentation in this
        process (``data.num_workers: 0``), or None (workers own their RNG)."""
        if getattr(self.train_loader, "num_workers", 1) != 0:
            return None
        transforms = getattr(getattr(self.train_loader, "dataset", None), "transforms", None)
        pipe = getattr(transforms, "pipeline", None)
        return pipe if hasattr(pipe, "random_generator") and hasattr(pipe, "py_random") else None

    def _augmentation_rngs(self) -> List[Any]:
        """The pipeline and each of its transforms, in order: each owns a numpy
        ``random_generator`` and a ``py_random`` (albumentations seeds them separately)."""
        pipe = self._augmentation_pipeline()
        out: List[Any] = []

        def walk(t: Any) -> None:
            if hasattr(t, "random_generator") and hasattr(t, "py_random"):
                out.append(t)
            for child in getattr(t, "transforms", None) or []:
                walk(child)

        if pipe is not None:
            walk(pipe)
        return out

    def _data_rng_state(self) -> Optional[List[Dict[str, Any]]]:
        rngs = self._augmentation_rngs()
        if not rngs:
            return None
        return [{"numpy": t.random_generator.bit_generator.state, "python": t.py_random.getstate()} for t in rngs]

    def _set_data_rng_state(self, states: List[Dict[str, Any]]) -> None:
        rngs = self._augmentation_rngs()
        if len(rngs) != len(states):
            logger.warning("resume: the augmentation pipeline changed; its random state is not restored")
            return
        for t, state in zip(rngs, states):  # in place: generator objects may be shared
            t.random_generator.bit_generator.state = state["numpy"]
            py = state["python"]
            t.py_random.setstate((py[0], tuple(py[1]), py[2]))

    def run_step(self, images: List[torch.Tensor], targets: List[Dict[str, Any]]) -> tuple:
        """Forward, backward and (unless the loss is not finite) an optimizer step.

        Returns ``(losses, grad_norm, skipped)``: ``losses`` a float32 tensor
        ``[1 + L]`` (total, then the loss dict in sorted key order) on the device,
        ``grad_norm`` a 0-d tensor, ``skipped`` whether the step was skipped.
        """
        self.optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device_type=self.device.type, dtype=self.amp_dtype, enabled=self.amp_enabled):
            loss_dict = self.model(images, targets)
        keys = sorted(loss_dict)
        self._loss_keys = keys
        parts = [loss_dict[k].float() for k in keys]  # losses in float32
        total = torch.stack(parts).sum()
        self.scaler.scale(total).backward()
        self.scaler.unscale_(self.optimizer)
        grads = [p.grad for p in self.params if p.grad is not None]
        clip = self.cfg.solver.clip_grad_norm
        grad_norm = torch.nn.utils.get_total_norm(grads, foreach=True) if grads else torch.zeros((), device=self.device)
        if clip > 0:
            torch.nn.utils.clip_grads_with_norm_(self.params, clip, grad_norm, foreach=True)
        finite = torch.isfinite(total)
        if not self.scaler.is_enabled():  # the float16 scaler handles inf gradients itself
            finite = finite & torch.isfinite(grad_norm)
        flags = torch.stack([(~finite).float(), torch.tensor(float(self._stop_signal is not None), device=finite.device)])
        if self.world_size > 1:
            dist.all_reduce(flags)
        nonfinite, stop = (flags > 0).tolist()  # the one per-iteration read-back
        if stop and self._stop_signal is None:
            self._stop_signal = signal.SIGTERM  # another rank was signalled
        if nonfinite:
            self.optimizer.zero_grad(set_to_none=True)
            if self.scaler.is_enabled():
                self.scaler.update()
        else:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        self.scheduler.step()
        return torch.cat([total.detach().reshape(1), torch.stack(parts).detach()]), grad_norm.detach(), bool(nonfinite)

    def train(self) -> TrainResult:
        """Run until ``solver.max_iter``, a stop signal, or too many non-finite losses."""
        cfg = self.cfg
        old_handlers = self._install_signal_handlers()
        status = "finished"
        window: List[torch.Tensor] = []
        window_gn: List[torch.Tensor] = []
        window_skipped = 0
        window_images = 0
        data_time = 0.0
        t_window = time.perf_counter()
        n_window = 0
        eta_times: List[float] = []
        logger.info("start training at iteration %d of %d (world size %d, device %s)", self.iteration, self.max_iter, self.world_size, self.device)
        try:
            while self.iteration < self.max_iter and status == "finished":
                n_batches = len(self.train_loader)
                if self.epoch_position >= n_batches:
                    self.epoch, self.epoch_position = self.epoch + 1, 0
                data_iter = self._set_epoch()
                if self._pending_rng is not None:
                    ckpt.set_rng_state(self._pending_rng)
                    self._pending_rng = None
                if self._pending_data_rng is not None:
                    self._set_data_rng_state(self._pending_data_rng)
                    self._pending_data_rng = None
                while self.iteration < self.max_iter:
                    t_data = time.perf_counter()
                    try:
                        images, targets = next(data_iter)
                    except StopIteration:
                        break
                    data_time += time.perf_counter() - t_data
                    losses, grad_norm, skipped = self.run_step(images, targets)
                    self.iteration += 1
                    self.epoch_position += 1
                    n_window += 1
                    window_images += len(images)
                    if skipped:
                        self._nonfinite_in_row += 1
                        window_skipped += 1
                        logger.warning(
                            "iteration %d: non-finite loss or gradient (%s); step skipped (%d in a row)",
                            self.iteration, ", ".join(f"{k}={v:.4g}" for k, v in zip(["total_loss", *self._loss_keys], losses.tolist())),
                            self._nonfinite_in_row,
                        )
                        if self._nonfinite_in_row >= cfg.train.max_nonfinite_steps:
                            self._stop_nonfinite()
                    else:
                        self._nonfinite_in_row = 0
                        window.append(losses)
                        window_gn.append(grad_norm)
                    if self.iteration % cfg.train.log_period == 0 or self.iteration == self.max_iter:
                        elapsed = time.perf_counter() - t_window
                        self._log(window, window_gn, window_skipped, window_images, elapsed, data_time, n_window, eta_times)
                        window, window_gn, window_skipped, window_images, data_time, n_window = [], [], 0, 0, 0.0, 0
                        t_window = time.perf_counter()
                    done = self.iteration == self.max_iter
                    if cfg.train.eval_period > 0 and self.iteration % cfg.train.eval_period == 0 and not done:
                        self._evaluate_and_keep_best()
                    if cfg.train.checkpoint_period > 0 and self.iteration % cfg.train.checkpoint_period == 0 and not done:
                        self.save([ckpt.numbered_checkpoint_name(self.iteration), "last.pth"])
                    if self._stop_signal is not None and not done:
                        status = "interrupted"
                        break
                else:
                    continue
                if status == "finished" and self.iteration < self.max_iter and self.epoch_position < n_batches:
                    # The loader ran dry early: a sampler that yields fewer batches than len().
                    logger.warning("epoch %d ended after %d of %d batches", self.epoch, self.epoch_position, n_batches)
                    self.epoch_position = n_batches
            if status == "interrupted":
                self.save(["last.pth"])
                logger.warning(
                    "stopped by %s at iteration %d; resume with --resume (checkpoint %s)",
                    signal.Signals(self._stop_signal).name if self._stop_signal else "signal", self.iteration, self.ckpt_dir / "last.pth",
                )
            else:
                if cfg.train.eval_period >= 0:
                    self._evaluate_and_keep_best()
                self.save([ckpt.numbered_checkpoint_name(self.iteration), "last.pth"])
            barrier()
        finally:
            for sig, h in old_handlers.items():
                signal.signal(sig, h)
            if self.tb is not None:
                self.tb.flush()
        return TrainResult(self.iteration, status, dict(self.last_metrics), self.output_dir)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
            self.tb = None

    def _stop_nonfinite(self) -> None:
        k = self.cfg.train.max_nonfinite_steps
        last = self.ckpt_dir / "last.pth"
        if self.is_main and self.jsonl is not None:
            self.jsonl.write({"iteration": self.iteration, "type": "stopped", "reason": f"{k} non-finite losses in a row"})
        if self._rank0_decides(not last.is_file()):
            # No earlier checkpoint: the current weights are the last good ones (the bad
            # steps were skipped), so keep them.
            self.save(["last.pth"])
        barrier()
        raise NonFiniteLossError(
            f"{k} non-finite losses in a row (train.max_nonfinite_steps={k}) at iteration {self.iteration}; "
            f"stopped. Last good checkpoint: {last}. Lower solver.lr, enable solver.clip_grad_norm, or check the data"
        )

    def _evaluate_and_keep_best(self) -> None:
        metrics = self.evaluate()
        name = self.cfg.train.best_metric
        value: Optional[float] = None
        if self.is_main and metrics:
            if name not in metrics:
                logger.warning("train.best_metric=%r is not among the evaluation metrics %s; best.pth not written", name, sorted(metrics))
            elif math.isfinite(metrics[name]) and (self.best_value is None or metrics[name] > self.best_value):
                value = metrics[name]
        value = self._rank0_decides(value)
        if value is not None:
            self.best_value = value
            self.save(["best.pth"])
            if self.is_main:
                logger.info("new best %s %.4f at iteration %d", name, value, self.iteration)

    def _rank0_decides(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank."""
        if self.world_size == 1:
            return value
        from detector.distributed import all_gather_object

        return all_gather_object(value)[0]

    def _log(
        self,
        window: List[torch.Tensor],
        window_gn: List[torch.Tensor],
        skipped: int,
        images: int,
        elapsed: float,
        data_time: float,
        n: int,
        eta_times: List[float],
    ) -> None:
        keys = ["total_loss", *getattr(self, "_loss_keys", [])]
        if window:
            mean = torch.stack(window).mean(0)
            gn = torch.stack(window_gn).mean()
        else:
            mean = torch.full((len(keys),), float("nan"), device=self.device)
            gn = torch.tensor(float("nan"), device=self.device)
        stats = torch.cat([mean, gn.reshape(1).float(), torch.tensor([float(images), float(skipped)], device=mean.device)])
        if self.world_size > 1:
            dist.all_reduce(stats)
            stats[: len(keys) + 1] /= self.world_size  # mean losses and grad norm over ranks
        values = stats.tolist()
        it_time = elapsed / max(1, n)
        eta_times.append(it_time)
        del eta_times[:-5]
        recent = eta_times[-5:]
        eta = (sum(recent) / len(recent)) * (self.max_iter - self.iteration)
        groups = self.optimizer.param_groups
        record: Dict[str, Any] = {
            "iteration": self.iteration,
            "type": "train",
            "epoch": self.epoch,
            **{k: v for k, v in zip(keys, values)},
            "grad_norm": values[len(keys)],
            "lr": max(g["lr"] for g in groups),
            **{f"lr/{g.get('name', i)}": g["lr"] for i, g in enumerate(groups)},
            "time": it_time,
            "data_time": data_time / max(1, n),
            "images_per_sec": values[len(keys) + 1] / max(elapsed, 1e-9),
            "memory_mb": peak_memory_mb(self.device),
            "nonfinite_skipped": int(values[len(keys) + 2]),
        }
        if self.scaler.is_enabled():
            record["amp_scale"] = float(self.scaler.get_scale())
        if not self.is_main:
            return
        logger.info(format_console_line(record, self.max_iter, eta))
        if self.jsonl is not None:
            self.jsonl.write(record)
        if self.tb is not None:
            tags = {f"loss/{k}": record[k] for k in keys}
            tags.update({f"lr/{g.get('name', i)}": g["lr"] for i, g in enumerate(groups)})
            tags.update({
                "train/grad_norm": record["grad_norm"],
                "time/iter": record["time"],
                "time/data": record["data_time"],
                "train/images_per_sec": record["images_per_sec"],
                "memory/peak_mb": record["memory_mb"],
            })
            if "amp_scale" in record:
                tags["train/amp_scale"] = record["amp_scale"]
            self.tb.scalars({k: v for k, v in tags.items() if math.isfinite(v)}, self.iteration)


def _diff(a: Dict[str, Any], b: Dict[str, Any], prefix: str = "") -> List[str]:
    out = []
    for k in sorted(set(a) | set(b)):
        va, vb = a.get(k), b.get(k)
        if isinstance(va, dict) and isinstance(vb, dict):
            out.extend(_diff(va, vb, f"{prefix}{k}."))
        elif va != vb:
            out.append(f"{prefix}{k}: {va!r} -> {vb!r}")
    return out


def train(cfg: Config, resume: "bool | str | None" = None) -> TrainResult:
    """Build everything from ``cfg`` and train; the entry point of tools/train.py."""
    trainer = Trainer(cfg, resume=resume)
    try:
        return trainer.train()
    finally:
        trainer.close()
