"""``tools/benchmark.py --task scaling``: world sizes 1 and 2 (gloo ranks spawned by the
task), the all-reduce share, the DDP sweep's verdict, and bad arguments."""

from __future__ import annotations

import json
import math

import pytest
import torch

from benchmarks.scaling import ScalingSweep, allreduce_share, sweep_verdict
from detector.config import load_config
from conftest import TINY_CONFIG, load_tool, tiny_overrides



@pytest.fixture
def restore_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def _run(times, cpu_median=1.0):
    times = list(times)
    return {"times_s": times, "median_s": sorted(times)[len(times) // 2], "cpu_median_s": cpu_median,
            "images_per_s": 1.0}


def test_allreduce_share_pairwise():
    sync = _run([1.0, 2.0, 1.0])
    no_sync = _run([0.8, 1.0, 0.9], cpu_median=0.75)
    a = allreduce_share(sync, no_sync)
    # Pair by pair: 1 - 0.8/1 = 0.2, 1 - 1/2 = 0.5, 1 - 0.9/1 = 0.1 -> median 0.2.
    assert math.isclose(a["share_pairwise_median"], 0.2)
    assert math.isclose(a["share_of_medians"], 1 - 0.9 / 1.0)
    assert math.isclose(a["allreduce_median_s"], 0.1)
    assert math.isclose(a["cpu_share_of_medians"], 0.25)
    assert "no_sync" in a["method"]


def test_sweep_verdict_needs_a_win_beyond_noise():
    base = [1.0, 1.0, 1.0, 1.0]
    runs = {"base": _run(base), "fast": _run([0.8, 0.85, 0.9, 0.8]), "noisy": _run([0.7, 1.3, 0.9, 1.2]),
            "tiny_gain": _run([0.99, 0.99, 0.99, 0.99])}
    quiet = _run([1.0, 1.01, 0.99, 1.0])
    v = sweep_verdict(runs, "base", quiet)
    assert v["winner"] == "fast" and v["points"]["fast"]["beyond_noise"]
    assert not v["points"]["noisy"]["beyond_noise"]  # faster median, but q25 below 1
    assert not v["points"]["tiny_gain"]["beyond_noise"]  # 1 % is within WIN_MIN_GAIN
    assert v["points"]["base"]["speedup_median"] == 1.0
    # The same gain on a machine where the setting against itself varies by +-25 %: noise.
    loud = _run([0.75, 0.8, 1.25, 1.3])
    assert v["noise"]["speedup_q75"] < 1.02 and sweep_verdict(runs, "base", loud)["winner"] is None
    # Quartiles clear of the A/A's, but a gain (+4 %) smaller than its spread (IQR ~0.1): noise.
    spread = _run([0.95, 1.05, 1.0, 0.9])
    runs["small_gain"] = _run([0.96, 0.96, 0.95, 0.96])
    assert not sweep_verdict(runs, "base", spread)["points"]["small_gain"]["beyond_noise"]
    del runs["fast"], runs["small_gain"]
    assert sweep_verdict(runs, "base", quiet)["winner"] is None


def test_bad_sweep_arguments(capsys):
    with pytest.raises(ValueError, match=r"--bucket-caps must be numbers > 0"):
        ScalingSweep(bucket_caps_mb=(0.0,))
    with pytest.raises(ValueError, match=r"--world-sizes must be integers >= 1"):
        ScalingSweep(world_sizes=(0, 2))
    tool = load_tool("benchmark")
    for flag, value, message in (("--bucket-views", "maybe", "--bucket-views takes false and/or true, got 'maybe'"),
                                 ("--bucket-caps", "25,-1", "--bucket-caps must be numbers > 0 (MiB), got [25.0, -1.0]"),
                                 ("--world-sizes", "1,two", "invalid literal for int()")):
        with pytest.raises(SystemExit) as exc:
            tool.parse_args(["--config", str(TINY_CONFIG), "--task", "scaling", flag, value])
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err


@pytest.mark.dist
@pytest.mark.slow
def test_scaling_task_json(tmp_path, tiny_data, restore_threads):
    tool = load_tool("benchmark")
    out = tmp_path / "scaling.json"
    rc = tool.main(["--config", str(TINY_CONFIG), "--task", "scaling", "--iters", "2", "--warmup", "0",
                    "--num-batches", "1", "--threads", "2", "--world-sizes", "1,2", "--bucket-caps", "25",
                    "--bucket-views", "false", "--json", str(out), *tiny_overrides(tiny_data)])
    assert rc == 0
    result = json.loads(out.read_text())
    runs, s = result["runs"], result["scaling"]
    assert set(runs) == {"ws1", "ws2", "ws2_repeat", "ws2_no_sync"}
    per_gpu = load_config(TINY_CONFIG).solver.images_per_gpu
    for name, run in runs.items():
        assert run["iters"] == 2 and len(run["times_s"]) == 2, name
        assert 0 < run["min_s"] <= run["median_s"] <= run["max_s"] < 600, name
        assert run["images_per_iter"] == per_gpu * run["world_size"], name
        assert math.isclose(run["images_per_s"], run["images_per_iter"] / run["median_s"], rel_tol=1e-9)
    assert runs["ws1"]["world_size"] == 1 and runs["ws2"]["world_size"] == 2
    assert s["backend"] == "gloo" and s["threads_total"] == 2
    assert s["threads_per_rank"] == {"1": 2, "2": 1}
    assert math.isclose(s["efficiency"], runs["ws2"]["images_per_s"] / (2 * runs["ws1"]["images_per_s"]))
    assert math.isclose(s["allreduce"]["share_of_medians"], 1 - runs["ws2_no_sync"]["median_s"] / runs["ws2"]["median_s"])
    assert s["allreduce"]["share_pairwise_median"] < 1
    assert set(s["sweep"]["points"]) == {"cap25_viewfalse"} and s["sweep"]["baseline"] == "cap25_viewfalse"
    assert s["sweep"]["winner"] is None and s["sweep"]["points"]["cap25_viewfalse"]["speedup_median"] == 1.0
    assert {"speedup_median", "speedup_q25", "speedup_q75"} <= set(s["sweep"]["noise"])
    assert s["skipped"] == {}
