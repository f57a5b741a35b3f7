"""Data that trains to nothing (issue 23, section 7): a training set without boxes
stops with one line, a missing metric (pycocotools' -1, NaN) never chooses best.pth,
and EXIF-rotated images are reported (data set and checker) or turned on request
(``data.apply_exif``)."""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps

from detector.config import load_config
from detector.data import DataError, build_dataset
from detector.data.check import check_dataset, format_report
from detector.data.dataset import DataWarning
from detector.engine.hooks import EvalHook
from detector.engine.log import EventWriters
from detector.engine.train_loop import LoopState
from detector.evaluation.inference import read_rgb
from detector.evaluation import score_detections
from conftest import TINY_CONFIG, load_tool, tiny_overrides
from test_hooks import Params, make_checkpointer, result, run_steps


def coco_set(tmp: Path, annotations, sizes=((40, 30), (50, 60)), exif: int = 0) -> tuple:
    """Images ``i.png`` of the given (w, h) sizes (stored with EXIF orientation ``exif``
    when non-zero) and their COCO JSON; annotation sizes as given."""
    img_dir = tmp / "images"
    img_dir.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    images = []
    for i, (w, h) in enumerate(sizes):
        img = Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8))
        kwargs = {}
        if exif:
            tags = Image.Exif()
            tags[0x0112] = exif
            kwargs["exif"] = tags.tobytes()
        img.save(img_dir / f"{i}.png", **kwargs)
        images.append({"id": i + 1, "file_name": f"{i}.png", "width": w, "height": h})
    ann_file = tmp / "instances.json"
    ann_file.write_text(json.dumps({"images": images, "annotations": annotations,
                                    "categories": [{"id": 1, "name": "thing"}]}))
    return img_dir, ann_file


def coco_cfg(img_dir, ann_file, *extra):
    return load_config(None, ["data.format=coco", f"data.train.root={img_dir}", f"data.train.ann_file={ann_file}",
                              f"data.val.root={img_dir}", f"data.val.ann_file={ann_file}", *extra])


# ----------------------------------------------------------------- no training boxes


CROWD_ONLY = [{"id": 1, "image_id": 1, "category_id": 1, "bbox": [2, 2, 10, 10], "area": 100, "iscrowd": 1}]


@pytest.mark.parametrize("annotations", [[], CROWD_ONLY], ids=["no_annotations", "crowd_only"])
@pytest.mark.parametrize("filter_empty", ["true", "false"])
def test_training_set_without_boxes_stops_with_one_line(tmp_path, annotations, filter_empty):
    img_dir, ann_file = coco_set(tmp_path, annotations)
    cfg = coco_cfg(img_dir, ann_file, f"data.filter_empty={filter_empty}")
    with pytest.raises(DataError) as e:
        build_dataset(cfg, "train", is_train=True)
    msg = str(e.value)
    assert "\n" not in msg and "no training boxes" in msg and str(ann_file) in msg
    assert len(build_dataset(cfg, "val", is_train=False)) == 2  # a val set may have none


def test_train_tool_stops_on_a_training_set_without_boxes(tmp_path, capsys):
    img_dir, ann_file = coco_set(tmp_path, [])
    rc = load_tool("train").main(["--config", str(TINY_CONFIG), *tiny_overrides(img_dir, tmp_path / "run"),
                                  "data.format=coco", f"data.train.ann_file={ann_file}", f"data.val.ann_file={ann_file}",
                                  "data.filter_empty=false"])
    err = capsys.readouterr().err.strip()
    assert rc == 1 and "\n" not in err and "no training boxes" in err and str(ann_file) in err
    assert not (tmp_path / "run" / "checkpoints").exists()


# ----------------------------------------------------------------- a missing metric never chooses best.pth


def test_val_set_without_boxes_never_chooses_best(tmp_path, caplog):
    gt = {"images": [{"id": 1, "file_name": "a.png", "width": 40, "height": 30}], "annotations": [],
          "categories": [{"id": 1, "name": "thing"}]}
    dets = [{"image_id": 1, "category_id": 1, "bbox": [1.0, 1.0, 5.0, 5.0], "score": 0.9}]
    no_gt = score_detections(gt, dets).metrics
    assert no_gt["AP"] == -1.0  # pycocotools: no ground truth in range
    module = Params()
    ck = make_checkpointer(tmp_path, module)
    values = iter([no_gt, {"AP": float("nan")}, {"AP": 0.25}])

    def evaluate(iteration):
        with torch.no_grad():
            module.w.fill_(iteration)
        return next(values)

    ev = EvalHook(evaluate, ck, period=1, best_metric="AP", writers=EventWriters())
    best = tmp_path / "checkpoints" / "best.pth"
    with caplog.at_level(logging.WARNING, logger="detector.engine.hooks.evaluation"):
        run_steps([ev], LoopState(max_iter=10), [result(1.0, 1.0)] * 2)
    assert not best.exists() and ev.best_value is None
    assert "best.pth not written" in caplog.text and "new best" not in caplog.text
    run_steps([ev], LoopState(max_iter=10, iteration=2), [result(1.0, 1.0)])  # a real value then chooses
    assert ev.best_value == 0.25 and torch.load(best, weights_only=True)["model"]["w"].tolist() == [3.0] * 4


# ----------------------------------------------------------------- EXIF orientation


def test_exif_rotated_square_image_is_warned_in_the_checker_and_the_data_set(tmp_path):
    box = [{"id": 1, "image_id": 1, "category_id": 1, "bbox": [2, 2, 20, 10], "area": 200, "iscrowd": 0}]
    img_dir, ann_file = coco_set(tmp_path, box, sizes=((48, 48),), exif=6)
    cfg = coco_cfg(img_dir, ann_file)
    report = check_dataset(cfg, "train")
    assert report.ok and report.exif_rotated == [f"{img_dir / '0.png'} (orientation 6)"]
    text = format_report(report)
    assert "images with an EXIF orientation: 1, WARNING: read as stored" in text and "data.apply_exif=true" in text
    dataset = build_dataset(cfg, "train", is_train=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        image = dataset.load_image(0)
    assert [w.category for w in caught] == [DataWarning]
    assert str(img_dir / "0.png") in str(caught[0].message) and "EXIF orientation 6" in str(caught[0].message)
    with Image.open(img_dir / "0.png") as img:
        np.testing.assert_array_equal(image, np.asarray(img.convert("RGB")))  # as stored


@pytest.mark.parametrize("suffix", ["gif", "tiff"])
def test_a_file_of_several_frames_is_said_in_the_checker_the_data_set_and_inference(tmp_path, suffix, caplog):
    """An animated GIF or a multi-page TIFF was read as its first frame without a word."""
    box = [{"id": 1, "image_id": 1, "category_id": 1, "bbox": [2, 2, 20, 10], "area": 200, "iscrowd": 0}]
    img_dir, ann_file = coco_set(tmp_path, box, sizes=((48, 40),))
    frames = [Image.fromarray(np.full((40, 48, 3), v, dtype=np.uint8)) for v in (10, 200, 90)]
    path = img_dir / f"0.{suffix}"
    frames[0].save(path, save_all=True, append_images=frames[1:])
    ann = json.loads(ann_file.read_text())
    ann["images"][0]["file_name"] = path.name
    ann_file.write_text(json.dumps(ann))
    cfg = coco_cfg(img_dir, ann_file)
    report = check_dataset(cfg, "train")
    assert report.ok and report.multi_frame == [f"{path} (3 frames)"]
    assert "image files of several frames (animations, multi-page files), of which the first is read: 1" in \
        format_report(report)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        image = build_dataset(cfg, "train", is_train=False).load_image(0)
    said = f"image file {path} holds 3 frames (an animation or a multi-page file); only the first is read"
    assert [str(w.message) for w in caught] == [said]
    assert int(image[0, 0, 0]) == 10  # the first frame
    with caplog.at_level(logging.WARNING, logger="detector.evaluation"):
        read_rgb(path)
    assert [r.getMessage() for r in caplog.records] == [said]
    single = img_dir / f"single.{suffix}"
    frames[0].save(single)
    check = check_dataset(cfg, "train")  # (unchanged) and a one-frame file: nothing said
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="detector.evaluation"):
        read_rgb(single)
    assert caplog.records == [] and len(check.multi_frame) == 1


def test_apply_exif_turns_images_as_displayed_and_checks_the_displayed_size(tmp_path):
    # Stored 60 wide x 40 high, orientation 6: displayed 40 x 60, as the annotation says.
    box = [{"id": 1, "image_id": 1, "category_id": 1, "bbox": [2, 2, 20, 30], "area": 600, "iscrowd": 0}]
    img_dir, ann_file = coco_set(tmp_path, box, sizes=((40, 60),), exif=6)
    with Image.open(img_dir / "0.png") as img:
        img.load()
        stored = Image.fromarray(np.asarray(img.convert("RGB")).transpose(1, 0, 2).copy())  # write it 60x40
        tags = img.getexif()
    stored.save(img_dir / "0.png", exif=tags.tobytes())
    as_stored = check_dataset(coco_cfg(img_dir, ann_file), "train")
    assert not as_stored.ok and "is 60x40 but its annotation says 40x60" in as_stored.errors[0]
    cfg = coco_cfg(img_dir, ann_file, "data.apply_exif=true")
    report = check_dataset(cfg, "train")
    assert report.ok and len(report.exif_rotated) == 1 and "turned as displayed" in format_report(report)
    dataset = build_dataset(cfg, "train", is_train=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning: the image is turned as asked
        image = dataset.load_image(0)
    with Image.open(img_dir / "0.png") as img:
        np.testing.assert_array_equal(image, np.asarray(ImageOps.exif_transpose(img).convert("RGB")))
    assert image.shape == (60, 40, 3)
