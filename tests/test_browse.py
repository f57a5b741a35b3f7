"""tools/browse_dataset.py: training samples after augmentation (LSJ + copy-paste
included), drawn with their boxes in class colours, as PNG files or one grid."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from detector.evaluation.browse import training_samples
from detector.evaluation.palette import class_color
from conftest import TINY_CONFIG, load_tool, tiny_config, tiny_overrides

AUG = ["input.lsj.enabled=true", "input.lsj.size=64", "input.lsj.min_scale=0.5", "input.lsj.max_scale=1.5",
       "input.copy_paste.enabled=true", "input.copy_paste.prob=1.0", "train.seed=7"]


@pytest.fixture(scope="module")
def data_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("shapes") / "data"


def _run(data_root, out, *args):
    tool = load_tool("browse_dataset")
    return tool.main(["--config", str(TINY_CONFIG), "--output-dir", str(out), *args, *tiny_overrides(data_root), *AUG])


def test_files_show_each_box_in_its_class_colour(data_root, tmp_path):
    assert _run(data_root, tmp_path, "--num", "5") == 0
    files = sorted(tmp_path.glob("*.png"))
    assert [f.name for f in files] == [f"sample_{i:03d}.png" for i in range(5)]
    samples, _ = training_samples(tiny_config(data_root, None, *AUG), 5)
    pasted = 0
    for f, (image, target) in zip(files, samples):
        drawn = np.asarray(Image.open(f).convert("RGB"))
        scale = 5  # 64 px -> 320
        assert image.shape[1:] == (64, 64) and drawn.shape[1] == 64 * scale and drawn.shape[0] >= 64 * scale
        for box, label in zip(target["boxes"].numpy() * scale, target["labels"].tolist()):
            x1, y1, x2, y2 = (int(v) for v in np.clip(box, 0, 64 * scale - 1))
            outline = np.concatenate([drawn[y1:y2 + 1, x1], drawn[y1:y2 + 1, x2], drawn[y2, x1:x2 + 1]])
            share = (outline == np.array(class_color(label), np.uint8)).all(axis=-1).mean()
            assert share > 0.5, (f.name, box, label)  # the outline is drawn in the class's colour
        pasted += len(target["boxes"])
    assert pasted > 0


def test_grid_is_one_file_of_the_expected_size(data_root, tmp_path):
    assert _run(data_root, tmp_path, "--num", "5", "--grid") == 0
    assert [f.name for f in tmp_path.iterdir()] == ["grid.png"]
    with Image.open(tmp_path / "grid.png") as img:
        w, h = img.size
    cols = math.ceil(math.sqrt(5))
    assert w == cols * (320 + 4)
    rows = math.ceil(5 / cols)
    assert rows * (320 + 4) <= h <= rows * (320 + 4 + 3 * 21)  # the legend bands under the images


def test_bad_num_or_epoch_is_one_line(data_root, tmp_path, capsys):
    assert _run(data_root, tmp_path, "--num", "0") == 1
    err = capsys.readouterr().err.strip()
    assert err == "error: --num must be at least 1, got 0"
    for epoch in ("-1", "99999999999999999999"):  # an order no epoch has; numpy's 'Overflow when unpacking long long'
        assert _run(data_root, tmp_path, "--epoch", epoch) == 1
        err = capsys.readouterr().err.strip()
        assert err == f"error: --epoch must be in 0..4611686018427387903 (0: the first epoch), got {epoch}"
    assert not list(tmp_path.glob("*.png"))
