"""``make gpu-check``: what a GPU machine runs end to end, offline, in one call.

Without CUDA it prints one line and returns 2. With CUDA it runs, each under its own
time limit, and records rc, seconds and the output's last lines:

- ``pytest -m gpu`` (every GPU test);
- ``--task static-check`` (graph breaks, recompiles, host syncs, compile and step
  times) on the demo config and on R50-FPN 1x, 2 images per step;
- ``--task train --compare-torchvision`` on R50-FPN 1x (AMP), eager and compiled
  backbone;

then writes ``gpu-report.json`` (all results, the static-check JSON included) and a
short text table on stdout. It writes nothing else and downloads nothing (random
weights; the data sets are the generated shapes or ``../shared/gpu`` as prepared).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Sequence

import torch

ROOT = Path(__file__).resolve().parents[1]
BENCH = [sys.executable, str(ROOT / "tools" / "benchmark.py")]
R50 = str(ROOT / "configs" / "faster_rcnn_r50_fpn_1x_coco.yaml")
DEMO = str(ROOT / "configs" / "demo_shapes.yaml")
STATIC = ["train.static_step=true", "train.device=cuda"]


def checks(out_dir: Path) -> List[Dict]:
    """The commands (name, argv, time limit in seconds, JSON file or None)."""
    def static(name: str, config: str, *extra: str) -> Dict:
        json_file = out_dir / f"{name}.json"
        argv = BENCH + ["--config", config, "--task", "static-check", *STATIC, *extra, "--json", str(json_file)]
        return {"name": name, "argv": argv, "limit_s": 150, "json": json_file}

    def train(name: str, *extra: str) -> Dict:
        json_file = out_dir / f"{name}.json"
        argv = BENCH + ["--config", R50, "--task", "train", "--compare-torchvision", "--synthetic", "--no-loader",
                        "train.device=cuda", *extra, "--json", str(json_file)]
        return {"name": name, "argv": argv, "limit_s": 120, "json": json_file}

    return [
        {"name": "pytest-gpu", "argv": [sys.executable, "-m", "pytest", "-q", "-m", "gpu", str(ROOT / "tests")],
         "limit_s": 180, "json": None},
        static("static-check-demo", DEMO, "model.canvas_sizes=[[160,160]]"),
        static("static-check-r50", R50, "model.canvas_sizes=[[800,1344]]", "solver.images_per_gpu=2",
               "rpn.nms_max_iters=4"),
        train("train-r50-amp", "train.amp.enabled=true"),
        train("train-r50-amp-compiled-backbone", "train.amp.enabled=true", "train.compile_backbone=true",
              "model.canvas_sizes=[[800,1344],[1344,800]]"),
    ]


def run_check(check: Dict) -> Dict:
    """Run one command under its limit; rc (124 on timeout), seconds, tail, JSON."""
    start = time.perf_counter()
    try:
        proc = subprocess.run(check["argv"], cwd=ROOT, capture_output=True, text=True, timeout=check["limit_s"])
        rc, text = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        rc, text = 124, f"{exc.stdout or ''}{exc.stderr or ''}"
        text = text.decode() if isinstance(text, bytes) else text
    result = {"name": check["name"], "rc": rc, "seconds": round(time.perf_counter() - start, 1),
              "tail": text.strip().splitlines()[-15:]}
    if check["json"] is not None and Path(check["json"]).is_file():
        result["result"] = json.loads(Path(check["json"]).read_text())
    return result


def table(results: Sequence[Dict]) -> str:
    """One line per check: name, rc, seconds, and the static-check figures."""
    lines = [f"{'check':36s} {'rc':>4s} {'s':>7s}  figures"]
    for r in results:
        res = r.get("result", {})
        keys = ("graph_breaks", "recompiles", "host_syncs_per_step", "max_loss_rel_diff", "compile_s",
                "static_compiled_step_s", "eager_step_s")
        figures = ", ".join(f"{k}={res[k]:.4g}" if isinstance(res[k], float) else f"{k}={res[k]}"
                            for k in keys if k in res)
        lines.append(f"{r['name']:36s} {r['rc']:>4d} {r['seconds']:>7.1f}  {figures}")
    return "\n".join(lines)


def main(argv: Sequence[str] = ()) -> int:
    """Run the checks, write ``gpu-report.json``; 2 without CUDA, 1 if a check failed."""
    if not torch.cuda.is_available():
        print("make gpu-check needs a CUDA GPU: torch.cuda.is_available() is False here; nothing was run")
        return 2
    out_dir = ROOT / "gpu-report"
    out_dir.mkdir(exist_ok=True)
    results = [run_check(c) for c in checks(out_dir)]
    report = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "checks": results}
    (ROOT / "gpu-report.json").write_text(json.dumps(report, indent=2, default=str))
    print(table(results))
    return 0 if all(r["rc"] == 0 for r in results) else 1
