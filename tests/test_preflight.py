"""Everything checked before work starts (issue 10): config numbers finite and in range,
from conftest import load_tool
AMP that fits the device, data paths, the output folder, model.num_classes from the data,
class subsets (VOC and COCO), the num_workers cap and rank-0-only warnings.

Each refusal is one line naming the key or path; through tools/train.py it is a
non-zero exit and no traceback.
"""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

from detector.config import (
    AMPConfig,
    ConfigError,
    config_to_yaml,
    load_config,
    save_config,
)
from detector.data import (
    CocoDetection,
    DataError,
    VOCDetection,
    build_dataset,
    check_data_paths,
    data_num_classes,
    resolve_num_classes,
)
from detector.data.voc import VOC_CLASSES
from detector.data.loader import available_cpus, build_train_loader
from detector.engine.amp import resolve_amp
from detector.engine.log import setup_logging
from detector.engine.run_folder import check_output_dir
from conftest import load_tool

from conftest import ROOT  # noqa: E402
# configs/tiny_cpu.yaml on purpose: the preflight checks run on a user's config, with
# periodic evaluation on (so the val split is checked before training starts);
# tests/configs/tiny.yaml turns evaluation off.
TINY = ROOT / "configs" / "tiny_cpu.yaml"

# VOC objects of the tiny tree: image id -> class names (one box each).
VOC_OBJECTS = {"a": ["cat", "person", "person"], "b": ["dog", "car"], "c": ["cat", "dog", "person"]}


@pytest.fixture(scope="module")
def train_tool():
    return load_tool("train")


@pytest.fixture
def voc_root(tmp_path) -> Path:
    """A VOC year folder with three 64x48 images and the objects of VOC_OBJECTS."""
    root = tmp_path / "VOCdevkit" / "VOC2012"
    for sub in ("Annotations", "JPEGImages", "ImageSets/Main"):
        (root / sub).mkdir(parents=True)
    for k, (vid, names) in enumerate(VOC_OBJECTS.items()):
        Image.fromarray(np.full((48, 64, 3), 40 * k, np.uint8)).save(root / "JPEGImages" / f"{vid}.jpg")
        objects = "".join(
            f"<object><name>{n}</name><difficult>0</difficult><bndbox><xmin>{5 + j}</xmin><ymin>5</ymin>"
            f"<xmax>{30 + j}</xmax><ymax>40</ymax></bndbox></object>"
            for j, n in enumerate(names)
        )
        (root / "Annotations" / f"{vid}.xml").write_text(
            f"<annotation><size><width>64</width><height>48</height><depth>3</depth></size>{objects}</annotation>"
        )
    (root / "ImageSets" / "Main" / "train.txt").write_text("\n".join(VOC_OBJECTS) + "\n")
    (root / "ImageSets" / "Main" / "val.txt").write_text("a\n")
    return root


@pytest.fixture
def coco_files(tmp_path):
    """A COCO image folder and instances JSON: categories with ids 3, 7, 11 (a, b, c)."""
    images = tmp_path / "images"
    images.mkdir()
    Image.fromarray(np.zeros((40, 50, 3), np.uint8)).save(images / "x.jpg")
    anns = [
        {"id": 1, "image_id": 1, "category_id": 3, "bbox": [1, 1, 10, 10], "area": 100, "iscrowd": 0},
        {"id": 2, "image_id": 1, "category_id": 7, "bbox": [2, 2, 10, 10], "area": 100, "iscrowd": 0},
        {"id": 3, "image_id": 1, "category_id": 7, "bbox": [3, 3, 10, 10], "area": 100, "iscrowd": 0},
        {"id": 4, "image_id": 1, "category_id": 11, "bbox": [4, 4, 10, 10], "area": 100, "iscrowd": 0},
    ]
    data = {
        "images": [{"id": 1, "file_name": "x.jpg", "width": 50, "height": 40}],
        "annotations": anns,
        "categories": [{"id": 3, "name": "a"}, {"id": 7, "name": "b"}, {"id": 11, "name": "c"}],
    }
    ann_file = tmp_path / "instances.json"
    ann_file.write_text(json.dumps(data))
    return images, ann_file


def _voc_overrides(root: Path, out: Path) -> list:
    return ["data.format=voc", f"data.train.root={root}", "data.train.split=train", f"data.val.root={root}",
            "data.val.split=val", f"train.output_dir={out}", "solver.max_iter=1", "solver.images_per_gpu=1"]


# --------------------------------------------------------------------------- config numbers


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["solver.lr=nan"], "solver.lr"),
        (["solver.lr=inf"], "solver.lr"),
        (["solver.lr=-.inf"], "solver.lr"),
        (["solver.lr=0"], "solver.lr"),
        (["solver.warmup_factor=-0.5"], "solver.warmup_factor"),
        (["solver.warmup_factor=1.5"], "solver.warmup_factor"),
        (["solver.gamma=-0.1"], "solver.gamma"),
        (["solver.momentum=1.0"], "solver.momentum"),
        (["data.num_workers=-1"], "data.num_workers"),
        (["data.num_workers=2", "data.prefetch_factor=0"], "data.prefetch_factor"),
        (["eval.images_per_gpu=0"], "eval.images_per_gpu"),
        (["solver.images_per_gpu=0"], "solver.images_per_gpu"),
        (["solver.max_iter=0"], "solver.max_iter"),
        (["model.num_classes=0"], "model.num_classes"),
        (["model.pixel_mean=[0.5,nan,0.5]"], "model.pixel_mean[1]"),  # generic: any float, lists too
        (["rpn.nms_thresh=nan"], "rpn.nms_thresh"),
        (["solver.param_groups=[{match: backbone, lr_mult: .inf}]"], "solver.param_groups[0].lr_mult"),
        (["train.amp.enabled=maybe"], "train.amp.enabled"),
        (["train.amp.dtype=float8"], "train.amp.dtype"),
        (["data.class_names=[cat,cat]"], "data.class_names"),
        # Values that passed the checks and failed later, or trained to nothing: RoIAlign with
        # 1000 samples per bin side (a kernel that did not return for minutes), an RPN score
        # threshold above 1 (no proposal, silently), zero box-coder weights (no box loss),
        # 3 weights (torch's words, no key), an aspect ratio of 1e12 (NaN anchors, NaN losses),
        # BatchNorm with eps 0 (torch's error after the start), model sizes of 223 GiB.
        (["roi_heads.sampling_ratio=1000"], "roi_heads.sampling_ratio"),
        (["rpn.score_thresh=2"], "rpn.score_thresh"),
        (["rpn.box_coder_weights=[0,0,0,0]"], "rpn.box_coder_weights"),
        (["roi_heads.box_coder_weights=[10,10,5]"], "roi_heads.box_coder_weights"),
        (["model.anchors.aspect_ratios=[1e12]"], "model.anchors.aspect_ratios"),
        (["model.anchors.aspect_ratios=[1e-30]"], "model.anchors.aspect_ratios"),
        # levels of other anchor counts: the model's words, without the key, after the data set was built
        (["model.anchors.sizes=[[32,64],[64],[128],[256],[512]]"], "model.anchors.sizes"),
        (["model.anchors.sizes=[[],[64],[128],[256],[512]]"], "model.anchors.sizes"),
        (["model.norm=bn", "model.norm_eps=0"], "model.norm_eps"),
        (["model.norm_eps=-1"], "model.norm_eps"),
        (["model.fpn_channels=65536"], "model.fpn_channels"),
        (["model.size_divisibility=100000"], "model.size_divisibility"),
        (["roi_heads.pooler_resolution=5000"], "roi_heads.pooler_resolution"),
        (["roi_heads.representation_size=10000000"], "roi_heads.representation_size"),
    ],
)
def test_config_number_out_of_range_names_key(overrides, key):
    with pytest.raises(ConfigError) as e:
        load_config(TINY, overrides)
    msg = str(e.value)
    assert f"'{key}'" in msg and "\n" not in msg


def test_prefetch_factor_zero_is_fine_without_workers():
    cfg = load_config(TINY, ["data.num_workers=0", "data.prefetch_factor=0"])
    assert cfg.data.prefetch_factor == 0


def test_auto_keys_read_and_write_auto(tmp_path):
    cfg = load_config(TINY, ["model.num_classes=auto", "train.amp.enabled=auto"])
    assert cfg.model.num_classes is None and cfg.train.amp.enabled is None
    text = config_to_yaml(cfg)
    data = yaml.safe_load(text)
    assert data["model"]["num_classes"] == "auto" and data["train"]["amp"]["enabled"] == "auto"
    save_config(cfg, tmp_path / "c.yaml")
    again = load_config(tmp_path / "c.yaml")
    assert again.model.num_classes is None and again.train.amp.enabled is None
    assert load_config(TINY, ["model.num_classes=7", "train.amp.enabled=false"]).model.num_classes == 7


@pytest.mark.parametrize("name", ["faster_rcnn_r50_fpn_voc.yaml", "faster_rcnn_r50_fpn_1x_coco.yaml"])
def test_recipe_configs_take_classes_and_amp_from_data_and_device(name):
    cfg = load_config(ROOT / "configs" / name)
    assert cfg.model.num_classes is None and cfg.train.amp.enabled is None and cfg.train.amp.dtype == "auto"
    assert resolve_amp(cfg.train.amp, "cpu").enabled is False


# --------------------------------------------------------------------------- AMP


def test_resolve_amp_per_device(monkeypatch):
    auto = AMPConfig()
    cpu = resolve_amp(auto, "cpu")
    assert (cpu.enabled, cpu.uses_scaler) == (False, False)
    on_cpu = resolve_amp(AMPConfig(enabled=True), "cpu")
    assert on_cpu.enabled and on_cpu.dtype == torch.bfloat16 and not on_cpu.uses_scaler
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    gpu = resolve_amp(auto, torch.device("cuda", 0))
    assert gpu.enabled and gpu.dtype == torch.bfloat16 and not gpu.uses_scaler
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    old_gpu = resolve_amp(auto, "cuda")
    assert old_gpu.enabled and old_gpu.dtype == torch.float16 and old_gpu.uses_scaler
    assert resolve_amp(AMPConfig(enabled=False), "cuda").enabled is False


def test_float16_amp_on_cpu_is_refused():
    with pytest.raises(ConfigError) as e:
        resolve_amp(AMPConfig(enabled=True, dtype="float16"), "cpu")
    msg = str(e.value)
    assert "train.amp.enabled" in msg and "float16" in msg and "CPU" in msg and "\n" not in msg
    assert not resolve_amp(AMPConfig(enabled=None, dtype="float16"), "cpu").enabled  # auto: off, no error


# --------------------------------------------------------------------------- paths


def test_output_dir_checks(tmp_path):
    check_output_dir(tmp_path / "new" / "run")  # not created, and fine
    assert not (tmp_path / "new").exists()
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match=r"'train.output_dir'.*is a file"):
        check_output_dir(blocker)
    with pytest.raises(ConfigError, match=r"'train.output_dir'.*cannot be created.*is a file"):
        check_output_dir(blocker / "run")


def test_data_paths_checked_without_reading(voc_root, coco_files, tmp_path):
    cfg = load_config(TINY, _voc_overrides(voc_root, tmp_path / "out"))
    check_data_paths(cfg, "train")
    with pytest.raises(DataError, match=r"data.train.root: .*VOCdevkit folder; set it to the year folder, e\.g\. .*VOC2012"):
        check_data_paths(load_config(TINY, _voc_overrides(voc_root.parent, tmp_path / "out")), "train")
    with pytest.raises(DataError, match=r"data.val.split: VOC split file .*nosuch\.txt not found"):
        check_data_paths(load_config(TINY, _voc_overrides(voc_root, tmp_path / "o") + ["data.val.split=nosuch"]), "val")
    images, ann = coco_files
    coco = ["data.format=coco", f"data.train.root={images}", f"data.train.ann_file={ann}"]
    check_data_paths(load_config(TINY, coco), "train")
    with pytest.raises(DataError, match=r"data.train.ann_file: annotation file .*missing\.json not found"):
        check_data_paths(load_config(TINY, coco + [f"data.train.ann_file={tmp_path / 'missing.json'}"]), "train")
    with pytest.raises(DataError, match=r"data.train.root: image folder .*nowhere not found"):
        check_data_paths(load_config(TINY, coco + [f"data.train.root={tmp_path / 'nowhere'}"]), "train")
    # A folder that exists but holds other images: found when the data set is built.
    (tmp_path / "other").mkdir()
    with pytest.raises(DataError, match=r"data.train.root: image file .*other/x.jpg \(image_id 1\) not found; "
                                        r"is data.train.root the folder that holds the images of .*instances.json\?"):
        build_dataset(load_config(TINY, coco + [f"data.train.root={tmp_path / 'other'}"]), "train", True)


# --------------------------------------------------------------------------- classes


def test_voc_subset_drops_other_classes_and_logs_counts(voc_root, caplog):
    with caplog.at_level(logging.INFO, logger="detector.data"):
        ds = VOCDetection(voc_root, "train", class_names=["dog", "cat"], require_every_class=True)
    assert ds.class_names == ["dog", "cat"] and ds.num_classes == 2
    labels = {r.image_id: r.labels.tolist() for r in ds.records}
    assert sorted(sum(labels.values(), [])) == [1, 1, 2, 2]  # two dogs (label 1), two cats (label 2)
    lines = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
    assert len(lines) == 1 and "dropped 4 boxes of other classes: person 3, car 1" in lines[0]


@pytest.mark.parametrize("written", ["Cat", "CAT"])
def test_a_kept_class_written_otherwise_is_a_warning_naming_it(voc_root, tmp_path, caplog, written):
    """A box labelled 'Cat' (or 'CAT') in a subset that keeps 'cat' is a labelling slip,
    not another class: it is dropped as before, with a warning naming the class it
    differs from only in case or spacing; the checker's line says the same. Long names
    are cut in both."""
    from detector.data.check import check_dataset, format_report

    ann = voc_root / "Annotations" / "c.xml"
    text = ann.read_text()
    ann.write_text(text.replace("<name>cat</name>", f"<name>{written}</name>", 1))
    assert ann.read_text() != text
    with caplog.at_level(logging.INFO, logger="detector.data"):
        VOCDetection(voc_root, "train", class_names=["dog", "cat"], require_every_class=True)
    line = [r for r in caplog.records if "dropped" in r.getMessage()]
    assert len(line) == 1 and line[0].levelno == logging.WARNING, line
    assert f"{written} 1 (differs from 'cat' only in case or spacing" in line[0].getMessage(), line[0].getMessage()
    cfg = load_config(TINY, _voc_overrides(voc_root, tmp_path / "o") + ["data.class_names=[dog,cat]"])
    assert "differs from 'cat' only in case or spacing" in format_report(check_dataset(cfg, "train"))
    long = "x" * 500
    ann.write_text(text.replace("<name>cat</name>", f"<name>{long}</name>", 1))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="detector.data"):
        VOCDetection(voc_root, "train", class_names=["dog", "cat"], require_every_class=True)
    (line,) = [r for r in caplog.records if "dropped" in r.getMessage()]
    assert line.levelno == logging.INFO and "x" * 37 + "... 1" in line.getMessage() and long not in line.getMessage()


def test_voc_default_classes_still_refuse_unknown_names(voc_root):
    ann = voc_root / "Annotations" / "a.xml"
    ann.write_text(ann.read_text().replace("<name>cat</name>", "<name>widget</name>"))
    with pytest.raises(DataError, match=r"a\.xml: object 0: class name 'widget' is not in data.class_names"):
        VOCDetection(voc_root, "train")


def test_a_voc_class_of_difficult_objects_only_trains_only_with_use_difficult(voc_root, tmp_path):
    """A listed class whose every object is marked difficult has no training box (difficult
    boxes train only with data.use_difficult): refused in training with a line saying
    so, alone and joined with another set; it used to pass the check and train no box."""
    for xml in (voc_root / "Annotations").glob("*.xml"):
        text = xml.read_text()
        xml.write_text(text.replace("<name>cat</name><difficult>0</difficult>", "<name>cat</name><difficult>1</difficult>"))
    (voc_root / "ImageSets" / "Main" / "one.txt").write_text("b\n")
    (voc_root / "ImageSets" / "Main" / "two.txt").write_text("a\nc\n")
    overrides = _voc_overrides(voc_root, tmp_path / "o") + ["data.class_names=[dog,cat]"]
    extra = [f"data.train_extra=[{{root: '{voc_root}', split: one}}]", "data.train.split=two"]
    alone, joined = load_config(TINY, overrides), load_config(TINY, overrides + extra)
    for cfg, where in ((alone, r"in .*VOC2012 \(train\)$"), (joined, r"in the training sets \(data\.train, "
                                                                       r"data\.train_extra\[0\]\)$")):
        with pytest.raises(DataError, match=r"^data\.class_names: 'cat' has only difficult objects \(trained on with "
                                            r"data\.use_difficult=true\) " + where):
            build_dataset(cfg, "train", True)
    # tools/check_dataset.py says what training refuses (it used to say OK)
    from detector.data.check import check_datasets
    (alone_report,) = check_datasets(alone, "train", decode=False)
    assert alone_report.errors == [f"data.class_names: 'cat' has only difficult objects (trained on with "
                                   f"data.use_difficult=true) in {alone_report.source}"]
    joined_reports = check_datasets(joined, "train", decode=False)
    assert [r.errors for r in joined_reports] == [["data.class_names: 'cat' has only difficult objects (trained on "
                                                   "with data.use_difficult=true) in the training sets (data.train, "
                                                   "data.train_extra[0])"], []]
    with_difficult = ["data.use_difficult=true"]
    assert build_dataset(load_config(TINY, overrides + with_difficult), "train", True).num_training_boxes() == 4
    assert not check_datasets(load_config(TINY, overrides + with_difficult + extra), "train", decode=False)[0].errors
    assert build_dataset(load_config(TINY, overrides + with_difficult + extra), "train", True).num_training_boxes() == 4


def test_voc_subset_class_without_objects_is_an_error_in_training(voc_root, tmp_path):
    cfg = load_config(TINY, _voc_overrides(voc_root, tmp_path / "o") + ["data.class_names=[dog,persn]"])
    with pytest.raises(DataError, match=r"data.class_names: 'persn' has no object in .*did you mean 'person'"):
        build_dataset(cfg, "train", True)
    from detector.data.check import check_dataset  # the checker says the same (it used to say OK)
    (error,) = check_dataset(cfg, "train", decode=False).errors
    assert error.startswith("data.class_names: 'persn' has no object in VOC ") and "did you mean 'person'" in error
    assert build_dataset(cfg, "val", False).num_classes == 2  # a val split may lack a class


def test_coco_subset_maps_labels_and_category_ids(coco_files, caplog):
    images, ann = coco_files
    with caplog.at_level(logging.INFO, logger="detector.data"):
        ds = CocoDetection(images, ann, class_names=["c", "a"])
    assert ds.class_names == ["c", "a"] and ds.label_to_category_id == {1: 11, 2: 3}
    assert ds.records[0].labels.tolist() == [2, 1]  # a (id 3), c (id 11); b dropped
    gt = ds.coco_gt()
    assert [c["id"] for c in gt["categories"]] == [11, 3]
    assert sorted(a["category_id"] for a in gt["annotations"]) == [3, 11]
    assert sorted(ds.coco.getCatIds()) == [3, 11]
    assert any("dropped 2 boxes of other classes: b 2" in r.getMessage() for r in caplog.records)
    full = CocoDetection(images, ann)
    assert full.class_names == ["a", "b", "c"] and full.label_to_category_id == {1: 3, 2: 7, 3: 11}


def test_coco_unknown_class_name_suggests_nearest(coco_files):
    images, ann = coco_files
    with pytest.raises(DataError) as e:
        CocoDetection(images, ann, class_names=["a", "cc"])
    msg = str(e.value)
    assert "data.class_names: 'cc' is not a category name of" in msg and "did you mean 'c'" in msg


def test_num_classes_auto_from_data(voc_root, coco_files, tmp_path):
    voc = load_config(TINY, _voc_overrides(voc_root, tmp_path / "o") + ["model.num_classes=auto"])
    assert data_num_classes(voc) == (20, "VOC's 20 classes") and len(VOC_CLASSES) == 20
    sub = load_config(TINY, _voc_overrides(voc_root, tmp_path / "o") + ["model.num_classes=auto", "data.class_names=[cat,dog]"])
    assert resolve_num_classes(sub).model.num_classes == 2
    images, ann = coco_files
    coco = load_config(TINY, ["data.format=coco", f"data.train.root={images}", f"data.train.ann_file={ann}",
                              "model.num_classes=auto"])
    assert resolve_num_classes(coco).model.num_classes == 3
    assert resolve_num_classes(load_config(TINY, ["model.num_classes=auto"])).model.num_classes == 3  # shapes
    with pytest.raises(ConfigError) as e:
        resolve_num_classes(load_config(TINY, _voc_overrides(voc_root, tmp_path / "o") + ["data.class_names=[cat,dog]",
                                                                                           "model.num_classes=5"]))
    msg = str(e.value)
    assert "'model.num_classes' is 5 but the data has 2 classes (data.class_names)" in msg and "\n" not in msg


# --------------------------------------------------------------------------- tools/train.py refusals


def _bad_inputs(voc_root: Path, tmp_path: Path):
    out = tmp_path / "run"
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    # A val split whose only file names a class VOC does not have: found when the val set is
    # built, before training (it was found at the first evaluation, after training).
    (voc_root / "Annotations" / "u.xml").write_text(
        "<annotation><size><width>64</width><height>48</height><depth>3</depth></size><object><name>unicorn</name>"
        "<bndbox><xmin>5</xmin><ymin>5</ymin><xmax>30</xmax><ymax>40</ymax></bndbox></object></annotation>")
    Image.fromarray(np.zeros((48, 64, 3), np.uint8)).save(voc_root / "JPEGImages" / "u.jpg")
    (voc_root / "ImageSets" / "Main" / "unicorn.txt").write_text("u\n")
    return {
        "lr_nan": (["solver.lr=nan"], ["'solver.lr'", "nan"]),
        "lr_inf": (["solver.lr=inf"], ["'solver.lr'", "inf"]),
        "warmup_factor_negative": (["solver.warmup_factor=-0.1"], ["'solver.warmup_factor'"]),
        "gamma_negative": (["solver.gamma=-0.1"], ["'solver.gamma'"]),
        "num_workers_negative": (["data.num_workers=-1"], ["'data.num_workers'"]),
        "prefetch_zero_with_workers": (["data.num_workers=1", "data.prefetch_factor=0"], ["'data.prefetch_factor'"]),
        "eval_images_per_gpu_zero": (["eval.images_per_gpu=0"], ["'eval.images_per_gpu'"]),
        "output_dir_is_a_file": ([f"train.output_dir={blocker}"], ["'train.output_dir'", str(blocker)]),
        "num_classes_mismatch": (["data.class_names=[cat,dog]", "model.num_classes=5"],
                                 ["'model.num_classes'", "5", "2 classes"]),
        "missing_root": ([f"data.train.root={tmp_path / 'nowhere'}"], ["data.train.root", str(tmp_path / "nowhere")]),
        "missing_val_split": (["data.val.split=test"], ["data.val.split", "test.txt"]),
        "devkit_not_year_folder": ([f"data.train.root={voc_root.parent}"], ["data.train.root", "year folder"]),
        "float16_amp_on_cpu": (["train.amp.enabled=true", "train.amp.dtype=float16"], ["'train.amp.enabled'", "CPU"]),
        "class_name_typo": (["data.class_names=[cat,dgo]"], ["data.class_names", "'dgo'", "did you mean 'dog'"]),
        "val_annotation_fault": (["data.val.split=unicorn", "train.eval_period=0", "model.num_classes=auto"],
                                 [str(voc_root / "Annotations" / "u.xml"), "'unicorn'"]),
    }, out


BAD_INPUTS = ["lr_nan", "lr_inf", "warmup_factor_negative", "gamma_negative", "num_workers_negative",
              "prefetch_zero_with_workers", "eval_images_per_gpu_zero", "output_dir_is_a_file",
              "num_classes_mismatch", "missing_root", "missing_val_split", "devkit_not_year_folder",
              "float16_amp_on_cpu", "class_name_typo", "val_annotation_fault"]


def _run_train_tool(train_tool, argv: list, capsys):
    """``tools/train.py``'s main in this process: ``(exit status, stderr lines starting
    with "error:", captured output)``; the logging it set up is undone."""
    try:
        code = train_tool.main(argv)
    finally:
        logging.getLogger("detector").handlers.clear()
        logging.captureWarnings(False)
    captured = capsys.readouterr()
    return code, [line for line in captured.err.splitlines() if line.startswith("error:")], captured


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_train_tool_refuses_bad_input_with_one_line(case, train_tool, voc_root, tmp_path, capsys):
    cases, out = _bad_inputs(voc_root, tmp_path)
    extra, expected = cases[case]
    argv = ["--config", str(TINY), *_voc_overrides(voc_root, out), "train.device=cpu", *extra]
    code, err_lines, captured = _run_train_tool(train_tool, argv, capsys)
    assert code != 0
    assert len(err_lines) == 1, captured.err
    for text in expected:
        assert text in err_lines[0], (text, err_lines[0])
    assert "Traceback" not in captured.err + captured.out
    assert not (out / "checkpoints").exists()


# --------------------------------------------------------------------------- workers, logging


def test_num_workers_above_cpu_count_is_capped_with_one_line(voc_root, tmp_path, caplog):
    cpus = available_cpus()
    cfg = load_config(TINY, _voc_overrides(voc_root, tmp_path / "o") + [f"data.num_workers={cpus + 3}",
                                                                         "data.persistent_workers=false"])
    ds = build_dataset(cfg, "train", True)
    with caplog.at_level(logging.INFO, logger="detector.data.loader"):
        loader = build_train_loader(cfg, ds)
    assert loader.num_workers == cpus
    lines = [r for r in caplog.records if "data.num_workers" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.INFO and f"using {cpus} workers" in lines[0].getMessage()


@pytest.mark.parametrize("rank", [0, 1])
def test_warnings_print_on_rank_zero_only(rank, capsys):
    log = logging.getLogger("detector.test_preflight")
    try:
        setup_logging(None, rank)
        log.warning("a warning every rank would repeat")
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.warn("a python warning every rank would repeat", UserWarning)
        log.error("an error of this rank")
    finally:
        for name in ("detector", "py.warnings"):
            logging.getLogger(name).handlers.clear()
        logging.captureWarnings(False)
    out = capsys.readouterr().out
    assert ("a warning every rank would repeat" in out) == (rank == 0)
    assert ("a python warning every rank would repeat" in out) == (rank == 0)
    assert "an error of this rank" in out


# --------------------------------------------------------------------------- offline backbone weights


def _offline(monkeypatch, tmp_path) -> Path:
    """An empty torch hub cache and a download function that fails as it does offline."""
    import urllib.error

    def no_network(url, *args, **kwargs):
        raise urllib.error.URLError("[Errno -3] Temporary failure in name resolution")

    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch_home"))
    monkeypatch.setattr(torch.hub, "download_url_to_file", no_network)
    return tmp_path / "torch_home" / "hub" / "checkpoints"


def test_backbone_weights_offline_is_one_line_naming_file_and_way_out(monkeypatch, tmp_path):
    from detector.modeling.backbone import build_resnet_fpn
    from detector.modeling.weights import WeightsError

    folder = _offline(monkeypatch, tmp_path)
    with pytest.raises(WeightsError) as e:
        build_resnet_fpn("resnet18", norm="bn", backbone_weights="ResNet18_Weights.IMAGENET1K_V1")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("model.backbone_weights: cannot download")
    assert "resnet18-f37072fd.pth" in msg and f"put that file in {folder}/" in msg
    assert "model.backbone_weights= to start from random initialisation" in msg
    assert not any(folder.parent.rglob("*.pth"))


def test_backbone_weights_file_put_in_the_cache_loads_offline(monkeypatch, tmp_path):
    import torchvision

    from detector.modeling.backbone import build_resnet_fpn

    folder = _offline(monkeypatch, tmp_path)
    folder.mkdir(parents=True)
    torch.manual_seed(3)
    state = torchvision.models.resnet18().state_dict()
    torch.save(state, folder / "resnet18-f37072fd.pth")
    backbone = build_resnet_fpn("resnet18", norm="bn", freeze_at=0, backbone_weights="ResNet18_Weights.IMAGENET1K_V1")
    loaded = backbone.body.state_dict()
    assert torch.equal(loaded["conv1.weight"], state["conv1.weight"])
    assert torch.equal(loaded["layer4.1.conv2.weight"], state["layer4.1.conv2.weight"])


def test_train_tool_offline_backbone_weights(monkeypatch, tmp_path, train_tool, voc_root, capsys):
    _offline(monkeypatch, tmp_path)
    argv = ["--config", str(TINY), *_voc_overrides(voc_root, tmp_path / "run"), "train.device=cpu",
            "data.class_names=[cat,dog,person]", "model.backbone_weights=ResNet18_Weights.IMAGENET1K_V1"]
    code, err_lines, captured = _run_train_tool(train_tool, argv, capsys)
    assert code == 1 and len(err_lines) == 1
    assert "model.backbone_weights" in err_lines[0] and "resnet18-f37072fd.pth" in err_lines[0]
    assert "Traceback" not in captured.err + captured.out


def test_check_dataset_reports_a_class_subset_like_training(voc_root, tmp_path):
    from detector.data.check import check_dataset, format_report

    cfg = load_config(TINY, _voc_overrides(voc_root, tmp_path / "o") + ["data.class_names=[dog,cat]"])
    report = check_dataset(cfg, "train")
    assert report.ok, report.errors
    assert report.per_class == {"dog": 2, "cat": 2} and report.other_classes == {"person": 3, "car": 1}
    assert "boxes of classes outside data.class_names (dropped in training): 4 (person 3, car 1)" in format_report(report)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["lr_nan", "output_dir_is_a_file", "num_classes_mismatch"])
def test_train_tool_process_exits_1_with_one_line(case, voc_root, tmp_path):
    """The same refusals from a real process: exit status 1, one stderr line, no traceback."""
    import os
    import subprocess
    import sys

    cases, out = _bad_inputs(voc_root, tmp_path)
    extra, expected = cases[case]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_WAIT_POLICY": "PASSIVE"}
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "train.py"), "--config", str(TINY),
                           *_voc_overrides(voc_root, out), "train.device=cpu", *extra],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(err) == 1 and err[0].startswith("error: "), proc.stderr
    assert all(text in err[0] for text in expected), err[0]
    assert "Traceback" not in proc.stdout + proc.stderr
