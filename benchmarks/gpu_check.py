"""``make gpu-check``: what a GPU machine runs end to end, offline, in one 10-minute call.

    python tools/gpu_check.py                  # the runs in order, within --budget-s
    python tools/gpu_check.py --list           # the plan, its configs checked; no GPU needed
    python tools/gpu_check.py --only demo,demo-graphs
    python tools/gpu_check.py --rest           # what the last report skipped or cut, merged into it

Without CUDA (and without ``--list``) it prints one line and returns 2. With CUDA it runs
``plan()`` in order, each under its own time limit and all under ``--budget-s`` (a run
that no longer fits is recorded as skipped, with the ``--only`` call that runs it):

- side by side first (checks of results, and compilation):
  ``pytest -m gpu`` (every GPU test); ``--task static-check`` on the demo config (graph
  breaks, recompiles, host syncs); the demo (``make demo``'s training) on the GPU, eager
  and with the CUDA-graph step, for the accuracy goal (their final AP); and the R50-FPN 1x
  CUDA-graph steps at 2 and 8 images once each, which fill torch.compile's caches on this
  machine (compiling that step takes minutes: the first GPU run needed more than 3.5) so
  that the timed runs after them load it;
- then one at a time, most wanted first: R50-FPN 1x training against torchvision
  (``--task train --compare-torchvision``, synthetic batches of 800x1066 images, the
  recipe's canvases ``[[800, 1344], [1344, 800]]`` for the static steps): the eager step
  (AMP bfloat16), the CUDA-graph step at 2 and 8 images (8 with a profile of the
  device's kernels and the host's operators, then with canvases that fit 800x1066
  images), the proposal NMS alone (``--task nms``: torchvision's per-image
  ``batched_nms`` against ``static_nms``'s kernel and its blocked resolution), inference
  with ``eval.amp`` (profiled: the host's operators too, since that step is bound by
  dispatch) and with ``eval.static`` and ``eval.cuda_graphs`` (one graph per canvas), the
  static step (and its operators per step against torchvision's, ``--count-ops``), eager float16 (profiled) and the CUDA-graph step in float16 (its loss
  scale on the device), inference with the backbone compiled at canvases, then the
  recipe's training loader alone (``--task data``: decode, multi-scale resize, flip,
  collate; its 4 workers) on generated JPEGs of COCO's sizes, to set its images/s beside
  the step's, the graphed inference with half the default ``eval.static_candidates``, and
  the compiled backbone.

It writes ``gpu-report.json`` (every result, the benchmarks' JSON included) and prints
a short text table. A call with ``--only`` or ``--rest`` merges its results into the
report already there (same device), so one check can span several 10-minute calls.
pytest's failures are written as they happen (``gpu-report/<run>-failures.txt``) and kept
in the report. It downloads nothing (random weights; generated data).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from detector.config import load_config

ROOT = Path(__file__).resolve().parents[1]
R50 = "configs/faster_rcnn_r50_fpn_1x_coco.yaml"
DEMO = "configs/demo_shapes.yaml"
OUT = "gpu-report"
BUDGET_S = 570  # of the device tool's 600 s per call
CANVAS_R50 = "model.canvas_sizes=[[800,1344],[1344,800]]"
# The recipe's canvases and, first, the 4:3 ones that hold an 800x1066 image (torchvision
# pads the benchmark's images to 800x1088 too: the same pixels in both models).
CANVAS_R50_43 = "model.canvas_sizes=[[800,1088],[1088,800],[800,1344],[1344,800]]"
STATIC = ("train.static_step=true",)
GRAPHS = ("train.static_step=true", "train.cuda_graphs=true")
BF16 = ("train.amp.enabled=true", "train.amp.dtype=bfloat16")
FP16 = ("train.amp.enabled=true", "train.amp.dtype=float16")


@dataclass(frozen=True)
class Run:
    """One command of the check.

    Attributes:
        name: its name in the report and for ``--only``.
        tool: ``pytest``, ``benchmark`` or ``train`` (``tools/<tool>.py``).
        args: the tool's arguments (flags, then ``key=value`` overrides).
        limit_s: its time limit.
        config: the config file, checked with ``overrides`` by ``--list``; None for pytest.
        overrides: the run's config overrides.
        json: the result file it writes (under ``gpu-report/``), or None.
        parallel: a check of results, not of speed: it runs at the start alongside the
            other such runs (the timed runs come after, one at a time).
    """

    name: str
    tool: str
    args: Tuple[str, ...]
    limit_s: int
    config: Optional[str] = None
    overrides: Tuple[str, ...] = ()
    json: Optional[str] = None
    parallel: bool = False

    def argv(self) -> List[str]:
        """The command line, run from the checkout's root."""
        if self.tool == "pytest":
            return [sys.executable, "-m", "pytest", *self.args]
        return [sys.executable, f"tools/{self.tool}.py", *self.args]


def _bench(name: str, task: str, limit_s: int, *overrides: str, iters: int = 20, warmup: int = 5,
           profile: bool = False, count_ops: bool = False) -> Run:
    """``tools/benchmark.py --task train|infer --compare-torchvision`` on R50-FPN 1x, from
    random weights (offline); synthetic training images at the recipe's largest scale.
    ``profile``: then ``--profile`` (one step of each model under torch.profiler: the
    device's busy time and its longest kernels); ``count_ops``: then ``--count-ops``
    (aten operators and host syncs per step, ours and torchvision's: the issue's goal of
    at most 0.3x torchvision's operators for the compiled static step)."""
    sizes = ("input.min_size_train=[800]",) if task == "train" else ()
    overrides = ("train.device=cuda", "model.backbone_weights=", *sizes, *overrides)
    json_file = f"{OUT}/{name}.json"
    args = ("--config", R50, "--task", task, "--compare-torchvision", "--synthetic", "--no-loader",
            "--iters", str(iters), "--warmup", str(warmup), *(("--profile",) if profile else ()),
            *(("--count-ops",) if count_ops else ()),
            "--json", json_file, *overrides)
    return Run(name, "benchmark", args, limit_s, R50, overrides, json_file)


def _compile(timed: Run, limit_s: int) -> Run:
    """``timed``'s step, ours alone, warmed up and run once, side by side with the other
    checks: it compiles (and captures) the step, so ``timed`` later loads the compiled
    step from torch.compile's caches on this machine. Its seconds are the compilation's."""
    args = ("--config", R50, "--task", "train", "--synthetic", "--no-loader", "--iters", "1", "--warmup", "4",
            *timed.overrides)
    return Run(f"compile-{timed.name}", "benchmark", args, limit_s, R50, timed.overrides, parallel=True)


def _demo(name: str, limit_s: int, *overrides: str) -> Run:
    """``make demo``'s training on the GPU in its own run folder, started afresh, on its
    own copy of the generated data (the demos run side by side)."""
    data = f"{OUT}/{name}-data"
    overrides = ("train.device=cuda", f"data.train.root={data}", f"data.val.root={data}", *overrides)
    args = ("--config", DEMO, "--output-dir", f"{OUT}/{name}", "--overwrite", *overrides)
    return Run(name, "train", args, limit_s, DEMO, overrides, parallel=True)


def _loader(name: str, limit_s: int) -> Run:
    """``tools/benchmark.py --task data`` with R50-FPN 1x's input recipe (shorter side
    640-800, longer at most 1333, flips) and its ``data.num_workers``, on the generated
    shapes set with COCO's image sizes (480-640 px a side), written under ``gpu-report/``."""
    data = f"{OUT}/{name}-data"
    overrides = ("train.device=cuda", "model.num_classes=3", "data.format=shapes",
                 f"data.train.root={data}", f"data.val.root={data}", "data.train.split=train",
                 "data.val.split=val", "data.shapes.num_train=96", "data.shapes.num_val=8",
                 "data.shapes.min_side=480", "data.shapes.max_side=640")
    json_file = f"{OUT}/{name}.json"
    args = ("--config", R50, "--task", "data", "--iters", "300", "--warmup", "20", "--json", json_file, *overrides)
    return Run(name, "benchmark", args, limit_s, R50, overrides, json_file)


def _nms(name: str, limit_s: int) -> Run:
    """``tools/benchmark.py --task nms`` at R50-FPN 1x's sizes (2 images, the recipe's
    canvases): one step's proposal NMS, torchvision's way against both static methods."""
    overrides = ("train.device=cuda", CANVAS_R50, "solver.images_per_gpu=2")
    json_file = f"{OUT}/{name}.json"
    args = ("--config", R50, "--task", "nms", "--iters", "20", "--warmup", "3", "--json", json_file, *overrides)
    return Run(name, "benchmark", args, limit_s, R50, overrides, json_file)


def plan() -> List[Run]:
    """Every run: the checks of results side by side first, then the timed runs one at a
    time, the most wanted first (the budget may cut the tail)."""
    two, eight = "solver.images_per_gpu=2", "solver.images_per_gpu=8"
    static_demo = ("train.device=cuda", *STATIC, "model.canvas_sizes=[[160,160]]")
    graphs_two = _bench("train-r50-graphs-bf16-2img", "train", 120, *GRAPHS, CANVAS_R50, *BF16, two)
    graphs_eight = _bench("train-r50-graphs-bf16-8img", "train", 180, *GRAPHS, CANVAS_R50, *BF16, eight,
                          profile=True)
    # Canvases that fit the images (183 images/s at 8 in the fourth run, against 164 on the
    # recipe's). NHWC activations (train.channels_last) were measured there too and
    # dropped from the plan: no gain in the graph step (67.1 against 67.0 ms), slower
    # inference.
    eight_43 = _bench("train-r50-graphs-bf16-8img-canvas43", "train", 120, *GRAPHS, CANVAS_R50_43, *BF16, eight)
    # float16 (GPUs without bfloat16): the loss scale on the device, captured with the step.
    graphs_fp16 = _bench("train-r50-graphs-fp16-2img", "train", 120, *GRAPHS, CANVAS_R50, *FP16, two)
    return [
        Run("pytest-gpu", "pytest", ("-v", "-n", "4", "--timeout", "280", "-m", "gpu", "tests"), 300, parallel=True),
        Run("static-check-demo", "benchmark", ("--config", DEMO, "--task", "static-check", "--json",
                                               f"{OUT}/static-check-demo.json", *static_demo),
            300, DEMO, static_demo, f"{OUT}/static-check-demo.json", parallel=True),
        _demo("demo", 300),
        _demo("demo-graphs", 300, *GRAPHS, "model.canvas_sizes=[[160,160]]"),
        _compile(graphs_two, 300),
        _compile(graphs_eight, 300),
        _compile(eight_43, 300),
        _compile(graphs_fp16, 300),
        _bench("train-r50-eager-bf16-2img", "train", 60, *BF16, two, iters=10, warmup=3),
        graphs_two,
        graphs_eight,
        eight_43,
        _nms("nms-r50", 60),
        _bench("infer-r50-eval-amp", "infer", 90, "eval.amp=true", iters=10, warmup=3, profile=True),
        # The inference goal's candidate: fixed shapes, one CUDA graph per canvas (eval.static).
        _bench("infer-r50-static-graphs-amp", "infer", 90, "eval.amp=true", "eval.static=true", "eval.cuda_graphs=true",
               CANVAS_R50_43, iters=10, warmup=3),
        _bench("train-r50-static-bf16-2img", "train", 180, *STATIC, CANVAS_R50, *BF16, two, count_ops=True),
        _bench("train-r50-eager-fp16-2img", "train", 90, *FP16, two, iters=10, warmup=3, profile=True),
        graphs_fp16,
        # A candidate for the inference goal: the backbone and FPN compiled at fixed
        # canvases (FrozenBN, ReLU and the residual adds fused): x1.42 in the fourth run.
        _bench("infer-r50-eval-amp-compiled-backbone", "infer", 150, "eval.amp=true", "train.compile_backbone=true",
               CANVAS_R50_43, iters=10, warmup=3),
        _loader("data-r50-loader", 60),
        # The detection NMS's share of the graphed batch: half the default candidates.
        _bench("infer-r50-static-graphs-amp-1k", "infer", 90, "eval.amp=true", "eval.static=true",
               "eval.cuda_graphs=true", "eval.static_candidates=1024", CANVAS_R50_43, iters=10, warmup=3),
        _bench("train-r50-compiled-backbone-bf16-2img", "train", 150, "train.compile_backbone=true", CANVAS_R50,
               *BF16, two, iters=10, warmup=3),
    ]


def check_plan(runs: Sequence[Run]) -> None:
    """Every run's config loads with its overrides (a typo in a key fails here, on any
    machine) and the names are unique. Raises ``ValueError`` / ``ConfigError``."""
    names = [r.name for r in runs]
    if len(set(names)) != len(names):
        raise ValueError(f"gpu-check: duplicate run names in {names}")
    for run in runs:
        if run.config is not None:
            load_config(ROOT / run.config, list(run.overrides))


def _final_ap(run_dir: Path) -> Optional[float]:
    """The last evaluation's AP in ``run_dir/metrics.jsonl`` (None if there is none)."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return None
    aps = [rec["AP"] for rec in map(json.loads, path.read_text().splitlines()) if rec.get("type") == "eval"
           and "AP" in rec]
    return aps[-1] if aps else None


def _launch(run: Run, out_dir: Path) -> Tuple[subprocess.Popen, Path, float]:
    """Start ``run`` in its own session, its output to ``out_dir/<name>.log`` (pytest's
    failures also to ``<name>-failures.txt`` as they happen, see tests/conftest.py)."""
    log = out_dir / f"{run.name}.log"
    env = {**os.environ, "PYTEST_FAILURE_LOG": str(out_dir / f"{run.name}-failures.txt")}
    with open(log, "w") as out:
        proc = subprocess.Popen(run.argv(), cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env=env)
    return proc, log, time.perf_counter()


def _result(run: Run, rc: int, seconds: float, log: Path) -> Dict:
    """rc, seconds, the output's tail and the results ``run`` wrote."""
    result: Dict = {"name": run.name, "rc": rc, "seconds": round(seconds, 1),
                    "command": " ".join(run.argv()[1:]), "log": str(log),
                    "tail": log.read_text(errors="replace").strip().splitlines()[-15:]}
    if run.json is not None and (ROOT / run.json).is_file():
        result["result"] = json.loads((ROOT / run.json).read_text())
    if run.tool == "train":
        result["AP"] = _final_ap(ROOT / OUT / run.name)
    failures = log.with_name(f"{run.name}-failures.txt")
    if failures.is_file():
        result["failures"] = failures.read_text(errors="replace")[-6000:]
    return result


def _wait(started: Sequence[Tuple[Run, subprocess.Popen, Path, float]], limits: Sequence[float]) -> List[Dict]:
    """Wait for every started run until its limit after its start (then kill its process
    group: rc 124); each one's result with the seconds it ran."""
    ends: Dict[int, Tuple[int, float]] = {}
    while len(ends) < len(started):
        for i, ((run, proc, log, t0), limit) in enumerate(zip(started, limits)):
            if i in ends:
                continue
            rc, now = proc.poll(), time.perf_counter()
            if rc is None and now - t0 >= limit:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                rc = 124
            if rc is not None:
                ends[i] = (rc, now - t0)
        time.sleep(0.2)
    return [_result(run, *ends[i], log) for i, (run, _, log, _) in enumerate(started)]


def _skipped(run: Run) -> Dict:
    return {"name": run.name, "rc": None, "seconds": 0.0,
            "skipped": f"budget: run it with python tools/gpu_check.py --only {run.name}"}


def run_all(runs: Sequence[Run], budget_s: float, out_dir: Path = ROOT / OUT) -> List[Dict]:
    """The ``parallel`` runs side by side, then the others one at a time, in order. A run
    gets its ``limit_s`` or what is left of ``budget_s``; one for which less than
    ``min(limit_s, 30)`` seconds are left is skipped (rc None) with the command that runs
    it later. Results in ``runs``' order."""
    start, results = time.perf_counter(), {}
    side = [r for r in runs if r.parallel and budget_s >= min(r.limit_s, 30)]
    for result in _wait([(r, *_launch(r, out_dir)) for r in side], [min(r.limit_s, budget_s) for r in side]):
        results[result["name"]] = result
    for run in runs:
        left = budget_s - (time.perf_counter() - start)
        if run.name in results:
            continue
        if run.parallel or left < min(run.limit_s, 30):
            results[run.name] = _skipped(run)
            continue
        results[run.name] = _wait([(run, *_launch(run, out_dir))], [min(run.limit_s, left)])[0]
    return [results[r.name] for r in runs]


def figures(result: Dict) -> str:
    """The figures of one result for the table."""
    res = result.get("result") or {}
    busy = ", ".join(f"{k} busy {p['gpu_busy_ms']:.1f} ms" for k, p in (res.get("profile") or {}).items()
                     if "gpu_busy_ms" in p)
    reserve = res.get("runs", {}).get("ours", {}).get("reserved_growth_mib")
    ops = res.get("ops_per_step") or {}
    counted = (f"; aten ops/step ours {ops['ours']}, torchvision {ops['torchvision']} "
               f"(x{ops['ours'] / max(ops['torchvision'], 1):.2f})" if "ours" in ops and "torchvision" in ops else "")
    extra = ((f"; ours reserve +{reserve:.0f} MiB" if reserve is not None else "")
             + (f"; profiled: {busy}" if busy else "") + counted)
    if "ratio_pairwise_median" in res:
        ours = res.get("runs", {}).get("ours", {})
        theirs = res.get("runs", {}).get("torchvision", {})
        return (f"ours {ours.get('images_per_s', float('nan')):.1f} img/s, torchvision "
                f"{theirs.get('images_per_s', float('nan')):.1f} img/s, x{res['ratio_pairwise_median']:.2f} (pairwise)"
                + extra)
    stopped = res.get("runs", {}).get("torchvision", {}).get("stopped")
    if stopped:
        ours = res["runs"].get("ours", {})
        return f"ours {ours.get('images_per_s', float('nan')):.1f} img/s; torchvision stopped: {stopped}" + extra
    loader = res.get("runs", {}).get("loader")
    if loader is not None:
        return f"loader {loader['images_per_s']:.1f} img/s ({loader['num_workers']} workers)"
    if res.get("task") == "nms":
        times = ", ".join(f"{k} {v['median_s'] * 1e3:.2f} ms" for k, v in res["runs"].items())
        return f"{times}; matches torchvision: {res['matches_torchvision']}"
    keys = ("graph_breaks", "recompiles", "host_syncs_per_step", "max_loss_rel_diff", "nms_method")
    found = [f"{k}={res[k]:.3g}" if isinstance(res[k], float) else f"{k}={res[k]}" for k in keys if k in res]
    if result.get("AP") is not None:
        found.append(f"AP={result['AP']:.4f}")
    return result.get("skipped", ", ".join(found))


def table(results: Sequence[Dict]) -> str:
    """One line per run: name, rc, seconds, figures."""
    lines = [f"{'run':40s} {'rc':>4s} {'s':>6s}  figures"]
    for r in results:
        rc = "-" if r["rc"] is None else str(r["rc"])
        lines.append(f"{r['name']:40s} {rc:>4s} {r['seconds']:>6.1f}  {figures(r)}")
    return "\n".join(lines)


def select(runs: Sequence[Run], only: Optional[str]) -> List[Run]:
    """``runs`` limited to the comma-separated names of ``--only`` (all when None)."""
    if not only:
        return list(runs)
    wanted = [n.strip() for n in only.split(",") if n.strip()]
    unknown = sorted(set(wanted) - {r.name for r in runs})
    if unknown:
        raise ValueError(f"--only: unknown runs {unknown}; see python tools/gpu_check.py --list")
    return [r for r in runs if r.name in wanted]


def unfinished(report: Dict) -> List[str]:
    """The runs that ``report`` recorded as skipped (rc None) or stopped at a limit (124)."""
    return [r["name"] for r in report.get("runs", []) if r["rc"] in (None, 124)]


def merge(report: Optional[Dict], fresh: Dict, names: Sequence[str]) -> Dict:
    """``fresh`` (this call's report) with the runs of an earlier ``report`` of the same
    device that this call did not run, in ``names``' order (the plan's), then any others."""
    if report is None or report.get("device") != fresh["device"]:
        return fresh
    by_name = {r["name"]: r for r in report.get("runs", [])}
    by_name.update({r["name"]: r for r in fresh["runs"]})
    order = [n for n in names if n in by_name] + [n for n in by_name if n not in names]
    return {**fresh, "runs": [by_name[n] for n in order]}


def _read_report(path: Path) -> Optional[Dict]:
    return json.loads(path.read_text()) if path.is_file() else None


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="GPU checks end to end -> gpu-report.json (see benchmarks/gpu_check.py)")
    p.add_argument("--list", action="store_true", help="print the runs (their configs checked) and exit")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--only", help="comma-separated run names (see --list); merged into the report")
    which.add_argument("--rest", action="store_true",
                       help="the runs that gpu-report.json records as skipped or cut at their limit; merged into it")
    p.add_argument("--budget-s", type=float, default=BUDGET_S, help=f"seconds for all runs (default {BUDGET_S})")
    p.add_argument("--why-not", action="store_true",
                   help="print why this machine cannot run the checks (nothing where it can) and exit 0: the probe "
                        "of `make gpu-check`, which then stops with that one line")
    return p.parse_args(list(argv))


NO_CUDA = "make gpu-check needs a CUDA GPU: torch.cuda.is_available() is False here; nothing was run"


def _print_plan(runs: Sequence[Run], budget_s: float) -> None:
    for run in runs:
        print(f"{run.name:40s} {run.limit_s:>4d} s  python {' '.join(run.argv()[1:])}")
    side = max([r.limit_s for r in runs if r.parallel], default=0)
    print(f"budget {budget_s:.0f} s: side by side at most {side} s, then one at a time at most "
          f"{sum(r.limit_s for r in runs if not r.parallel)} s (what does not fit is skipped, see --only)")


def main(argv: Sequence[str] = ()) -> int:
    """``--list``: the plan, 0; ``--why-not``: the line below where there is no CUDA, 0;
    without CUDA: one line, 2; else the runs, ``gpu-report.json``,
    the table, and 0 if every run that ran passed (1 otherwise)."""
    args = parse_args(argv)
    if args.why_not:
        if not torch.cuda.is_available():
            print(NO_CUDA)
        return 0
    if not args.list and not torch.cuda.is_available():
        print(NO_CUDA)
        return 2
    path = ROOT / "gpu-report.json"
    earlier = _read_report(path) if args.only or args.rest else None
    only = args.only
    if args.rest:
        if earlier is None:
            print(f"gpu-check: --rest: no {path.name} here; run python tools/gpu_check.py first", file=sys.stderr)
            return 1
        only = ",".join(unfinished(earlier))
        if not only:
            print(f"gpu-check: --rest: {path.name} has no skipped or cut run; nothing to do")
            return 0
    try:
        runs = select(plan(), only)
        check_plan(runs)
    except ValueError as exc:
        print(f"gpu-check: {exc}", file=sys.stderr)
        return 1
    if args.list:
        _print_plan(runs, args.budget_s)
        return 0
    (ROOT / OUT).mkdir(exist_ok=True)
    results = run_all(runs, args.budget_s)
    fresh = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "runs": results}
    report = merge(earlier, fresh, [r.name for r in plan()])
    path.write_text(json.dumps(report, indent=2, default=str))
    print(table(report["runs"]))
    return 0 if all(r["rc"] in (0, None) for r in results) else 1
