"""Does the static step train as well as the eager step? The demo (or any config) trained
with each, over several seeds, on one canvas, one after the other in this process:

- ``eager``: the default training step (the model's own forward), on
  ``model.canvas_sizes`` so that both steps see the same padded batches;
- ``static``: ``train.static_step=true`` run uncompiled (``build_trainer(eager_static=True)``):
  the same operations and random draws as the compiled step (inductor's
  ``fallback_random``), summed in eager order, at the eager step's speed on a CPU.

Each run's final evaluation AP (and AP50) is recorded; the summary gives each arm's mean
and standard deviation over seeds, and the difference of the means. The two steps
draw their samples from the same distribution but not the same numbers (the static
step's candidate tensors have config-fixed shapes), so a single pair of runs says
little: the seed-to-seed spread is the yardstick.

    OMP_NUM_THREADS=1 python -m benchmarks.static_accuracy --config configs/demo_shapes.yaml \\
        --seeds 0 1 2 3 4 --out runs/static_accuracy "model.canvas_sizes=[[160,160]]" train.device=cpu

writes ``<out>/<arm>_<seed>/`` (each run's folder) and ``<out>/static_accuracy.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from detector.config import load_config
from detector.engine.trainer import build_trainer

ARMS = ("eager", "static")


def train_arm(config: str, overrides: Sequence[str], arm: str, seed: int, output_dir: Path) -> Dict[str, float]:
    """One run of ``arm`` with ``train.seed=seed`` in ``output_dir``: its final AP and AP50."""
    extra = [f"train.seed={seed}", f"train.output_dir={output_dir}", "train.eval_period=0"]
    if arm == "static":
        extra.append("train.static_step=true")
    cfg = load_config(config, [*overrides, *extra])
    trainer = build_trainer(cfg, eager_static=arm == "static")
    try:
        metrics = trainer.train().metrics
    finally:
        trainer.close()
    return {"AP": metrics["AP"], "AP50": metrics["AP50"]}


def summarize(runs: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Per arm: the APs by seed, their mean and sample standard deviation; and
    ``static_minus_eager``, the difference of the mean APs."""
    out: Dict[str, Any] = {}
    for arm in ARMS:
        aps = [r["AP"] for r in runs if r["arm"] == arm]
        out[arm] = {"AP": aps, "mean": statistics.fmean(aps) if aps else float("nan"),
                    "std": statistics.stdev(aps) if len(aps) > 1 else float("nan")}
    out["static_minus_eager"] = out["static"]["mean"] - out["eager"]["mean"]
    return out


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--out", required=True, help="folder of the runs and of static_accuracy.json")
    p.add_argument("overrides", nargs="*", help="config overrides key=value (the canvas: model.canvas_sizes)")
    args = p.parse_args(argv)
    out = Path(args.out)
    runs = []
    for seed in args.seeds:
        for arm in ARMS:  # interleaved, so that a drift of the machine touches both arms
            result = train_arm(args.config, args.overrides, arm, seed, out / f"{arm}_{seed}")
            runs.append({"arm": arm, "seed": seed, **result})
            print(f"{arm} seed {seed}: AP {result['AP']:.4f} AP50 {result['AP50']:.4f}", flush=True)
    report = {"config": args.config, "overrides": args.overrides, "runs": runs, "summary": summarize(runs)}
    out.mkdir(parents=True, exist_ok=True)
    (out / "static_accuracy.json").write_text(json.dumps(report, indent=1))
    s = report["summary"]
    print(f"eager AP {s['eager']['mean']:.4f} +- {s['eager']['std']:.4f}, static AP {s['static']['mean']:.4f} +- "
          f"{s['static']['std']:.4f}, static - eager {s['static_minus_eager']:+.4f}")
    return report


if __name__ == "__main__":
    main()
