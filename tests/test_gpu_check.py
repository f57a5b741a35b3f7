"""``make gpu-check`` (benchmarks/gpu_check.py) on a machine without CUDA: one line and
exit status 2; its plan, checked here so that a typo cannot waste a GPU session:
every run the issue lists is there, every config loads with its overrides, every
command line parses with its tool's own parser; the budget logic."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from benchmarks import gpu_check
from benchmarks.gpu_check import CANVAS_R50 as CANVAS, Run, plan, run_all, select

from conftest import ROOT, load_tool


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA present: gpu-check would run the checks")
def test_gpu_check_without_cuda_is_one_line_and_exit_2():
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_check.py")], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    lines = (out.stdout + out.stderr).strip().splitlines()
    assert len(lines) == 1 and "CUDA" in lines[0]


def _make_would_not_install() -> bool:
    """``make`` is here, and this interpreter's environment is set up (its stamp newer than
    pyproject.toml), so that ``make gpu-check VENV=<it>`` installs nothing first."""
    stamp = os.path.join(sys.prefix, ".installed")
    return (shutil.which("make") is not None and os.path.isfile(stamp)
            and os.path.getmtime(stamp) >= os.path.getmtime(ROOT / "pyproject.toml"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA present: gpu-check would run the checks")
@pytest.mark.skipif(not _make_would_not_install(), reason="no make, or this environment is not make's (make setup)")
def test_make_gpu_check_without_cuda_is_one_line_and_exit_2():
    # make reports a failing recipe with a line of its own ("make: *** [Makefile:N:
    # gpu-check] Error 2"); the target stops with the probe's line alone.
    out = subprocess.run(["make", "--no-print-directory", "gpu-check", f"VENV={sys.prefix}"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stdout + out.stderr
    lines = (out.stdout + out.stderr).strip().splitlines()
    assert len(lines) == 1 and "needs a CUDA GPU" in lines[0], lines

def test_the_plan_runs_what_the_issue_lists():
    runs = {r.name: r for r in plan()}
    argv = runs["pytest-gpu"].argv()
    assert argv[1:3] == ["-m", "pytest"] and argv[-3:] == ["-m", "gpu", "tests"]
    train = [r for r in runs.values() if "--task" in r.args and "train" in r.args and not r.parallel]
    # the CUDA-graph steps compile side by side with the checks first (the same overrides),
    # so that the timed runs load the compiled step from the caches
    compiled = {r.name: r for r in runs.values() if r.name.startswith("compile-")}
    assert compiled and all(r.parallel and r.overrides == runs[n[len("compile-"):]].overrides
                            for n, r in compiled.items())
    assert {n[len("compile-"):] for n in compiled} == {r.name for r in train if "train.cuda_graphs=true" in r.overrides}
    over = {r.name: set(r.overrides) for r in train}
    graphs, static = {"train.static_step=true", "train.cuda_graphs=true"}, {"train.static_step=true"}
    assert any(graphs <= o and "solver.images_per_gpu=2" in o for o in over.values())
    assert any(graphs <= o and "solver.images_per_gpu=8" in o for o in over.values())
    assert any(static <= o and "train.cuda_graphs=true" not in o for o in over.values())
    assert any("train.compile_backbone=true" in o for o in over.values())
    eager = [o for o in over.values() if not o & (static | {"train.compile_backbone=true"})]
    assert {"train.amp.dtype=bfloat16", "train.amp.dtype=float16"} <= set().union(*eager)
    assert all("--compare-torchvision" in r.args and "configs/faster_rcnn_r50_fpn_1x_coco.yaml" in r.args
               for r in train)
    assert "eval.amp=true" in runs["infer-r50-eval-amp"].overrides
    assert runs["demo"].tool == runs["demo-graphs"].tool == "train"
    assert graphs <= set(runs["demo-graphs"].overrides)
    assert "static-check" in runs["static-check-demo"].args
    # the loader at the recipe's input sizes and worker count, on images of COCO's sizes
    loader = runs["data-r50-loader"]
    assert loader.config == "configs/faster_rcnn_r50_fpn_1x_coco.yaml" and "data" in loader.args
    assert not any(o.startswith(("input.", "data.num_workers")) for o in loader.overrides)
    assert {"data.shapes.min_side=480", "data.shapes.max_side=640"} <= set(loader.overrides)
    nms = runs["nms-r50"]  # the proposal NMS alone, at the recipe's sizes
    assert "nms" in nms.args and "solver.images_per_gpu=2" in nms.overrides and CANVAS in nms.overrides


def test_every_command_parses_and_every_config_loads():
    gpu_check.check_plan(plan())  # load_config with each run's overrides
    parsers = {"benchmark": load_tool("benchmark").parse_args, "train": load_tool("train").parse_args}
    for run in plan():
        if run.tool in parsers:
            args = parsers[run.tool](list(run.args))
            assert args.config == run.config and list(args.overrides) == list(run.overrides), run.name
    with pytest.raises(ValueError, match="unknown runs"):
        select(plan(), "demo,no-such-run")
    assert [r.name for r in select(plan(), "demo-graphs, demo")] == ["demo", "demo-graphs"]


def test_list_prints_the_plan_without_a_gpu():
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_check.py"), "--list"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert [line.split()[0] for line in lines[:-1]] == [r.name for r in plan()]
    assert lines[-1].startswith("budget 570 s")


def test_runs_that_do_not_fit_the_budget_are_skipped_with_their_command(tmp_path):
    quick = Run("pytest-version", "pytest", ("--version",), 120)
    late = Run("late", "pytest", ("--version",), 120)
    side = Run("side", "pytest", ("--version",), 120, parallel=True)
    results = run_all([side, quick, late], budget_s=0.0, out_dir=tmp_path)
    assert [r["rc"] for r in results] == [None, None, None]
    assert "--only late" in results[2]["skipped"] and "--only side" in results[0]["skipped"]
    # a budget below a run's limit cuts the limit, side by side as one at a time
    results = run_all([side, quick], 60.0, tmp_path)
    assert [r["rc"] for r in results] == [0, 0]
    assert "pytest" in " ".join(results[1]["tail"]) and (tmp_path / "pytest-version.log").is_file()


def test_side_by_side_runs_report_the_seconds_they_ran(tmp_path):
    """Collected in order, a quick run is still timed to its own end, and a run past its
    limit is killed with rc 124."""
    (tmp_path / "test_sleep.py").write_text("import time\n\ndef test_sleep():\n    time.sleep(4)\n")
    slow = Run("slow", "pytest", ("-q", "-p", "no:cacheprovider", str(tmp_path / "test_sleep.py")), 120, parallel=True)
    quick = Run("quick", "pytest", ("--version",), 120, parallel=True)
    cut = Run("cut", "pytest", ("-q", "-p", "no:cacheprovider", str(tmp_path / "test_sleep.py")), 1, parallel=True)
    results = {r["name"]: r for r in run_all([slow, quick, cut], 240.0, tmp_path)}
    assert results["slow"]["rc"] == 0 and results["slow"]["seconds"] >= 4
    assert results["quick"]["rc"] == 0 and results["quick"]["seconds"] < results["slow"]["seconds"] - 2
    assert results["cut"]["rc"] == 124 and 1 <= results["cut"]["seconds"] < 3


def test_a_missing_package_is_one_line_naming_it():
    """An offline GPU machine may lack a dependency (the first GPU run lacked msgspec):
    one line naming it, not a traceback through the imports."""
    code = ("import runpy, sys; sys.path.insert(0, 'tools'); sys.modules['msgspec'] = None; sys.argv = ['tools/gpu_check.py']; "
            "runpy.run_path('tools/gpu_check.py', run_name='__main__')")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    lines = (out.stdout + out.stderr).strip().splitlines()
    assert len(lines) == 1 and "'msgspec' is missing" in lines[0], lines


def test_the_table_shows_a_static_checks_figures_and_its_nms():
    res = {"graph_breaks": 0, "recompiles": 0, "host_syncs_per_step": 0.0, "max_loss_rel_diff": 4.5e-05,
           "nms_method": "scan", "compile_s": 12.0}
    assert gpu_check.figures({"result": res}) == (
        "graph_breaks=0, recompiles=0, host_syncs_per_step=0, max_loss_rel_diff=4.5e-05, nms_method=scan")
    assert gpu_check.figures({"result": {}, "AP": 0.71781}) == "AP=0.7178"


def _fake_cuda_call(monkeypatch, tmp_path, device: str = "GPU A"):
    """main() as on a CUDA machine, in ``tmp_path``, with each run "done" (rc 0) at once;
    returns the list of run names each call ran."""
    calls = []

    def fake_run_all(runs, budget_s):
        calls.append([r.name for r in runs])
        return [{"name": r.name, "rc": 0, "seconds": 1.0} for r in runs]

    monkeypatch.setattr(gpu_check.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu_check.torch.cuda, "get_device_name", lambda index=0: device)
    monkeypatch.setattr(gpu_check, "ROOT", tmp_path)
    monkeypatch.setattr(gpu_check, "check_plan", lambda runs: None)
    monkeypatch.setattr(gpu_check, "run_all", fake_run_all)
    return calls


def test_rest_runs_what_the_report_skipped_or_cut_and_merges_into_it(monkeypatch, tmp_path, capsys):
    calls = _fake_cuda_call(monkeypatch, tmp_path)
    names = [r.name for r in plan()]
    assert gpu_check.main(["--rest"]) == 1 and "no gpu-report.json" in capsys.readouterr().err
    earlier = [{"name": n, "rc": 0, "seconds": 5.0} for n in names]
    earlier[3] = {"name": names[3], "rc": 124, "seconds": 300.0}
    earlier[-1] = {"name": names[-1], "rc": None, "seconds": 0.0, "skipped": "budget"}
    earlier.append({"name": "retired-run", "rc": 1, "seconds": 2.0})  # no longer in the plan: kept, last
    report = tmp_path / "gpu-report.json"
    report.write_text(json.dumps({"device": "GPU A", "torch": "x", "runs": earlier}))
    assert gpu_check.main(["--rest"]) == 0
    assert calls == [[names[3], names[-1]]]
    merged = json.loads(report.read_text())["runs"]
    assert [r["name"] for r in merged] == names + ["retired-run"]
    assert [r["seconds"] for r in merged[:5]] == [5.0, 5.0, 5.0, 1.0, 5.0] and merged[-2]["rc"] == 0
    assert gpu_check.main(["--rest"]) == 0 and "nothing to do" in capsys.readouterr().out and len(calls) == 1


def test_only_merges_into_a_report_of_the_same_device_and_a_full_run_replaces_it(monkeypatch, tmp_path):
    report = tmp_path / "gpu-report.json"
    report.write_text(json.dumps({"device": "GPU B", "runs": [{"name": "demo", "rc": 1, "seconds": 9.0}]}))
    _fake_cuda_call(monkeypatch, tmp_path)  # another device: its figures are not mixed in
    assert gpu_check.main(["--only", "nms-r50"]) == 0
    assert [r["name"] for r in json.loads(report.read_text())["runs"]] == ["nms-r50"]
    assert gpu_check.main(["--only", "demo"]) == 0
    assert [r["name"] for r in json.loads(report.read_text())["runs"]] == ["demo", "nms-r50"]
    assert gpu_check.main([]) == 0
    assert [r["name"] for r in json.loads(report.read_text())["runs"]] == [r.name for r in plan()]


def test_the_table_shows_the_nms_timings_and_their_check():
    res = {"task": "nms", "runs": {"torchvision": {"median_s": 0.0031}, "scan": {"median_s": 0.0004}},
           "matches_torchvision": {"scan": True}}
    assert gpu_check.figures({"result": res}) == "torchvision 3.10 ms, scan 0.40 ms; matches torchvision: {'scan': True}"


def test_the_table_shows_ours_when_torchvision_stopped():
    res = {"runs": {"ours": {"images_per_s": 40.04}, "torchvision": {"iters": 0, "stopped": "FloatingPointError ..."}}}
    assert gpu_check.figures({"result": res}) == "ours 40.0 img/s; torchvision stopped: FloatingPointError ..."


def test_the_table_shows_the_operator_counts_of_the_static_step():
    """The issue's goal of at most 0.3x torchvision's operators per step is measured on the
    GPU by the static step's run (--count-ops), and its table line shows the ratio."""
    static = next(r for r in plan() if r.name == "train-r50-static-bf16-2img")
    assert "--count-ops" in static.argv()
    res = {"ratio_pairwise_median": 1.5, "runs": {"ours": {"images_per_s": 60.0}, "torchvision": {"images_per_s": 40.0}},
           "ops_per_step": {"ours": 2100, "torchvision": 7000}}
    assert gpu_check.figures({"result": res}) == ("ours 60.0 img/s, torchvision 40.0 img/s, x1.50 (pairwise); "
                                                  "aten ops/step ours 2100, torchvision 7000 (x0.30)")


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["one-process", "xdist"])
def test_pytest_failures_are_written_as_they_happen(tmp_path, workers):
    """gpu-check's pytest run sets PYTEST_FAILURE_LOG: each failure, once, with its reason
    (a session cut by its time limit prints no summary; the second GPU run lost two)."""
    (tmp_path / "test_cases.py").write_text(
        "def test_fails():\n    assert 1 == 2, 'one is not two'\n\n\ndef test_passes():\n    pass\n")
    log = tmp_path / "failures.txt"
    env = {**os.environ, "PYTEST_FAILURE_LOG": str(log), "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT)])}
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "conftest", *workers,
                          str(tmp_path / "test_cases.py")], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 1, out.stdout + out.stderr
    text = log.read_text()
    assert text.count("FAILED ") == 1 and "test_cases.py::test_fails (call)" in text and "one is not two" in text


def test_a_pytest_run_cut_at_its_limit_keeps_its_failures(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT / "tests"), str(ROOT)]))
    (tmp_path / "test_late.py").write_text(
        "import time\n\n\ndef test_a_fails():\n    assert 1 == 2, 'one is not two'\n\n\n"
        "def test_b_hangs():\n    time.sleep(120)\n")
    run = Run("late", "pytest", ("-q", "-p", "no:cacheprovider", "-p", "conftest", str(tmp_path / "test_late.py")), 20,
              parallel=True)
    result = run_all([run], 240.0, tmp_path)[0]
    assert result["rc"] == 124 and "one is not two" in result["failures"]
    assert "one is not two" not in "\n".join(result["tail"])  # pytest never printed it
