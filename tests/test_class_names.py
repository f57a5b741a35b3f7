"""One labelling for training, evaluation and the tools (``detector.data.classes``).

A val file may number its categories otherwise than the training file (ids in another
order, an extra category, other names). Training pins the training set's class names
(``resolve_class_names``), so the val set is read by name; where names cannot be pinned
(``data.label_space: category_id``, category names that repeat), a val file whose labels
would name other classes is refused before any work (``check_val_classes``). The tools
name the labels of a COCO-format run (``class_names_for``).
"""

from __future__ import annotations

import csv
import json
import logging
import shutil
from pathlib import Path
from typing import Callable, Dict, List

import pytest
import yaml

from conftest import TINY_CONFIG, load_tool
from detector.config import Config, load_config
from detector.data import (DataError, build_dataset, check_val_classes, class_names_for, resolve_class_names,
                           resolve_num_classes)
from detector.data.shapes import ensure_shapes
from detector.engine.trainer import build_trainer
from detector.modeling.trained_config import other_settings, trained_class_names, trained_settings

SHAPES = ["circle", "rectangle", "triangle"]


@pytest.fixture(scope="module")
def shapes(tmp_path_factory) -> Path:
    """The tiny config's generated shapes as COCO files: train/, val/, train.json, val.json."""
    return ensure_shapes(tmp_path_factory.mktemp("coco_shapes") / "data", 8, 4, 3, 64, 96)


@pytest.fixture(scope="module")
def coco_run(shapes, tmp_path_factory) -> Path:
    """A run folder of the tiny model trained 2 iterations on ``shapes`` (COCO format),
    evaluated at the end on the val file."""
    run = tmp_path_factory.mktemp("coco_run") / "run"
    argv = ["--config", str(TINY_CONFIG), *coco_overrides(shapes, shapes / "val.json", f"train.output_dir={run}",
                                                           "solver.max_iter=2", "train.eval_period=0")]
    assert load_tool("train").main(argv) == 0
    return run


def variant(shapes: Path, tmp_path: Path, name: str, change: Callable[[dict], None]) -> Path:
    """A copy of the val JSON changed by ``change`` (in place), as ``tmp_path / name``."""
    data = json.loads((shapes / "val.json").read_text())
    change(data)
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return path


def renumber(mapping: Dict[int, int]) -> Callable[[dict], None]:
    """Give the categories new ids (names kept): ``mapping`` old id -> new id."""
    def change(data: dict) -> None:
        for c in data["categories"]:
            c["id"] = mapping[c["id"]]
        for a in data["annotations"]:
            a["category_id"] = mapping[a["category_id"]]
    return change


def coco_overrides(shapes: Path, val_file: Path, *extra: str) -> List[str]:
    return ["data.format=coco", f"data.train.root={shapes / 'train'}", f"data.train.ann_file={shapes / 'train.json'}",
            f"data.val.root={shapes / 'val'}", f"data.val.ann_file={val_file}", *extra]


def coco_cfg(shapes: Path, val_file: Path, *extra: str) -> Config:
    return load_config(TINY_CONFIG, coco_overrides(shapes, val_file, *extra))


def resolved(cfg: Config):
    """(the config as training resolves it, the training set)."""
    train_set = build_dataset(cfg, "train", True)
    return resolve_class_names(resolve_num_classes(cfg, train_set), train_set), train_set


def labels_by_image(dataset) -> Dict[int, List[int]]:
    """Each image's ground-truth labels, sorted."""
    out = {}
    for i in range(len(dataset)):
        target = dataset.get_annotation(i)
        out[int(target["image_id"])] = sorted(int(lab) for lab in target["labels"])
    return out


def test_training_pins_the_training_set_class_names(shapes, tmp_path):
    swapped = variant(shapes, tmp_path, "swapped.json", renumber({1: 2, 2: 1, 3: 3}))
    cfg, train_set = resolved(coco_cfg(shapes, swapped))
    assert cfg.data.class_names == SHAPES == train_set.class_names
    check_val_classes(cfg, train_set)  # the same names: accepted
    # Read by name, the swapped file gives every box the label of the original file.
    original_cfg, _ = resolved(coco_cfg(shapes, shapes / "val.json"))
    by_name = build_dataset(cfg, "val", False)
    assert by_name.class_names == SHAPES
    original = labels_by_image(build_dataset(original_cfg, "val", False))
    assert labels_by_image(by_name) == original
    # The control: by sorted id (names not pinned), circles and rectangles trade labels.
    by_id = build_dataset(coco_cfg(shapes, swapped), "val", False)
    assert by_id.class_names == ["rectangle", "circle", "triangle"]
    assert labels_by_image(by_id) != original


def test_names_left_as_set_for_voc_category_ids_and_user_names(shapes, tmp_path):
    cfg, train_set = resolved(coco_cfg(shapes, shapes / "val.json", "data.class_names=[triangle,circle]", "model.num_classes=auto"))
    assert cfg.data.class_names == ["triangle", "circle"]
    cfg, _ = resolved(coco_cfg(shapes, shapes / "val.json", "data.label_space=category_id", "model.num_classes=auto"))
    assert cfg.data.class_names == []


def per_class(run: Path) -> Dict[str, dict]:
    """The final evaluation's per_class.csv of a run folder, by class name, without the id."""
    (csv_file,) = (run / "eval").glob("*/per_class.csv")
    with open(csv_file) as f:
        return {row["name"]: {k: v for k, v in row.items() if k != "category_id"} for row in csv.DictReader(f)}


def test_a_val_file_with_other_ids_scores_the_model_as_the_original_file(shapes, coco_run, tmp_path):
    # The same model (seeded), evaluated at the end of training on the val file and on a copy
    # whose circle and rectangle ids are swapped: the same ground truth, detections and AP
    # per class name. (By sorted id, the model's circles were scored as the copy's rectangles.)
    swapped = variant(shapes, tmp_path, "swapped.json", renumber({1: 2, 2: 1, 3: 3}))
    run = tmp_path / "swapped"
    argv = ["--config", str(TINY_CONFIG), *coco_overrides(shapes, swapped, f"train.output_dir={run}",
                                                           "solver.max_iter=2", "train.eval_period=0")]
    assert load_tool("train").main(argv) == 0
    for folder in (coco_run, run):
        assert yaml.safe_load((folder / "config.yaml").read_text())["data"]["class_names"] == SHAPES
    original, moved = per_class(coco_run), per_class(run)
    assert set(original) == set(SHAPES) and sum(int(r["num_det"]) for r in original.values()) > 0
    assert moved == original


def test_a_val_file_without_a_training_class_stops_before_training(shapes, tmp_path, capsys):
    renamed = variant(shapes, tmp_path, "renamed.json", lambda d: d["categories"][0].update(name="Circle"))
    out = tmp_path / "run"
    argv = ["--config", str(TINY_CONFIG), *coco_overrides(shapes, renamed, f"train.output_dir={out}", "train.eval_period=0")]
    assert load_tool("train").main(argv) == 1
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert err == [f"error: data.val.ann_file {renamed} has no category named 'circle' (did you mean 'Circle'?), a class "
                   f"of the training set ({shapes / 'train.json'}): the val set is read by the training classes' names "
                   "(data.class_names), one category each"]
    assert not (out / "checkpoints").exists() or not any((out / "checkpoints").iterdir())
    assert not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").read_text()


def test_a_class_named_twice_in_the_val_file_is_refused(shapes, tmp_path):
    twice = variant(shapes, tmp_path, "twice.json", lambda d: d["categories"].append({"id": 9, "name": "circle"}))
    cfg, train_set = resolved(coco_cfg(shapes, twice))
    with pytest.raises(DataError, match=r"has 2 categories named 'circle', a class of the training set"):
        check_val_classes(cfg, train_set)


def test_an_extra_val_category_is_left_out(shapes, tmp_path):
    extra = variant(shapes, tmp_path, "extra.json", lambda d: d["categories"].append({"id": 7, "name": "hexagon"}))
    cfg, train_set = resolved(coco_cfg(shapes, extra))
    check_val_classes(cfg, train_set)
    assert build_dataset(cfg, "val", False).class_names == SHAPES


def test_category_ids_must_name_one_class_in_both_files(shapes, tmp_path):
    same = variant(shapes, tmp_path, "same.json", lambda d: None)
    cfg, train_set = resolved(coco_cfg(shapes, same, "data.label_space=category_id", "model.num_classes=auto"))
    check_val_classes(cfg, train_set)
    swapped = variant(shapes, tmp_path, "swapped.json", renumber({1: 2, 2: 1, 3: 3}))
    cfg, train_set = resolved(coco_cfg(shapes, swapped, "data.label_space=category_id", "model.num_classes=auto"))
    with pytest.raises(DataError) as err:
        check_val_classes(cfg, train_set)
    assert str(err.value) == (
        f"data.val.ann_file {swapped}: category id 1 is 'rectangle' there but 'circle' in the training set "
        f"({shapes / 'train.json'}); with data.label_space=category_id the labels are the ids, so an id must name "
        "the same class in both files")
    # An id the val file lacks, or one only the val file has, is no conflict.
    fewer = variant(shapes, tmp_path, "fewer.json", lambda d: d.update(
        categories=[c for c in d["categories"] if c["id"] != 3] + [{"id": 5, "name": "hexagon"}],
        annotations=[a for a in d["annotations"] if a["category_id"] != 3]))
    cfg, train_set = resolved(coco_cfg(shapes, fewer, "data.label_space=category_id", "model.num_classes=auto"))
    check_val_classes(cfg, train_set)


def test_repeated_names_are_matched_by_id_order_and_checked(shapes, tmp_path):
    # Train categories: 1 shape (circle), 2 shape (rectangle), 3 triangle: names repeat, so
    # they are not pinned; a val file whose triangle comes first by id is refused.
    train = json.loads((shapes / "train.json").read_text())
    for c in train["categories"]:
        c["name"] = "triangle" if c["id"] == 3 else "shape"
    train_file = tmp_path / "train.json"
    train_file.write_text(json.dumps(train))

    def names(order: Dict[int, int]) -> Callable[[dict], None]:
        def change(d: dict) -> None:
            renumber(order)(d)
            for c in d["categories"]:
                c["name"] = "triangle" if c["id"] == order[3] else "shape"
        return change

    def cfg_for(val: Path) -> Config:
        return load_config(TINY_CONFIG, ["data.format=coco", f"data.train.root={shapes / 'train'}",
                                         f"data.train.ann_file={train_file}", f"data.val.root={shapes / 'val'}",
                                         f"data.val.ann_file={val}"])

    good = variant(shapes, tmp_path, "good.json", names({1: 1, 2: 2, 3: 3}))
    cfg, train_set = resolved(cfg_for(good))
    assert cfg.data.class_names == [] and train_set.class_names == ["shape", "shape", "triangle"]
    check_val_classes(cfg, train_set)
    bad = variant(shapes, tmp_path, "bad.json", names({1: 2, 2: 3, 3: 1}))
    cfg, train_set = resolved(cfg_for(bad))
    with pytest.raises(DataError, match=r"label 1 \(its categories sorted by id\) is 'triangle' there but 'shape' in "
                                        r"the training set .*category names repeat"):
        check_val_classes(cfg, train_set)


def test_class_names_of_a_coco_config_without_names(shapes, tmp_path):
    # A user's COCO config (no data.class_names): the val file's categories by id; the names
    # default to the id where a category has none. (This raised TypeError in tools/infer.py
    # and tools/export.py.)
    data = variant(shapes, tmp_path, "unnamed.json", lambda d: (d["categories"].reverse(),
                                                                d["categories"][0].pop("name")))
    assert class_names_for(coco_cfg(shapes, data)) == ["circle", "rectangle", "3"]


def test_infer_names_the_classes_of_a_coco_run(shapes, coco_run, tmp_path):
    run = coco_run
    # The run's config.yaml, and a config without names (the user's own recipe) as well.
    for name, cfg_args in (("run", ["--config", str(run / "config.yaml")]),
                           ("user", ["--config", str(TINY_CONFIG), *coco_overrides(shapes, shapes / "val.json")])):
        out = tmp_path / f"infer_{name}"
        assert load_tool("infer").main([*cfg_args, "--weights", str(run / "checkpoints" / "last.pth"),
                                        "--input", str(shapes / "val"), "--output-dir", str(out),
                                        "--score-thresh", "0"]) == 0
        dets = json.loads((out / "detections.json").read_text())
        names = {n for d in dets for n in d["names"]}
        assert names and names <= set(SHAPES), name


def test_tools_refuse_a_config_that_names_the_labels_otherwise_than_the_run(shapes, coco_run, tmp_path, capsys):
    # A run trained on the val file's numbering (circle 1, rectangle 2), then evaluated, drawn
    # or exported with a config whose val file numbers them the other way and has no names:
    # by sorted id its label 1 would be the rectangle.
    weights = str(coco_run / "checkpoints" / "last.pth")
    swapped = variant(shapes, tmp_path, "swapped.json", renumber({1: 2, 2: 1, 3: 3}))
    other = ["--config", str(TINY_CONFIG), *coco_overrides(shapes, swapped)]
    want = (f"error: --weights {weights}: label 1 is 'circle' in the run that trained it (its data.class_names) but "
            "'rectangle' in this config's data: use that run's config.yaml, or set data.class_names to the run's "
            "class names")
    calls = {
        "eval": ["--weights", weights, "--output-dir", str(tmp_path / "eval")],
        "infer": ["--weights", weights, "--input", str(shapes / "val"), "--output-dir", str(tmp_path / "infer")],
        "export": ["--weights", weights, "--output", str(tmp_path / "model.onnx"), "--format", "onnx"],
    }
    for tool, args in calls.items():
        assert load_tool(tool).main([*other, *args]) == 1, tool
        errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
        assert errors == [want], tool
    assert not (tmp_path / "model.onnx").exists() and not (tmp_path / "infer" / "detections.json").exists()
    # With the names given (in the run's order), the same file is read by name: accepted.
    named = [*other, "data.class_names=[circle,rectangle,triangle]"]
    assert load_tool("eval").main([*named, *calls["eval"]]) == 0


def test_tools_warn_of_a_config_that_decodes_the_weights_otherwise(shapes, coco_run, tmp_path, capsys):
    """Another recipe's anchors and box-coder weights load without a shape mismatch and
    find fewer objects: eval, infer and export say which keys differ from the run's."""
    weights = str(coco_run / "checkpoints" / "last.pth")
    base = ["--config", str(TINY_CONFIG), *coco_overrides(shapes, shapes / "val.json")]
    other = ["model.anchors.sizes=[[32],[64],[128],[256],[512]]", "roi_heads.box_coder_weights=[1,1,1,1]"]
    calls = {
        "eval": ["--weights", weights, "--output-dir", str(tmp_path / "eval")],
        "infer": ["--weights", weights, "--input", str(shapes / "val"), "--output-dir", str(tmp_path / "infer")],
        "export": ["--weights", weights, "--output", str(tmp_path / "model.pt"), "--format", "torchscript"],
    }
    for tool, args in calls.items():
        for overrides in ([], other):
            assert load_tool(tool).main([*base, *overrides, *args]) == 0, tool
            out, err = capsys.readouterr()  # (tools/eval.py logs to stdout, its lines wrapped)
            said = " ".join((out + err).split())
            assert said.count("decodes them otherwise") == (1 if overrides else 0), (tool, said)
            if overrides:
                assert (f"--weights {weights}: this config decodes them otherwise than the run that trained them: "
                        "model.anchors.sizes=[[32],[64],[128],[256],[512]] (trained with [[16],[32],[64],[128],[256]]); "
                        "roi_heads.box_coder_weights=[1,1,1,1] (trained with [10,10,5,5]); ") in said, tool


def test_trained_settings_of_checkpoints_and_state_dicts():
    sizes = [[16], [32], [64], [128], [256]]  # the tiny config's
    config = {"model": {"anchors": {"sizes": sizes}}, "roi_heads": {"aligned": True}}
    trained = trained_settings({"model": {}, "config": config})
    assert trained == {"model.anchors.sizes": [[float(s[0])] for s in sizes], "roi_heads.aligned": True}  # others: not stored
    cfg = load_config(TINY_CONFIG, ["model.anchors.sizes=[[16],[32.0],[64],[128],[256]]", "roi_heads.aligned=true"])
    assert other_settings(trained, cfg) == []  # 64 and 64.0 are one size
    cfg = load_config(TINY_CONFIG, ["roi_heads.aligned=false"])
    assert other_settings(trained, cfg) == ["roi_heads.aligned=false (trained with true)"]
    assert trained_settings({"weight": object()}) == {}


def test_trained_class_names_of_checkpoints_and_state_dicts():
    config = {"data": {"class_names": ["a", "b"], "label_space": "contiguous"}}
    assert trained_class_names({"model": {}, "config": config}) == ["a", "b"]
    assert trained_class_names({"model": {}, "config": {"data": {"class_names": ["a"], "label_space": "category_id"}}}) == []
    assert trained_class_names({"model": {}, "config": {"data": {}}}) == []
    assert trained_class_names({"weight": object()}) == []


@pytest.mark.parametrize("stored", [
    [1, 2], "a string", None, {"data": "voc"}, {"data": ["a", "b"]}, {"data": None},
    {"data": {"class_names": "ab"}}, {"data": {"class_names": ["a"], "label_space": ["contiguous"]}},
    {"model": [1], "roi_heads": "x"}, {"model": {"anchors": None}}, {"model": {"anchors": {"sizes": 3}}},
])
def test_a_crafted_stored_config_reads_as_no_record(stored):
    """A checkpoint whose stored config has another shape than training writes (crafted, or
    damaged by hand) tells nothing: no class names and no settings, never a traceback."""
    data = {"model": {}, "config": stored}
    assert trained_class_names(data) == []
    settings = trained_settings(data)
    assert all(key in ("model.anchors.sizes",) for key in settings), settings  # only a stored value is kept


class KeptRecords(logging.Handler):
    """The messages of the records it handles."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: List[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_initial_weights_of_a_run_with_other_label_names_are_flagged(shapes, coco_run, tmp_path):
    # Fine-tuning from a run of this data set after its categories were renumbered: the box
    # predictor loads label by label, so circles would start from the rectangles' weights.
    weights = coco_run / "checkpoints" / "last.pth"
    train = json.loads((shapes / "train.json").read_text())
    renumber({1: 2, 2: 1, 3: 3})(train)
    renumbered = tmp_path / "train_renumbered.json"
    renumbered.write_text(json.dumps(train))
    warnings = {}
    for name, train_file in (("same", shapes / "train.json"), ("renumbered", renumbered)):
        cfg = load_config(TINY_CONFIG, [*coco_overrides(shapes, shapes / "val.json"), f"data.train.ann_file={train_file}",
                                        f"train.output_dir={tmp_path / name}", f"model.weights={weights}",
                                        "solver.max_iter=1"])
        log, kept = logging.getLogger("detector.engine.trainer"), KeptRecords()
        log.addHandler(kept)  # on the logger itself: the train tool's logging set-up may stop propagation
        try:
            build_trainer(cfg).close()
        finally:
            log.removeHandler(kept)
        warnings[name] = [m for m in kept.messages if "named the labels otherwise" in m]
    assert warnings["same"] == []
    assert warnings["renumbered"] == [
        f"model.weights {weights}: its run named the labels otherwise (the same classes in another order; label 1 was "
        "'circle', here 'rectangle'): the box predictor is loaded label by label, so those classes start from another "
        "class's weights"]


def test_resume_refuses_data_whose_labels_name_other_classes(shapes, coco_run, tmp_path, capsys):
    # The training file's categories renumbered since the run started: resumed, the circles
    # would go on training as label 2, which the checkpoint's predictor learnt as rectangles.
    run = tmp_path / "run"
    shutil.copytree(coco_run, run)
    train = json.loads((shapes / "train.json").read_text())
    renumber({1: 2, 2: 1, 3: 3})(train)
    renumbered = tmp_path / "train_renumbered.json"
    renumbered.write_text(json.dumps(train))
    argv = ["--config", str(TINY_CONFIG), *coco_overrides(shapes, shapes / "val.json"), f"data.train.ann_file={renumbered}",
            f"train.output_dir={run}", "solver.max_iter=3", "--resume"]
    assert load_tool("train").main(argv) == 1
    last = run / "checkpoints" / "last.pth"
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert errors == [f"error: --resume: {last}: label 1 is 'circle' in the run that wrote it but 'rectangle' in this "
                      "run's data (data.class_names): resumed, each such label would train on another class; restore "
                      "the data's categories, or start a new run from its weights (--weights)"]
    # The same data resumes.
    argv[argv.index(f"data.train.ann_file={renumbered}")] = f"data.train.ann_file={shapes / 'train.json'}"
    assert load_tool("train").main(argv) == 0
