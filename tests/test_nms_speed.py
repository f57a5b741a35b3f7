"""``tools/benchmark.py --task nms`` (benchmarks/nms_speed.py): the proposal NMS of one
step timed torchvision's way and with both ``static_nms`` methods, each checked against
``torchvision.ops.nms`` on clustered boxes."""

from __future__ import annotations

import json
import subprocess
import sys

import torch
import torchvision

from benchmarks.nms_speed import _matches, clustered_rows

from conftest import ROOT, TINY_CONFIG


def test_clustered_rows_lie_in_the_canvas_and_suppress_a_lot():
    boxes, scores = clustered_rows(3, 300, 80, 120, 16.0)
    assert boxes.shape == (3, 300, 4) and scores.shape == (3, 300)
    assert (boxes[..., 0] >= 0).all() and (boxes[..., 2] <= 120).all() and (boxes[..., 3] <= 80).all()
    assert (boxes[..., 2] >= boxes[..., 0]).all() and (boxes[..., 3] >= boxes[..., 1]).all()
    kept = [len(torchvision.ops.nms(boxes[r], scores[r], 0.7)) for r in range(3)]
    assert all(k < 200 for k in kept), kept  # clusters: many boxes are suppressed


def test_the_check_against_torchvision_can_fail():
    boxes, scores = clustered_rows(2, 50, 64, 64, 12.0, seed=1)
    ref = [torchvision.ops.nms(boxes[r], scores[r], 0.7) for r in range(2)]
    slots = max(len(k) for k in ref)
    keep = torch.zeros(2, slots, dtype=torch.int64)
    valid = torch.zeros(2, slots, dtype=torch.bool)
    for r, k in enumerate(ref):
        keep[r, : len(k)], valid[r, : len(k)] = k, True
    assert _matches(keep, valid, boxes, scores, 0.7)
    valid[1, 0] = False
    assert not _matches(keep, valid, boxes, scores, 0.7)


def test_nms_task_times_four_ways_and_both_static_methods_match(tmp_path):
    out = tmp_path / "nms.json"
    cmd = [sys.executable, str(ROOT / "tools" / "benchmark.py"), "--config", str(TINY_CONFIG), "--task", "nms",
           "--iters", "2", "--warmup", "1", "--json", str(out), "model.canvas_sizes=[[96,96]]"]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    res = json.loads(out.read_text())
    assert set(res["runs"]) == {"torchvision", "scan", "scan_kernel", "blocks"}
    assert res["matches_torchvision"] == {"scan": True, "blocks": True}
    assert res["boxes_per_row"] == 200 and res["canvas"] == [96, 96] and res["auto_method"] == "blocks"
    assert all(r["iters"] == 2 and r["median_s"] > 0 for r in res["runs"].values())
    assert "matches torchvision: True" in run.stdout
