"""``tools/benchmark.py --task time-to-accuracy``: time to accuracy, ours against torchvision's
references/detection recipe, on the tiny test config with a budget of seconds."""

from __future__ import annotations

import json
import math

import pytest
import torch

from conftest import TINY_CONFIG, load_tool, tiny_config, tiny_overrides
from benchmarks.time_to_accuracy import Deadline, benchmark_time_to_accuracy
from benchmarks.torchvision_ref import REFERENCE_LR_PER_IMAGE, reference_warmup_iters

RUN_FIELDS = ("iterations", "images", "train_s", "images_per_s", "stopped_by", "AP", "AP50", "eval_s", "lr_last",
              "recipe", "loadavg_start", "loadavg_train_end")


@pytest.mark.slow  # ~20 s: two short trainings to a target (a benchmark of minutes on the demo)
def test_time_to_accuracy_json_within_budget(tiny_data, tmp_path):
    budget = 2.0
    out = tmp_path / "time_to_accuracy.json"
    rc = load_tool("benchmark").main(["--config", str(TINY_CONFIG), "--task", "time-to-accuracy", "--budget-s", str(budget), "--json", str(out),
                            *tiny_overrides(tiny_data, None, "solver.max_iter=100000")])
    assert rc == 0
    result = json.loads(out.read_text())
    assert result["task"] == "time-to-accuracy" and result["device"] == "cpu"
    t = result["time_to_accuracy"]
    assert t["budget_s"] == budget and t["device"] == "cpu" and t["threads"] == torch.get_num_threads()
    assert t["images_per_step"] == 2 and t["val_images"] == 4
    assert set(t["runs"]) == {"ours", "torchvision"}
    for name, run in t["runs"].items():
        for key in RUN_FIELDS:
            assert key in run, f"{name}: missing field {key}"
        assert run["stopped_by"] == "budget", name
        assert run["iterations"] > 0 and run["images"] == 2 * run["iterations"], name
        assert 0.0 <= run["AP"] <= run["AP50"] <= 1.0, name
        assert run["eval_s"] > 0
        # The run ends with the step during which the budget runs out: about one step past it
        # (a step of a loaded machine may take several mean steps; a deadline that failed would
        # run to max_iter=100000, hours).
        step_s = run["train_s"] / run["iterations"]
        assert 0.5 * budget <= run["train_s"] <= budget + 3 * step_s + 5.0, (name, run["train_s"], step_s)
        assert math.isclose(run["images_per_s"], run["images"] / run["train_s"], rel_tol=1e-2)
        assert len(run["loadavg_start"]) == 3
    assert t["runs"]["torchvision"]["recipe"]["lr"] == pytest.approx(0.02 / 16 * 2)


def test_time_to_accuracy_stops_at_max_iter_with_each_recipe_lr(tiny_data, tmp_path):
    """A budget the schedule ends first: both stop at solver.max_iter; the LRs are the
    recipes' (ours: the config's after its 2 warm-up iterations; torchvision's: 0.02/16
    per image after min(1000, batches per epoch - 1) = 3 warm-up iterations)."""
    cfg = tiny_config(tiny_data, tmp_path / "run", "solver.max_iter=3")
    t = benchmark_time_to_accuracy(cfg, budget_s=600.0)["time_to_accuracy"]
    ours, tv = t["runs"]["ours"], t["runs"]["torchvision"]
    for run in (ours, tv):
        assert run["iterations"] == 3 and run["stopped_by"] == "solver.max_iter"
        assert 0.0 <= run["AP"] <= 1.0 and 0.0 <= run["AP50"] <= 1.0
        assert run["train_s"] < 600
    assert ours["lr_last"] == pytest.approx(cfg.solver.lr)
    assert tv["lr_last"] == pytest.approx(REFERENCE_LR_PER_IMAGE * cfg.solver.images_per_gpu)


def test_reference_warmup_iters():
    assert reference_warmup_iters(200) == 199  # the demo: 800 images, 4 per step
    assert reference_warmup_iters(5000) == 1000
    assert reference_warmup_iters(1) == 1  # never 0: LinearLR would hold 1/1000


def test_deadline_asks_for_the_last_step():
    d = Deadline(budget_s=0.05)
    d.begin()
    assert not d.step_done()  # a step of ~0: far from the budget
    d.last_end -= 0.03  # pretend the next step takes 30 ms
    d.start -= 0.03
    assert d.step_done()  # 30 ms elapsed + a 30 ms step >= 50 ms: the next step is the last
    assert d.elapsed_s >= 0.03


@pytest.mark.parametrize("argv, message", [
    (["--task", "time-to-accuracy", "--budget-s", "0"], "--budget-s must be > 0"),
    (["--task", "train"], "--config is required"),
])
def test_bad_arguments_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        load_tool("benchmark").main(argv)
    assert exc.value.code != 0
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_time_to_accuracy_on_cuda_with_amp(tiny_data, tmp_path, dtype):
    """Both recipes on the GPU under autocast (float16: with a GradScaler on each side)."""
    cfg = tiny_config(tiny_data, tmp_path / "run", "solver.max_iter=3", "train.device=cuda",
                      "train.amp.enabled=true", f"train.amp.dtype={dtype}", "train.deterministic=false")
    t = benchmark_time_to_accuracy(cfg, budget_s=600.0)["time_to_accuracy"]
    assert t["device"].startswith("cuda") and t["amp"] and t["amp_dtype"] == dtype and t["gpu"]
    for run in t["runs"].values():
        assert run["iterations"] == 3 and run["stopped_by"] == "solver.max_iter"
        assert 0.0 <= run["AP"] <= 1.0 and 0.0 <= run["AP50"] <= 1.0
