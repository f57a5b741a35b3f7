"""Bad data files (issue 10): image paths outside the root, non-8-bit images, fractional VOC
coordinates, check_dataset's header, tool help texts, infer.py skipping unreadable images."""

from __future__ import annotations

import io
import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch
from PIL import Image

from detector.config import load_config
from detector.data import CocoDetection, DataError, VOCDetection, build_dataset
from detector.data.check import check_dataset, format_report
from detector.data.files import load_image
from detector.data.schema import load_coco_json
from detector.data.split import read_voc_images
from detector.data.voc_xml import read_voc_split
from conftest import load_tool
from conftest import ROOT, TINY_CONFIG  # noqa: E402

check_main = load_tool("check_dataset").main  # tools/check_dataset.py


def write_coco(tmp: Path, file_name: str, w: int = 40, h: int = 30) -> tuple[Path, Path]:
    """One image entry with ``file_name`` and one box; ``images/ok.jpg`` exists."""
    img_dir = tmp / "images"
    img_dir.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.full((h, w, 3), 128, np.uint8)).save(img_dir / "ok.jpg")
    ann = tmp / "ann.json"
    ann.write_text(json.dumps({
        "images": [{"id": 7, "file_name": file_name, "width": w, "height": h}],
        "annotations": [{"id": 1, "image_id": 7, "category_id": 1, "bbox": [2, 3, 10, 10], "iscrowd": 0}],
        "categories": [{"id": 1, "name": "thing"}],
    }))
    return img_dir, ann


def coco_cfg(img_dir, ann, *extra):
    return load_config(None, ["data.format=coco", f"data.train.root={img_dir}", f"data.train.ann_file={ann}", *extra])


# ----------------------------------------------------------------------------- file_name outside the root


@pytest.mark.parametrize("name", ["../../x.jpg", "ABSOLUTE", "sub/../../x.jpg", ".."])
def test_file_name_outside_the_image_root_is_an_error(tmp_path, name):
    outside = tmp_path / "x.jpg"  # a real image outside the root, which must not be read
    Image.fromarray(np.zeros((30, 40, 3), np.uint8)).save(outside)
    name = str(outside) if name == "ABSOLUTE" else name
    img_dir, ann = write_coco(tmp_path / "set", name)
    expected = f"image_id 7: file_name '{name}' resolves outside the image root {img_dir}"
    with pytest.raises(DataError, match="^annotation file .*ann.json: " + expected.replace(".", r"\.")):
        CocoDetection(img_dir, ann)
    with pytest.raises(DataError, match=r"image_id 7: file_name .* resolves outside the image root"):
        build_dataset(coco_cfg(img_dir, ann), "train", is_train=True)  # the training data set
    report = check_dataset(coco_cfg(img_dir, ann))
    assert not report.ok and report.num_images == 0
    assert any(expected in e for e in report.errors), report.errors


def test_file_name_outside_the_root_stops_the_tools(tmp_path, capsys):
    img_dir, ann = write_coco(tmp_path, "../../x.jpg")
    config = tmp_path / "c.yaml"
    config.write_text(f"data:\n  format: coco\n  train: {{root: {img_dir}, ann_file: {ann}}}\n")
    assert check_main(["--config", str(config)]) == 1
    out = capsys.readouterr().out
    assert "image_id 7: file_name '../../x.jpg' resolves outside the image root" in out


@pytest.mark.slow  # a training process (model built, then the data set refused): ~10-15 s
def test_train_tool_refuses_file_name_outside_the_root(tmp_path):
    img_dir, ann = write_coco(tmp_path, "../../x.jpg")
    data = [f"data.{s}.{k}={v}" for s in ("train", "val") for k, v in (("root", img_dir), ("ann_file", ann))]
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "train.py"), "--config", str(TINY_CONFIG),
                           "data.format=coco", *data, "model.num_classes=1", f"train.output_dir={tmp_path / 'run'}",
                           "solver.max_iter=1"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "image_id 7: file_name '../../x.jpg' resolves outside the image root" in proc.stderr + proc.stdout
    assert "Traceback" not in proc.stderr + proc.stdout


def test_file_name_in_a_subfolder_is_fine(tmp_path):
    img_dir, ann = write_coco(tmp_path, "sub/../ok.jpg")
    ds = CocoDetection(img_dir, ann)
    assert ds.get_annotation(0)["path"] == str(img_dir / "ok.jpg")
    assert ds[0][0].shape == (3, 30, 40)


def test_voc_split_id_outside_the_year_folder_is_an_error(tmp_path):
    root = tmp_path / "VOC2012"
    (root / "ImageSets" / "Main").mkdir(parents=True)
    (root / "ImageSets" / "Main" / "train.txt").write_text("../../secret\n")
    with pytest.raises(DataError, match=r"train\.txt: image id '\.\./\.\./secret' resolves outside the year folder"):
        VOCDetection(root, "train")


# ----------------------------------------------------------------------------- bit depths and modes


def encode(array: np.ndarray, fmt: str, mode: str | None = None) -> bytes:
    buf = io.BytesIO()
    (Image.fromarray(array) if mode is None else Image.fromarray(array).convert(mode)).save(buf, fmt)
    return buf.getvalue()


GRADIENT16 = (np.arange(30 * 40, dtype=np.int64).reshape(30, 40) * 65535 // (30 * 40 - 1)).astype(np.uint16)


def test_16bit_grayscale_png_is_scaled_by_1_over_257(tmp_path):
    path = tmp_path / "g16.png"
    path.write_bytes(encode(GRADIENT16, "PNG"))
    assert Image.open(path).mode == "I;16"
    image = load_image(str(path))
    assert image.dtype == np.uint8 and image.shape == (30, 40, 3)
    expected = np.floor(GRADIENT16.astype(np.float64) / 257 + 0.5).astype(np.uint8)
    np.testing.assert_array_equal(image[..., 0], expected)
    assert (image[..., 0] == image[..., 2]).all()
    assert image.min() == 0 and image.max() == 255  # full range, not the clipped all-255 image


def test_16bit_rgb_png_keeps_its_range(tmp_path):
    rgb16 = np.stack([GRADIENT16, GRADIENT16[::-1], np.full_like(GRADIENT16, 40000)], axis=2)
    path = tmp_path / "rgb16.png"
    ok, enc = cv2.imencode(".png", rgb16[..., ::-1])  # PIL cannot write 48-bit PNGs; OpenCV writes BGR
    assert ok
    path.write_bytes(enc.tobytes())
    image = load_image(str(path)).astype(np.int64)
    expected = rgb16.astype(np.float64) / 257
    assert np.abs(image - expected).max() <= 1.0  # PIL keeps the high byte: v >> 8, within 1 of v / 257
    assert image[..., 0].min() == 0 and image[..., 0].max() == 255


@pytest.mark.parametrize("mode", ["I", "F"])
def test_32bit_integer_and_float_images_are_refused(tmp_path, mode):
    array = GRADIENT16.astype(np.int32 if mode == "I" else np.float32)
    path = tmp_path / f"im_{mode}.tif"
    path.write_bytes(encode(array, "TIFF"))
    assert Image.open(path).mode == mode
    with pytest.raises(DataError, match=rf"image file .*im_{mode}\.tif \(image_id 3\) has 32-bit .* pixels "
                                        rf"\(mode {mode}\) with no defined 8-bit scale"):
        load_image(str(path), 3)


@pytest.mark.parametrize("mode", ["L", "P", "LA", "RGBA", "CMYK", "1"])
def test_8bit_modes_convert_like_pil(tmp_path, mode):
    rng = np.random.default_rng(0)
    source = Image.fromarray(rng.integers(0, 255, (30, 40, 3), dtype=np.uint8)).convert(mode)
    fmt = "JPEG" if mode == "CMYK" else "PNG"
    path = tmp_path / f"im.{fmt.lower()}"
    source.save(path, fmt)
    with Image.open(path) as img:
        assert img.mode == mode
        expected = np.asarray(img.convert("RGB"))
    image = load_image(str(path))
    assert image.shape == (30, 40, 3) and image.dtype == np.uint8
    np.testing.assert_array_equal(image, expected)
    assert image.std() > 10  # not blank


def test_16bit_png_trains_as_a_scaled_image(tmp_path):
    """Issue 10 test 4: a 16-bit PNG goes through the training transforms and the tiny
    model as an image with the full 0..255 range, and gives finite losses."""
    img_dir, ann = write_coco(tmp_path, "g16.png")
    (img_dir / "g16.png").write_bytes(encode(GRADIENT16, "PNG"))
    cfg = load_config(TINY_CONFIG, [
        "data.format=coco", f"data.train.root={img_dir}", f"data.train.ann_file={ann}",
        "input.min_size_train=[60]", "input.max_size_train=96", "input.hflip_prob=0"])
    image, target = build_dataset(cfg, "train", is_train=True)[0]
    assert image.dtype == torch.uint8 and image.shape == (3, 60, 80)
    assert image.min() <= 2 and image.max() >= 253 and len(image.unique()) > 100
    from detector.modeling import build_model

    torch.manual_seed(0)
    model = build_model(cfg).train()
    losses = model([image], [target])
    assert all(torch.isfinite(v) for v in losses.values()), losses


def test_check_dataset_decodes_16bit_and_reports_float_images(tmp_path):
    img_dir, ann = write_coco(tmp_path, "g16.png")
    (img_dir / "g16.png").write_bytes(encode(GRADIENT16, "PNG"))
    assert check_dataset(coco_cfg(img_dir, ann)).ok
    (img_dir / "g16.png").write_bytes(encode(GRADIENT16.astype(np.float32), "TIFF"))
    report = check_dataset(coco_cfg(img_dir, ann))
    assert report.unreadable_files == [str(img_dir / "g16.png")]
    assert "(mode F) with no defined 8-bit scale" in report.errors[0]


# ----------------------------------------------------------------------------- VOC coordinates and check_dataset's header


def make_voc(tmp: Path, coords=("174.5", "20", "190", "40.25")) -> Path:
    root = tmp / "VOCdevkit" / "VOC2012"
    for sub in ("JPEGImages", "Annotations", "ImageSets/Main"):
        (root / sub).mkdir(parents=True)
    Image.fromarray(np.full((50, 200, 3), 90, np.uint8)).save(root / "JPEGImages" / "2008_000001.jpg")
    x1, y1, x2, y2 = coords
    (root / "Annotations" / "2008_000001.xml").write_text(
        "<annotation><size><width>200</width><height>50</height></size>"
        f"<object><name>cat</name><bndbox><xmin>{x1}</xmin><ymin>{y1}</ymin><xmax>{x2}</xmax><ymax>{y2}</ymax>"
        "</bndbox></object><object><name>dog</name><bndbox><xmin>1</xmin><ymin>1</ymin><xmax>9</xmax>"
        "<ymax>9</ymax></bndbox></object></annotation>")
    (root / "ImageSets" / "Main" / "train.txt").write_text("2008_000001\n")
    return root


def test_voc_non_integer_coordinates_are_accepted_and_counted(tmp_path, caplog):
    root = make_voc(tmp_path)
    with caplog.at_level(logging.INFO, logger="detector.data"):
        ds = VOCDetection(root, "train", class_names=["cat", "dog"])
    torch.testing.assert_close(ds.get_annotation(0)["boxes"][0], torch.tensor([173.5, 19.0, 190.0, 40.25]))
    assert ds.num_non_integer_boxes == 1
    assert "1 objects have non-integer <bndbox> coordinates" in caplog.text
    cfg = load_config(None, ["data.format=voc", f"data.train.root={root}", "data.class_names=[cat,dog]"])
    report = check_dataset(cfg)
    assert report.ok and report.num_boxes == 2 and report.non_integer_boxes == 1
    text = format_report(report)
    assert "boxes with non-integer coordinates (accepted as floats): 1" in text
    assert "2008_000001.xml: object 0: non-integer coordinates [174.5, 20, 190, 40.25]" in text


def test_check_dataset_header_names_the_files_it_reads(tmp_path, capsys):
    root = make_voc(tmp_path, coords=("1", "2", "30", "40"))
    # The VOC config extends a base whose data.*.ann_file may name a COCO file: not read for VOC.
    overrides = [f"data.train.root={root}", "data.train.split=train", "data.class_names=[cat,dog]",
                 "model.num_classes=2"]
    cfg = load_config(ROOT / "configs" / "faster_rcnn_r50_fpn_voc.yaml", overrides)
    header = format_report(check_dataset(cfg)).splitlines()[0]
    assert header == f"data set: VOC year folder {root}: ImageSets/Main/train.txt, Annotations/*.xml, JPEGImages/"
    cfg = load_config(ROOT / "configs" / "faster_rcnn_r50_fpn_voc.yaml", overrides + ["data.train.split=nope"])
    text = format_report(check_dataset(cfg))
    assert text.splitlines()[0].endswith("ImageSets/Main/nope.txt, Annotations/*.xml, JPEGImages/")
    assert ".json" not in text and f"data.train.split: VOC split file {root}/ImageSets/Main/nope.txt not found" in text
    img_dir, ann = write_coco(tmp_path / "coco", "ok.jpg")
    assert format_report(check_dataset(coco_cfg(img_dir, ann))).splitlines()[0] == \
        f"data set: COCO {ann}, images in {img_dir}"


# ----------------------------------------------------------------------------- help texts


@pytest.mark.parametrize("tool", ["eval", "infer", "train", "benchmark", "check_dataset", "split_dataset",
                                  "export", "summary", "make_shapes"])
def test_tool_help_is_clean_text(tool, capsys):
    module = load_tool(tool)
    with pytest.raises(SystemExit) as exit_info:
        (module.parse_args if hasattr(module, "parse_args") else module.main)(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert "``" not in text and "::" not in text, text  # no reST markup
    for line in text.splitlines():
        # a backslash only as a shell line continuation, followed by its continued line
        assert "\\" not in line.rstrip()[:-1], line
        if "python " in line or "torchrun " in line:  # a command line: one command, not two joined
            assert "    " not in line.strip().split("#")[0].strip(), f"lost line continuation: {line!r}"
    if tool == "check_dataset":
        assert "which of data.train / data.val to check" in text


# ----------------------------------------------------------------------------- infer.py skips unreadable images


def test_infer_skips_unreadable_images_and_names_them(tmp_path, capsys, caplog):
    cfg_args = ["input.min_size_test=64", "input.max_size_test=96"]
    torch.manual_seed(0)
    from detector.modeling import build_model

    model = build_model(load_config(TINY_CONFIG, cfg_args))
    torch.save(model.state_dict(), tmp_path / "w.pth")
    inputs = tmp_path / "in"
    inputs.mkdir()
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 255, (60, 80, 3), dtype=np.uint8)).save(inputs / "a.jpg")
    (inputs / "b_broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")
    Image.fromarray(rng.integers(0, 255, (70, 50, 3), dtype=np.uint8)).save(inputs / "c.png")
    # Entries with image names that are no files: a pipe (reading it waited for ever), a
    # loop of links (a RuntimeError traceback), a folder. Skipped with one warning.
    os.mkfifo(inputs / "d_pipe.png")
    (inputs / "e_loop.jpg").symlink_to(inputs / "e_loop.jpg")
    (inputs / "f_dir.jpg").mkdir()
    # Formats PIL reads beyond the usual few (they were left out without a word), and
    # what is not read: a subfolder, a text file (one warning naming them).
    Image.fromarray(rng.integers(0, 255, (40, 30, 3), dtype=np.uint8)).save(inputs / "g.gif")
    Image.fromarray(rng.integers(0, 255, (40, 30, 3), dtype=np.uint8)).save(inputs / "h.ppm")
    (inputs / "sub").mkdir()
    Image.fromarray(rng.integers(0, 255, (40, 30, 3), dtype=np.uint8)).save(inputs / "sub" / "i.jpg")
    (inputs / "notes.txt").write_text("x")
    out = tmp_path / "out"
    signal.alarm(120)  # a hang fails the test instead of the suite
    rc = load_tool("infer").main(["--config", str(TINY_CONFIG), "--weights",
                                  str(tmp_path / "w.pth"), "--input", str(inputs), "--output-dir", str(out), *cfg_args])
    signal.alarm(0)
    captured = capsys.readouterr()
    assert rc == 1
    assert "skipping 3 entries with image names that are no files: d_pipe.png, e_loop.jpg, f_dir.jpg" in caplog.text
    assert "not read: 1 subfolders (not searched: name each folder): sub; 1 files of no image format PIL reads: " \
        "notes.txt" in caplog.text
    assert sorted(p.name for p in out.glob("*.png")) == ["a.png", "c.png", "g.png", "h.png"]
    records = json.loads((out / "detections.json").read_text())
    assert [Path(r["file"]).name for r in records] == ["a.jpg", "c.png", "g.gif", "h.ppm"]
    errors = [line for line in captured.err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "skipped 1 unreadable image(s)" in errors[0]
    assert f"cannot decode image file {inputs / 'b_broken.jpg'}" in errors[0]
    assert "Traceback" not in captured.out + captured.err


# ----------------------------------------------------------------------------- a path that is no file


@pytest.mark.parametrize("kind", ["folder", "loop"])
def test_a_path_that_is_a_folder_or_a_loop_of_links_says_so(tmp_path, kind, capsys):
    """Where a file is read (a config, a checkpoint, an image, a predictions file), a
    folder or a loop of links in its place is named as such (they said 'not found', or
    in a config's case a RuntimeError traceback for the loop)."""
    from detector.config import ConfigError
    from detector.engine.checkpointing import load_checkpoint
    from detector.engine.resume_checks import CheckpointError
    from detector.evaluation.results import read_results_file

    bad = tmp_path / "bad.x"
    if kind == "folder":
        bad.mkdir()
        state = "is a folder, not a file"
    else:
        (tmp_path / "other").symlink_to(bad)
        bad.symlink_to(tmp_path / "other")
        state = "is a link to nothing (or a loop of links)"
    for call, error, words in ((load_config, ConfigError, "config file"), (load_checkpoint, CheckpointError, "checkpoint"),
                               (read_results_file, FileNotFoundError, "predictions file")):
        with pytest.raises(error) as info:
            call(bad)
        assert str(info.value) == f"{words} {bad} {state}"
    img_dir, ann = write_coco(tmp_path, "bad.x")
    (img_dir / "bad.x").symlink_to(bad)  # the image entry's file: a link to the folder or the loop
    with pytest.raises(DataError) as info:
        build_dataset(coco_cfg(img_dir, ann), "train", True)
    assert str(info.value) == f"data.train.root: image file {img_dir}/bad.x (image_id 7) {state}"
    report = check_dataset(coco_cfg(img_dir, ann), decode=False)
    assert report.errors == [f"image file {img_dir}/bad.x (image_id 7) {state}"]


def test_resume_at_a_run_folder_points_at_its_last_checkpoint(tmp_path, capsys):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "last.pth").write_bytes(b"x")
    code = load_tool("train").main(["--config", str(TINY_CONFIG), "--output-dir", str(tmp_path / "new"),
                                    "--resume", str(run)])
    err = capsys.readouterr().err
    assert code == 1 and err.strip() == (f"error: --resume: checkpoint {run} is a folder, not a file; --resume takes a "
                                         f"checkpoint file (a run folder: --resume {run}/checkpoints/last.pth)"), err


def test_a_pipe_named_as_an_image_is_an_error_not_a_hang(tmp_path):
    """A COCO file_name that is a named pipe: opening it waited for a writer, for ever
    (the checker and the loader); now one line, as for a folder."""
    img_dir, ann = write_coco(tmp_path, "pipe.jpg")
    os.mkfifo(img_dir / "pipe.jpg")
    signal.alarm(60)
    try:
        report = check_dataset(coco_cfg(img_dir, ann))
        with pytest.raises(DataError) as info:
            load_image(str(img_dir / "pipe.jpg"))
    finally:
        signal.alarm(0)
    assert report.errors == [f"image file {img_dir}/pipe.jpg (image_id 7) is not a regular file"]
    assert str(info.value) == f"image file {img_dir}/pipe.jpg is not a regular file"


def _pipe_in_place_of(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


@pytest.mark.parametrize("which", ["xml", "split"])
def test_a_pipe_named_as_a_voc_file_is_an_error_not_a_hang(tmp_path, which):
    """Every reader of an annotation file checks it is a regular file before opening it
    (an open of a named pipe waits for a writer for ever)."""
    root = make_voc(tmp_path)
    path = root / "Annotations" / "2008_000001.xml" if which == "xml" else root / "ImageSets" / "Main" / "train.txt"
    _pipe_in_place_of(path)
    what = "VOC annotation file" if which == "xml" else "VOC split file"
    signal.alarm(60)
    try:
        with pytest.raises(DataError) as info:
            VOCDetection(root, "train", class_names=["cat", "dog"])
        with pytest.raises(DataError) as split_info:
            read_voc_images(root, "train" if which == "split" else None)
    finally:
        signal.alarm(0)
    assert str(info.value).endswith(f"{what} {path} is not a regular file"), str(info.value)
    assert str(split_info.value).endswith(f"{what} {path} is not a regular file"), str(split_info.value)


def test_a_pipe_named_as_a_coco_file_is_an_error_not_a_hang(tmp_path, capsys):
    img_dir, ann = write_coco(tmp_path, "ok.jpg")
    _pipe_in_place_of(ann)
    signal.alarm(60)
    try:
        with pytest.raises(DataError, match=f"^annotation file {ann} is not a regular file$"):
            load_coco_json(ann)
        code = load_tool("split_dataset").main(["--annotations", str(ann), "--out", str(tmp_path / "out"), "--fractions", "0.5", "0.5"])
    finally:
        signal.alarm(0)
    assert code == 1 and f"annotation file {ann} is not a regular file" in capsys.readouterr().err


def test_voc_ids_with_spaces_are_refused_not_cut_at_the_space(tmp_path):
    """'my photo 1' was read as 'my' (another image's file, or 'not found: my.xml');
    split_dataset wrote such ids into lists its own reader cut."""
    root = make_voc(tmp_path)
    for sub, suffix in (("Annotations", ".xml"), ("JPEGImages", ".jpg")):
        (root / sub / f"2008_000001{suffix}").rename(root / sub / f"my photo 1{suffix}")
    (root / "ImageSets" / "Main" / "train.txt").write_text("my photo 1\n")
    with pytest.raises(DataError, match=r"train\.txt line 1: 'my photo 1' is not an image id .*VOC ids hold no spaces"):
        VOCDetection(root, "train", class_names=["cat", "dog"])
    with pytest.raises(DataError, match=r"my photo 1\.xml: a VOC image id cannot hold spaces"):
        read_voc_images(root)
    # VOC's per-class lists: an id and a -1/0/1 flag.
    (root / "ImageSets" / "Main" / "train.txt").write_text("a -1\nb  1\n\nc\n")
    assert read_voc_split(root / "ImageSets" / "Main" / "train.txt") == ["a", "b", "c"]


@pytest.mark.parametrize("case", ["windows", "nul", "suffix_voc"])
def test_a_missing_image_says_what_its_name_suggests(tmp_path, case):
    """'not found; is data.train.root the folder ...?' misled where the name told more:
    Windows separators, another suffix in the folder (VOC reads <id>.jpg), and a NUL
    byte (printed raw to the terminal; no file name can hold one)."""
    if case == "suffix_voc":
        root = make_voc(tmp_path)
        jpg = root / "JPEGImages" / "2008_000001.jpg"
        Image.open(jpg).save(jpg.with_suffix(".png"))
        jpg.unlink()
        cfg = load_config(None, ["data.format=voc", f"data.train.root={root}", "data.class_names=[cat,dog]"])
        expected = (f"image file {jpg} (image_id 2008000001) not found; the folder holds '2008_000001.png': the "
                    "annotations name '2008_000001.jpg' (VOC reads JPEGImages/<id>.jpg")
    else:
        name = "sub\\ok.jpg" if case == "windows" else "o\x00k.jpg"
        img_dir, ann = write_coco(tmp_path, name)
        (img_dir / "sub").mkdir()
        (img_dir / "ok.jpg").rename(img_dir / "sub" / "ok.jpg")
        cfg = coco_cfg(img_dir, ann)
        expected = (f"image file {img_dir}/sub\\ok.jpg (image_id 7) not found; its name uses Windows separators "
                    "('\\'): write the file names with '/'" if case == "windows" else
                    "image_id 7: file_name 'o\\x00k.jpg' holds a NUL byte, which no file name can")
    with pytest.raises((DataError, FileNotFoundError)) as info:
        build_dataset(cfg, "train", is_train=True)
    assert expected in str(info.value) and "\x00" not in str(info.value), str(info.value)


def test_a_class_name_in_another_unicode_normalisation_is_named_as_such(tmp_path):
    """'café' (NFC) against a category 'café' written as e + combining accent (NFD): the
    message said "(did you mean 'café'?)", the same word to the eye."""
    import unicodedata

    img_dir, ann = write_coco(tmp_path, "ok.jpg")
    data = json.loads(ann.read_text())
    data["categories"][0]["name"] = unicodedata.normalize("NFD", "café")
    ann.write_text(json.dumps(data))
    with pytest.raises(DataError) as info:
        CocoDetection(img_dir, ann, class_names=[unicodedata.normalize("NFC", "café")])
    assert "looks the same but is written with other Unicode code points: one is NFC, the other NFD" in str(info.value)


def _coco_with_boxes(tmp: Path, boxes) -> tuple[Path, Path]:
    img_dir, ann = write_coco(tmp, "ok.jpg", w=80, h=60)
    data = json.loads(ann.read_text())
    data["annotations"] = [{"id": i + 1, "image_id": 7, "category_id": 1, "bbox": b, "iscrowd": 0}
                           for i, b in enumerate(boxes)]
    ann.write_text(json.dumps(data))
    return img_dir, ann


def test_boxes_as_fractions_of_the_image_are_refused(tmp_path):
    """YOLO-style coordinates (fractions of the image size) read as pixels: every box
    inside the top-left pixel. They passed every check and trained on nothing (AP 0,
    exit 0); check_dataset said OK."""
    img_dir, ann = _coco_with_boxes(tmp_path / "a", [[0.1, 0.2, 0.3, 0.25], [0.5, 0.5, 0.2, 0.4]])
    expected = ("every box lies within 1 x 1 px at its image's top-left corner (e.g. image_id 7, 80 x 60 px: box "
                "[0.1, 0.2, 0.4, 0.45]): are the coordinates fractions of the image size")
    with pytest.raises(DataError) as info:
        CocoDetection(img_dir, ann)
    assert str(info.value).startswith(f"{ann}: {expected}"), str(info.value)
    report = check_dataset(coco_cfg(img_dir, ann))
    assert any(expected in e for e in report.errors), report.errors
    # Control: one box in pixels among small ones is a data set in pixels.
    img_dir, ann = _coco_with_boxes(tmp_path / "b", [[0.1, 0.2, 0.3, 0.25], [5, 5, 20, 10]])
    assert len(CocoDetection(img_dir, ann)) == 1


def test_a_box_too_thin_for_float32_is_degenerate(tmp_path, caplog):
    """1e-9 px wide: positive as a float64, 0 as the float32 it is stored in (a zero-
    width training box, no anchor matches it)."""
    img_dir, ann = _coco_with_boxes(tmp_path, [[10, 10, 1e-9, 10], [5, 5, 20, 10]])
    with caplog.at_level(logging.WARNING, logger="detector.data"):
        ds = CocoDetection(img_dir, ann)
    assert ds.get_annotation(0)["boxes"].shape == (1, 4)
    assert "box has non-positive width or height (1e-09 x 10 in float32, as boxes are stored: 0 x 10)" in caplog.text
