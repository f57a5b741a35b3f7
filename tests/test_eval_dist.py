"""Distributed evaluation: 2 ranks (torchrun, gloo) give exactly the 1-rank metrics and
detections, and every image is scored once, with an odd number of images."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from detector.evaluation.report import _check_coverage
from conftest import TINY_CONFIG, tiny_overrides

from conftest import ROOT  # noqa: E402
NUM_VAL = 7  # odd: shards of 4 and 3


def test_coverage_check_names_duplicates_and_missing():
    _check_coverage([1, 2, 3], [3, 1, 2])
    with pytest.raises(RuntimeError, match=r"more than once, e.g. image_id \[2\]"):
        _check_coverage([1, 2, 3], [1, 2, 2, 3])
    with pytest.raises(RuntimeError, match=r"missed 1 image\(s\), e.g. image_id \[3\]"):
        _check_coverage([1, 2, 3], [1, 2])


def _eval_tool(launcher: list, overrides, weights: Path, out: Path, expect_rc: int = 0) -> str:
    """``tools/eval.py`` started by ``launcher`` (``[python]``, or ``torchrun``'s command);
    its output, after checking its exit status against ``expect_rc``."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [
        *launcher, str(ROOT / "tools" / "eval.py"), "--config", str(TINY_CONFIG),
        "--weights", str(weights), "--output-dir", str(out), *overrides,
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert (proc.returncode == 0) == (expect_rc == 0), proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def _torchrun(nproc: int, overrides, weights: Path, out: Path, expect_rc: int = 0, *launcher: str) -> str:
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *launcher]
    return _eval_tool(torchrun, overrides, weights, out, expect_rc)


@pytest.mark.slow
@pytest.mark.dist
def test_two_ranks_equal_one_rank(tmp_path):
    from detector.config import load_config
    from detector.data.shapes import ensure_shapes
    from detector.modeling import build_model

    data = tmp_path / "shapes"
    overrides = tiny_overrides(
        data, None, "data.shapes.num_train=1", f"data.shapes.num_val={NUM_VAL}", "data.shapes.max_side=128",
        "input.min_size_test=96", "input.max_size_test=128", "roi_heads.score_thresh=0.01",
        "eval.images_per_gpu=1", "eval.score_thresh=0.2",
    )
    cfg = load_config(TINY_CONFIG, overrides)
    ensure_shapes(data, 1, NUM_VAL, cfg.data.shapes.seed, 64, 128)
    torch.manual_seed(123)
    torch.save(build_model(cfg).state_dict(), tmp_path / "w.pth")

    log1 = _eval_tool([sys.executable], overrides, tmp_path / "w.pth", tmp_path / "one")  # one plain process
    log2 = _torchrun(2, overrides, tmp_path / "w.pth", tmp_path / "two")
    assert "images per rank: [7]" in log1
    assert "images per rank: [4, 3]" in log2

    m1 = json.loads((tmp_path / "one" / "metrics.json").read_text())
    m2 = json.loads((tmp_path / "two" / "metrics.json").read_text())
    m1.pop("time_per_image_ms")
    m2.pop("time_per_image_ms")
    assert m1 == m2  # exactly, every key
    assert m1["num_images"] == NUM_VAL and m1["num_detections"] > 0
    d1 = json.loads((tmp_path / "one" / "detections.json").read_text())
    d2 = json.loads((tmp_path / "two" / "detections.json").read_text())
    assert d1 == d2
    gt_ids = {img["id"] for img in json.loads((data / "val.json").read_text())["images"]}
    assert len(gt_ids) == NUM_VAL and {d["image_id"] for d in d1} <= gt_ids
    # The two ranks shared the parsed val records in --output-dir, not in the config's run
    # folder (train.output_dir, runs/tiny_cpu under the working folder); one rank: no cache.
    assert len(list((tmp_path / "two" / "cache").glob("val-*.records"))) == 1
    assert not (tmp_path / "one" / "cache").exists()


def _small_val_set(tmp_path: Path, num_val: int) -> list:
    """Overrides for a generated val set of ``num_val`` images of up to 96 px under
    ``tmp_path/shapes``, and random tiny-model weights in ``tmp_path/w.pth``."""
    from detector.config import load_config
    from detector.data.shapes import ensure_shapes
    from detector.modeling import build_model

    data = tmp_path / "shapes"
    overrides = tiny_overrides(data, None, "data.shapes.num_train=1", f"data.shapes.num_val={num_val}",
                               "data.shapes.max_side=96", "input.min_size_test=64", "input.max_size_test=96")
    cfg = load_config(TINY_CONFIG, overrides)
    ensure_shapes(data, 1, num_val, cfg.data.shapes.seed, 64, 96)
    torch.save(build_model(cfg).state_dict(), tmp_path / "w.pth")
    return overrides


@pytest.mark.slow
@pytest.mark.dist
def test_an_image_missing_on_one_rank_stops_every_rank_with_one_line(tmp_path):
    """The last image is rank 1's: rank 1 names it, rank 0 names rank 1; nobody waits for
    the collective timeout (30 minutes)."""
    overrides = _small_val_set(tmp_path, 3)
    data = tmp_path / "shapes"
    last = json.loads((data / "val.json").read_text())["images"][-1]["file_name"]
    missing = next(p for p in data.rglob(Path(last).name))
    missing.unlink()

    logs = tmp_path / "logs"  # one stderr file per rank: lines of two ranks never interleave
    _torchrun(2, overrides, tmp_path / "w.pth", tmp_path / "out", 1, "--log-dir", str(logs), "--redirects=3")
    stderr = {p.parent.name: p.read_text() for p in logs.rglob("stderr.log")}
    assert sorted(stderr) == ["0", "1"], stderr
    for rank, text in stderr.items():
        errors = [line for line in text.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1 and "Traceback" not in text and missing.name in errors[0], (rank, text[-3000:])
    assert "evaluation failed on rank 1 (FileNotFoundError" in stderr["0"]  # rank 0 names rank 1
    assert "rank 1" not in stderr["1"]  # rank 1 names its own missing file


def _rank_file(logs: Path, rank: int, name: str, agent: subprocess.Popen) -> Path:
    """``<logs>/<run>/attempt_0/<rank>/<name>`` once torchrun has made it."""
    deadline = time.time() + 300
    while time.time() < deadline and agent.poll() is None:
        found = list(logs.rglob(f"{rank}/{name}"))
        if found:
            return found[0]
        time.sleep(0.02)
    raise AssertionError(f"torchrun wrote no {rank}/{name} under {logs} (exit status {agent.poll()})")


@pytest.mark.slow
@pytest.mark.dist
def test_a_lost_rank_stops_the_evaluation_with_one_line(tmp_path):
    """Rank 1 killed while the ranks evaluate: rank 0 ends with one line naming it and
    advising to run the evaluation again (it gave training's `--resume`, which eval does
    not take), also when torchrun's SIGTERM reaches it before a collective fails (it
    ended without a word, -15). Rank 0 is stopped once its weights are loaded, rank 1
    killed, and rank 0 continues once the agent has sent it SIGTERM."""
    from conftest import lose_rank_1_while_rank_0_is_stopped, wait_for_text

    overrides = _small_val_set(tmp_path, 40)
    logs = tmp_path / "logs"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "--monitor-interval=0.2", "--log-dir", str(logs), "--redirects=3", str(ROOT / "tools" / "eval.py"),
           "--config", str(TINY_CONFIG), "--weights", str(tmp_path / "w.pth"), "--output-dir", str(tmp_path / "out"),
           *overrides]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    with (tmp_path / "agent.txt").open("w") as out:
        agent = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    wait_for_text(_rank_file(logs, 0, "stdout.log", agent), "weights loaded", agent)
    lose_rank_1_while_rank_0_is_stopped(agent, tmp_path / "agent.txt")
    assert agent.wait(300) != 0
    (stderr,) = logs.rglob("0/stderr.log")
    text = stderr.read_text()
    errors = [line for line in text.splitlines() if line.startswith("error: ")]
    assert "Traceback" not in text and len(errors) == 1, text[-3000:]
    assert errors[0].startswith("error: lost rank 1 (pid ") and errors[0].endswith("; run the evaluation again")
