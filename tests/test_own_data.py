"""The README's own-data commands on real VOC and COCO data (issue 10, "What it must show"
2 and 3): the recipe config, given only the data paths, a class subset, solver.max_iter,
small image sizes and ``model.backbone_weights=``, trains on the CPU with AMP off and
nothing downloaded, and its log says how many boxes of other classes were dropped.

(``train.eval_period=-1`` skips the final evaluation, which would take minutes on a
shared CPU; the evaluation itself is tested elsewhere.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

import pytest
import yaml

from conftest import ROOT  # noqa: E402
SMALL = ['"input.min_size_train=[128]"', "input.max_size_train=160", "input.min_size_test=128",
         "input.max_size_test=160", "solver.max_iter=2", "model.backbone_weights="]

pytestmark = [pytest.mark.slow, pytest.mark.realdata]


def _train(args: list, out: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "TORCH_HOME": str(tmp_path / "empty_torch_home"), "PYTHONPATH": str(ROOT),
           "OMP_WAIT_POLICY": "PASSIVE", "NO_ALBUMENTATIONS_UPDATE": "1"}
    # The README's command line, as a shell would split it.
    argv = [sys.executable, str(ROOT / "tools" / "train.py")] + [a.strip('"') for a in args] + [
        f"train.output_dir={out}", "train.eval_period=-1"]
    return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)


def _check_run(proc: subprocess.CompletedProcess, out: Path, tmp_path: Path, k: int, dropped: Counter) -> None:
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stdout + proc.stderr
    log = (out / "log.txt").read_text().replace("\n    ", " ")  # long lines are wrapped with a 4-space indent
    line = next(x for x in log.splitlines() if "boxes of other classes" in x)
    total = sum(dropped.values())
    assert f"training on {k} classes (data.class_names); dropped {total} boxes of other classes" in line
    pairs = [item.rsplit(" ", 1) for item in line.split("boxes of other classes: ")[1].split(", ")]
    counts = {name: int(n) for name, n in pairs}
    assert counts == dict(dropped)
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["model"]["num_classes"] == k and saved["train"]["amp"]["enabled"] == "auto"
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r.get("type") == "train"]
    assert train and train[-1]["iteration"] == 2 and "amp_scale" not in train[-1]  # AMP off on the CPU
    assert (out / "checkpoints" / "last.pth").is_file()
    assert not any((tmp_path / "empty_torch_home").rglob("*.pth"))  # nothing downloaded


def test_readme_voc_command_trains_a_class_subset_on_cpu(real_data, tmp_path):
    root = real_data / "voc2012_100" / "VOCdevkit" / "VOC2012"
    names = ["cat", "dog"]
    ids = (root / "ImageSets" / "Main" / "all.txt").read_text().split()
    dropped = Counter()
    for vid in ids:
        for obj in ET.parse(root / "Annotations" / f"{vid}.xml").getroot().findall("object"):
            name = obj.findtext("name").strip()
            if name not in names:
                dropped[name] += 1
    out = tmp_path / "voc_run"
    args = ["--config", "configs/faster_rcnn_r50_fpn_voc.yaml",
            f"data.train.root={root}", "data.train.split=all", f"data.val.root={root}", "data.val.split=all",
            '"data.class_names=[cat,dog]"', *SMALL]
    _check_run(_train(args, out, tmp_path), out, tmp_path, len(names), dropped)


def test_readme_coco_command_trains_a_category_subset_with_num_classes_auto(real_data, tmp_path):
    base = real_data / "coco2017_16"
    data = json.loads((base / "instances.json").read_text())
    names = ["person", "bottle", "cup"]
    by_id = {c["id"]: c["name"] for c in data["categories"]}
    dropped = Counter(by_id[a["category_id"]] for a in data["annotations"] if by_id[a["category_id"]] not in names)
    out = tmp_path / "coco_run"
    args = ["--config", "configs/faster_rcnn_r50_fpn_1x_coco.yaml",
            f"data.train.root={base / 'images'}", f"data.train.ann_file={base / 'instances.json'}",
            f"data.val.root={base / 'images'}", f"data.val.ann_file={base / 'instances.json'}",
            '"data.class_names=[person,bottle,cup]"', *SMALL]
    _check_run(_train(args, out, tmp_path), out, tmp_path, len(names), dropped)
