"""``MetricsWriter``: losses, the samplers' statistics, device counters, LRs, timings,
memory and the AMP scale to the console, ``metrics.jsonl`` and TensorBoard."""

from __future__ import annotations

import logging
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from tqdm import tqdm

from detector.dist_faults import watch
from detector.engine.log import (DeviceCounter, EventWriters, eta_seconds, format_console_line, format_eta,
                                 peak_memory_mb)
from detector.engine.train_loop import HookBase, LoopState

logger = logging.getLogger(__name__)


def _named_lrs(groups: List[Dict[str, Any]], scheduler: Any = None, iteration: int = 0) -> Dict[str, float]:
    """Each group's LR by name: the one iteration ``iteration`` trained with where the
    ``scheduler`` is given (``base_lr * factor(iteration - 1)``: the groups hold the next
    iteration's by now, and a tensor LR would be a device read), else the groups' own."""
    if scheduler is not None:
        factor = scheduler.factor(iteration - 1)
        return {str(g.get("name", i)): float(base) * factor for i, (g, base) in enumerate(zip(groups, scheduler.base_lrs))}
    return {str(g.get("name", i)): float(g["lr"]) for i, g in enumerate(groups)}


class MetricsWriter(HookBase):
    """Every ``period`` iterations (and at a stop or the end): the window's mean losses
    and gradient norm (over iterations and ranks; non-finite steps left out), each group's
    LR, iteration and data time, images/s, peak memory and the AMP scale, to the
    console, ``metrics.jsonl`` and TensorBoard. Per iteration it only keeps the step's
    device tensors: nothing is read back outside logging points. A step that decides
    its skips on the device (``StepResult.skip_flag``, ``train.cuda_graphs``) has its
    skipped steps left out of the means on the device too.

    The samplers' statistics (``StepResult.stats``: ``rpn/num_pos_anchors``, ...) are
    window means too, over the steps (and ranks) where they are defined; one defined
    nowhere in the window is left out. They go to ``metrics.jsonl`` and TensorBoard
    under their names, not to the console line. Each ``DeviceCounter`` is recorded as
    its growth since the last record (summed over ranks), with its warning when it grew.

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
        counters: counts kept on the device by the step (``StaticForward.counters``).
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
        counters: Sequence[DeviceCounter] = (),
        scheduler: Any = None,
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
        self.counters = list(counters)
        self.scheduler = scheduler  # (``WarmupLRScheduler``: the logged LR is the one the iteration used)
        self._counted = [0.0] * len(self.counters)  # each counter's value (all ranks) at the last record
        self._bar: Optional[tqdm] = None
        self._reset(time.perf_counter())
        self._recent_iter_times: List[float] = []

    def _reset(self, now: float) -> None:
        self._losses: List[torch.Tensor] = []
        self._grad_norms: List[torch.Tensor] = []
        self._stats: List[torch.Tensor] = []
        self._stat_names: Tuple[str, ...] = ()
        self._flags: List[torch.Tensor] = []
        self._nonfinite_flags: List[torch.Tensor] = []
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
        flag = getattr(step, "skip_flag", None)
        if flag is not None:  # skips masked on the device at the logging point
            self._flags.append(flag)
            self._nonfinite_flags.append(step.nonfinite_flag)
            self._losses.append(step.losses)
            self._grad_norms.append(step.grad_norm)
            self._add_stats(step)
        else:
            if step.nonfinite:
                self._skipped += 1
            else:
                self._losses.append(step.losses)
                self._add_stats(step)
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

    def _add_stats(self, step: Any) -> None:
        """Keep the step's sampler statistics (device tensors) for the window."""
        if step.stat_names:
            if step.stat_names != self._stat_names:  # (a forward that changed its statistics)
                self._stats, self._stat_names = [], step.stat_names
            self._stats.append(step.stats)

    def _reduce(self, n: int) -> List[float]:
        """The window's device figures, reduced over ranks and read back (the read-back
        of a logging point): ``n`` mean losses, the mean gradient norm (both averaged
        over ranks), images, skipped steps, then per statistic the sum and the count of
        its defined values, then each counter's value (all summed over ranks)."""
        mean, grad_norm, device_skips = self._window_means(n)
        counts = torch.tensor([float(self._images), float(self._skipped)], device=mean.device)
        counts[1:] += device_skips
        parts = [mean.float(), grad_norm.float(), counts]
        if self._stats:
            rows = torch.stack(self._stats).float()  # [steps, S]
            defined = ~torch.isnan(rows)
            parts += [torch.where(defined, rows, 0.0).sum(0), defined.sum(0).float()]
        parts += [c.value.detach().to(mean.device, torch.float32).reshape(1) for c in self.counters]
        figures = torch.cat(parts)
        if self.world_size > 1:
            with watch("the metrics all-reduce"):
                dist.all_reduce(figures)
            figures[: n + 1] /= self.world_size
        return figures.tolist()

    def _stats_and_counters(self, values: List[float]) -> Dict[str, float]:
        """``_reduce``'s values past the fixed figures -> each defined statistic's window
        mean and each counter's growth since the last record (a warning when it grew)."""
        size = len(self._stat_names) if self._stats else 0
        sums, defined, current = values[:size], values[size:2 * size], values[2 * size:]
        out = {k: total / count for k, total, count in zip(self._stat_names, sums, defined) if count > 0}
        for i, (counter, value) in enumerate(zip(self.counters, current)):
            grown = int(round(value - self._counted[i]))
            self._counted[i] = value
            out[counter.name] = grown
            if grown > 0 and self.is_main:
                logger.warning(counter.message.format(count=grown))
        return out

    def _window_means(self, n: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The window's mean losses ``[n]`` and gradient norm ``[1]`` (NaN when no step
        counts) and the device-flagged skips ``[1]``, all on the device."""
        nan = torch.full((1,), float("nan"), device=self.device)
        if not self._flags:
            mean = torch.stack(self._losses).mean(0) if self._losses else nan.expand(n)
            grad_norm = torch.stack(self._grad_norms).mean().reshape(1) if self._grad_norms else nan
            return mean, grad_norm, torch.zeros(1, device=mean.device)
        # As for host flags: a non-finite step's losses are left out and counted; a
        # skipped step's gradient norm is left out (a float16 overflow is skipped but
        # not non-finite: its finite losses count).
        bad = torch.stack(self._nonfinite_flags) > 0  # [T]
        skipped = torch.stack(self._flags) > 0  # [T]
        mean = torch.where(bad[:, None], 0.0, torch.stack(self._losses)).sum(0) / (~bad).float().sum()
        grad_norm = torch.where(skipped, 0.0, torch.stack(self._grad_norms)).sum() / (~skipped).float().sum()
        return mean, grad_norm.reshape(1), bad.float().sum().reshape(1)

    def write(self, state: LoopState) -> Dict[str, Any]:
        """Reduce the window, write the record and start a new window; returns the record."""
        now = time.perf_counter()
        names = list(self._names)
        n = len(names)
        values = self._reduce(n)
        extra = self._stats_and_counters(values[n + 3:])
        elapsed = now - self._window_start
        iter_time = elapsed / max(1, self._count)
        self._recent_iter_times = (self._recent_iter_times + [iter_time])[-5:]
        eta = eta_seconds(self._recent_iter_times, state.max_iter - state.iteration)
        lrs = _named_lrs(self.optimizer.param_groups, self.scheduler, state.iteration)
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
            **extra,
        }
        if self.scaler is not None and self.scaler.is_enabled():
            record["amp_scale"] = float(self.scaler.get_scale())
        self._reset(time.perf_counter())
        if self.is_main:
            self._log(record, names, list(extra), lrs, state, eta)
        return record

    def _log(self, record: Dict[str, Any], names: List[str], extra: List[str], lrs: Dict[str, float],
             state: LoopState, eta: float) -> None:
        """Rank 0: the console line (or the progress bar), ``metrics.jsonl`` and the
        TensorBoard scalars (``extra``: the statistics and counters, under their names)."""
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
        scalars.update({k: float(record[k]) for k in extra})
        if "amp_scale" in record:
            scalars["train/amp_scale"] = record["amp_scale"]
        self.writers.write(record, scalars, state.iteration)
