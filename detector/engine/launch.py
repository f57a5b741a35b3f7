"""The commands that run as one process of a launch (``python``, ``torchrun``, ``srun``):
``train_command`` (``tools/train.py``) and ``evaluate_command`` (``tools/eval.py``'s
model mode). Each goes from a config file and its overrides to the exit status; the
tool parses its arguments and calls it inside ``detector.cli.run_tool``, which turns an
expected error into one line and status 1.

What ``train_command`` adds around ``detector.engine.trainer.train``:

1. the config, and the checks that need no process group (the output folder, the
   folder apart from the data, ``--overwrite`` keeping the initial weights);
2. the process group (``detector.distributed.init_distributed``), then the run folder,
   opened and locked (``RunFolder.open``) before anything is written to it;
3. the end: rank 0 prints where the run stands; a run stopped by a signal exits with
   128 + the signal's number, as shells and ``timeout`` expect; a collective that failed
   because another rank died is one line naming that rank (``report_lost_rank``).

``evaluate_command`` builds the model and the val set and runs
``detector.evaluation.evaluate`` (the val set split across the ranks), with the same
one line for a lost rank.
"""

from __future__ import annotations

import logging
import signal
import sys
from pathlib import Path
from typing import Optional, Sequence

from detector import distributed
from detector.cli import Terminated
from detector.config import load_config
from detector.data import build_dataset, cache_in, resolve_num_classes
from detector.engine.log import setup_logging
from detector.engine.run_folder import (RunFolder, check_output_dir, check_overwrite_keeps_weights,
                                        check_run_folder_apart_from_data)
from detector.engine.train_loop import TrainResult
from detector.engine.trainer import train
from detector.evaluation import OUTPUT_FILES, evaluate, load_predictions, load_trained_weights
from detector.evaluation.score_command import AnalysisRequest, check_outputs_apart, print_analysis
from detector.files import output_folder
from detector.modeling import build_model

logger = logging.getLogger(__name__)

# For run_tool: the message of a second Ctrl-C or SIGTERM, which stops without a checkpoint.
SECOND_SIGNAL = "interrupted by a second signal; resume from the last checkpoint written"


def interrupted_exit_status(signal_name: Optional[str]) -> int:
    """128 + the signal's number (SIGTERM 143, SIGINT 130); 143 when another rank got it."""
    try:
        return 128 + int(signal.Signals[signal_name or "SIGTERM"])
    except KeyError:
        return 128 + int(signal.SIGTERM)


def train_command(config_file: str, overrides: Sequence[str] = (), *, output_dir: Optional[str] = None,
                  weights: Optional[str] = None, resume: "bool | str | None" = None,
                  overwrite: bool = False) -> int:
    """Train as ``tools/train.py --config config_file [overrides]`` does; returns the exit
    status (0 finished, 130/143 interrupted by SIGINT/SIGTERM, 1 a lost rank).

    Args:
        config_file: the YAML config.
        overrides: ``key=value`` strings, applied in order after the file.
        output_dir: the run folder (``train.output_dir``), applied after ``overrides``.
        weights: the initial weights (``model.weights``), applied after ``overrides``.
        resume: None: a fresh start; True: the folder's newest checkpoint, or a fresh
            start where it has none; a path: continue from that checkpoint.
        overwrite: a fresh start in a folder that holds a run deletes that run's files.

    Expected errors (a bad key, a missing file, a run folder in use) propagate as
    exceptions for ``run_tool`` to report in one line.
    """
    overrides = list(overrides)
    if output_dir is not None:
        overrides.append(f"train.output_dir={output_dir}")
    if weights is not None:
        overrides.append(f"model.weights={weights}")
    info = None
    try:
        cfg = load_config(config_file, overrides)
        check_output_dir(cfg.train.output_dir)
        check_run_folder_apart_from_data(cfg)
        check_overwrite_keeps_weights(cfg, overwrite)
        info = distributed.init_distributed(cfg.train.device, backend=cfg.train.dist_backend,
                                            timeout_s=cfg.train.dist_timeout_s)
        setup_logging(None, info.rank)  # console only until the run folder is ours
        with RunFolder.open(cfg.train.output_dir, resume, overwrite, info.rank == 0, info.world_size) as folder:
            setup_logging(cfg.train.output_dir, info.rank)
            logger.info("process: %s", info.describe())
            result = train(cfg, resume=resume, dist_info=info, run_folder=folder)
    except (RuntimeError, Terminated) as exc:
        # A peer process died (a collective failed, or torchrun's SIGTERM came after it):
        # one line naming it. Anything else goes on up.
        status = distributed.report_lost_rank(exc, info)
        if status is None:
            raise
        return status
    finally:
        distributed.cleanup()
    return _report_end(result, info.rank)


def _report_end(result: TrainResult, rank: int) -> int:
    """Rank 0 prints where the run stands (the final metrics were logged already, as the
    evaluator's table); returns the exit status."""
    if result.status == "interrupted":  # not finished: non-zero, as `timeout` and shells expect
        if rank == 0:
            print(f"interrupted by {result.stop_reason or 'a signal'} at iteration {result.iteration}: the run is not "
                  f"finished; continue it with --resume (run folder: {result.output_dir})", file=sys.stderr)
        return interrupted_exit_status(result.stop_reason)
    if rank == 0:
        print(f"{result.status} at iteration {result.iteration}; run folder: {result.output_dir}")
    return 0


def evaluate_command(config_file: str, weights: str, overrides: Sequence[str] = (), *,
                     output_dir: Optional[str] = None, analysis: Optional[AnalysisRequest] = None) -> int:
    """Evaluate as ``tools/eval.py --config config_file --weights weights`` does: the model
    of the config with ``weights`` (a checkpoint, a state dict or a torchvision weights
    name) on its val set; the metrics table, and the outputs in ``output_dir`` (with
    ``analysis``, the error breakdown of the detections written there). Returns the exit
    status (0, or 1 for a lost rank); expected errors propagate to ``run_tool``."""
    if analysis is not None and not output_dir:
        raise ValueError("the error analysis of a model's evaluation needs an output folder (it reads the "
                         "detections.json written there)")
    check_outputs_apart(output_dir, [*OUTPUT_FILES, "log.txt"], analysis is not None,
                        {"--weights": weights, "--config": config_file})
    cfg = load_config(config_file, list(overrides))
    if output_dir:
        output_folder(output_dir, "--output-dir")  # a file or a read-only folder: one line, before any work
    info = distributed.init_distributed(cfg.train.device, backend=cfg.train.dist_backend,
                                        timeout_s=cfg.train.dist_timeout_s)
    if output_dir:  # several ranks share the parsed records there, not in the config's run folder
        cfg = cache_in(cfg, output_dir)
    try:
        setup_logging(output_dir, rank=info.rank)
        dataset = build_dataset(cfg, "val", is_train=False)
        if cfg.model.num_classes is None:  # auto: the run's config.yaml holds the number; else the data's
            cfg = resolve_num_classes(cfg, dataset, split="val")
        model = build_model(cfg)
        load_trained_weights(model, cfg, weights, dataset.class_names)
        model.to(info.device)
        evaluate(model, dataset, cfg, output_dir=output_dir)
        if info.rank == 0 and output_dir:
            print(f"results written to {output_dir}")
        if info.rank == 0 and analysis is not None:
            gt = dataset.coco_gt()
            results = load_predictions(Path(output_dir) / "detections.json", gt)
            image_dir = cfg.data.val.root if cfg.data.format == "coco" else None
            print_analysis(gt, results, output_dir, cfg.eval.score_thresh, analysis, image_dir)
    except (RuntimeError, Terminated) as exc:
        # Another rank ended (a collective failed, or torchrun's SIGTERM came after it), or
        # did not answer within train.dist_timeout_s: one line naming it, as for training.
        status = distributed.report_lost_rank(exc, info, advice="run the evaluation again")  # (no --resume here)
        if status is None:
            raise
        return status
    finally:
        distributed.cleanup()
    return 0
