"""data.label_space: contiguous labels 1..K (default) or label = COCO category_id, as
torchvision's COCO weights predict (K = the largest id in use, unused id slots neither
trained nor evaluated)."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch

from conftest import TINY_CONFIG, load_tool
from detector.config import ConfigError, load_config
from detector.data import CocoDetection, DataError, build_dataset, class_names_for, resolve_num_classes
from detector.data.check import check_dataset
from detector.evaluation import evaluate
from detector.evaluation.inference import detections_of_image
from detector.evaluation.results import Detections
from detector.evaluation import score_detections
from detector.modeling import build_model
from detector.modeling.weights import load_weights
from cases import CAT_IDS, make_coco_case, pycocotools_stats
from test_datasets import make_coco

GAPPED = [{"id": 7, "name": "train"}, {"id": 1, "name": "person"}, {"id": 3, "name": "car"}]
GAPPED_ANNS = [
    {"id": 1, "image_id": 10, "category_id": 7, "bbox": [2, 3, 10, 5], "area": 50, "iscrowd": 0},
    {"id": 2, "image_id": 10, "category_id": 3, "bbox": [20, 4, 8, 12], "area": 96, "iscrowd": 0},
    {"id": 3, "image_id": 11, "category_id": 1, "bbox": [5, 6, 20, 30], "area": 600, "iscrowd": 0},
    {"id": 4, "image_id": 12, "category_id": 7, "bbox": [1, 1, 20, 20], "area": 400, "iscrowd": 0},
]


def gapped(tmp_path, categories=GAPPED):
    """(image folder, instances JSON) with categories 1, 3, 7 (person, car, train)."""
    return make_coco(tmp_path, annotations=GAPPED_ANNS, categories=categories)


def coco_cfg(tmp_path, *extra: str):
    img_dir, ann_file = gapped(tmp_path)
    files = [f"data.{s}.{k}={v}" for s in ("train", "val") for k, v in (("root", img_dir), ("ann_file", ann_file))]
    return load_config(TINY_CONFIG, ["data.format=coco", *files, *extra])


def test_gapped_ids_both_ways(tmp_path):
    contiguous = CocoDetection(*gapped(tmp_path))
    assert contiguous.label_to_category_id == {1: 1, 2: 3, 3: 7}
    assert contiguous.class_names == ["person", "car", "train"]
    ds = CocoDetection(*gapped(tmp_path), label_space="category_id")
    assert ds.label_to_category_id == {1: 1, 3: 3, 7: 7}
    assert ds.class_names == ["person", "unused_2", "car", "unused_4", "unused_5", "unused_6", "train"]
    assert ds.num_classes == 7
    assert ds.get_annotation(0)["labels"].tolist() == [7, 3] and ds[1][1]["labels"].tolist() == [1]
    # Same boxes, both ways; the ground truth lists the 3 categories only.
    assert ds.coco_gt() == contiguous.coco_gt()
    assert [c["id"] for c in ds.coco_gt()["categories"]] == [1, 3, 7]


def test_class_names_subset_keeps_ids_as_labels(tmp_path):
    ds = CocoDetection(*gapped(tmp_path), class_names=["car", "person"], label_space="category_id")
    assert ds.label_to_category_id == {1: 1, 3: 3}
    assert ds.class_names == ["person", "unused_2", "car"]
    assert ds.get_annotation(0)["labels"].tolist() == [3]  # the train box is dropped, as with contiguous
    assert CocoDetection(*gapped(tmp_path), class_names=["car", "person"]).label_to_category_id == {1: 3, 2: 1}


def test_auto_num_classes_is_the_largest_id(tmp_path):
    cfg = coco_cfg(tmp_path, "data.label_space=category_id", "model.num_classes=auto")
    assert resolve_num_classes(cfg).model.num_classes == 7  # from the JSON
    assert resolve_num_classes(cfg, build_dataset(cfg, "train", is_train=True)).model.num_classes == 7
    sub = coco_cfg(tmp_path, "data.label_space=category_id", "model.num_classes=auto", "data.class_names=[person,car]")
    assert resolve_num_classes(sub).model.num_classes == 3
    assert resolve_num_classes(coco_cfg(tmp_path, "model.num_classes=auto")).model.num_classes == 3  # contiguous
    assert resolve_num_classes(coco_cfg(tmp_path, "data.label_space=category_id", "model.num_classes=90")).model.num_classes == 90
    with pytest.raises(ConfigError, match=r"^config key 'model.num_classes' is 5 but the data's labels go up to 7 .*>= 7$"):
        resolve_num_classes(coco_cfg(tmp_path, "data.label_space=category_id", "model.num_classes=5"))


def test_infer_tool_names_labels_by_category_id(tmp_path):
    names = class_names_for  # what tools/infer.py names the labels by (detector.evaluation.infer_command)
    sub = coco_cfg(tmp_path, "data.label_space=category_id", "data.class_names=[car,person]")
    assert names(sub) == ["person", "unused_2", "car"]
    assert names(coco_cfg(tmp_path, "data.class_names=[car,person]")) == ["car", "person"]
    assert names(coco_cfg(tmp_path, "data.label_space=category_id"))[6] == "train"


@pytest.mark.parametrize("bad", [0, -3, 2.5])
def test_bad_category_ids_refused(tmp_path, bad):
    categories = [*GAPPED, {"id": bad, "name": "odd"}]
    with pytest.raises(DataError) as info:
        CocoDetection(*gapped(tmp_path, categories), label_space="category_id")
    msg = str(info.value)
    if isinstance(bad, float):  # not an integer: the schema refuses it in any label space
        assert "\n" not in msg and "instances.json: categories[3].id: expected an integer, got 2.5" in msg
        with pytest.raises(DataError, match=r"categories\[3\]\.id: expected an integer, got 2\.5"):
            CocoDetection(*gapped(tmp_path, categories))
        return
    assert "\n" not in msg and "instances.json" in msg and "'odd'" in msg and "data.label_space=category_id" in msg
    assert CocoDetection(*gapped(tmp_path, categories)).num_classes == 4  # contiguous takes any integer id


def test_sparse_category_ids_are_refused_before_any_label_is_made(tmp_path):
    """With label = category id, a sparse id space (taxonomy or database ids) makes a
    predictor of mostly unused labels; ids near 2**40 had the process killed for memory
    while it listed the labels. Refused in one line beyond both bounds, up to them kept."""
    def with_train_id(new_id):
        categories = [c if c["id"] != 7 else {"id": new_id, "name": "train"} for c in GAPPED]
        anns = [dict(a, category_id=new_id) if a["category_id"] == 7 else a for a in GAPPED_ANNS]
        return make_coco(tmp_path / str(new_id), annotations=anns, categories=categories)

    assert CocoDetection(*with_train_id(1000), label_space="category_id").num_classes == 1000  # at the bound
    for new_id in (1001, 2**40):
        img_dir, ann_file = with_train_id(new_id)
        with pytest.raises(DataError) as info:
            CocoDetection(img_dir, ann_file, label_space="category_id")
        assert str(info.value) == (
            f"annotation file {ann_file}: data.label_space=category_id makes one label per id up to the largest, "
            f"{new_id}, for 3 categories in use (a predictor of {new_id + 1} classes, mostly unused); use "
            "data.label_space=contiguous (labels 1..3; results files keep the category ids)")
        assert CocoDetection(img_dir, ann_file).label_to_category_id == {1: 1, 2: 3, 3: new_id}
        cfg = load_config(TINY_CONFIG, ["data.format=coco", f"data.train.root={img_dir}",
                                        f"data.train.ann_file={ann_file}", "data.label_space=category_id",
                                        "model.num_classes=auto"])
        with pytest.raises(DataError, match="makes one label per id up to the largest"):
            resolve_num_classes(cfg)  # from the JSON alone, as the tools do


def test_check_dataset_reads_labels_as_training_does(tmp_path):
    report = check_dataset(coco_cfg(tmp_path, "data.label_space=category_id"), "train", decode=False)
    assert not report.errors and report.per_class == {"person": 1, "car": 1, "train": 2}
    cfg = coco_cfg(tmp_path / "bad", "data.label_space=category_id")
    json_file = cfg.data.train.ann_file
    content = json.loads(open(json_file).read())
    content["categories"].append({"id": 0, "name": "odd"})
    open(json_file, "w").write(json.dumps(content))
    errors = check_dataset(cfg, "train", decode=False).errors
    assert len(errors) == 1 and "category 'odd' has id 0" in errors[0]


def test_config_refuses_unknown_value_and_voc():
    with pytest.raises(ConfigError, match=r"^config key 'data.label_space' is 'ids'; expected one of contiguous, category_id$"):
        load_config(TINY_CONFIG, ["data.label_space=ids"])
    with pytest.raises(ConfigError, match=r"^config key 'data.label_space' is 'category_id', which needs COCO-format data"):
        load_config(TINY_CONFIG, ["data.format=voc", "data.label_space=category_id"])


def test_scoring_through_category_id_labels_equals_pycocotools(tmp_path):
    """Detections as a category_id model gives them (labels = ids, some in unused slots)
    score exactly as pycocotools scores the original results; per-class rows and the
    confusion matrix hold the 5 categories only."""
    gt, dets = make_coco_case()
    ann_file = tmp_path / "gt.json"
    ann_file.write_text(json.dumps(gt))
    ds = CocoDetection(tmp_path, ann_file, label_space="category_id")
    assert ds.num_classes == max(CAT_IDS) and list(ds.label_to_category_id) == list(CAT_IDS)
    rows = []
    for image_id in ds.image_ids:
        mine = [d for d in dets if d["image_id"] == image_id]
        boxes = torch.tensor([[x, y, x + w, y + h] for x, y, w, h in (d["bbox"] for d in mine)], dtype=torch.float64)
        labels = torch.tensor([d["category_id"] for d in mine], dtype=torch.int64)  # label = category id
        scores = torch.tensor([d["score"] for d in mine], dtype=torch.float64)
        unused = torch.tensor([2, 5, 11]), torch.tensor([[1.0, 1.0, 9.0, 9.0]] * 3), torch.tensor([0.99, 0.5, 0.7])
        rows.append(detections_of_image(image_id, torch.cat([boxes.reshape(-1, 4), unused[1].double()]),
                                        torch.cat([scores, unused[2].double()]), torch.cat([labels, unused[0]]),
                                        ds.label_to_category_id, skip_unmapped=True))
    report = score_detections(ds.coco_gt(), Detections.concatenate(rows))
    names = [report.metrics[k] for k in ("AP", "AP50", "AP75", "APs", "APm", "APl",
                                          "AR1", "AR10", "AR100", "ARs", "ARm", "ARl")]
    expected = pycocotools_stats(ds.coco_gt(), copy.deepcopy(dets))
    assert np.array_equal(np.asarray(names), expected)
    assert np.allclose(expected, pycocotools_stats(gt, dets), atol=1e-12)  # the dataset's gt is the file's
    assert [r["category_id"] for r in report.per_class] == list(CAT_IDS)
    assert report.class_names == [f"class_{c}" for c in CAT_IDS] and report.confusion.shape == (6, 6)
    with pytest.raises(ValueError, match="model predicted label 2"):
        detections_of_image(1, unused[1], unused[2], unused[0], ds.label_to_category_id)


def test_evaluate_leaves_unused_slots_out(tmp_path):
    """A tiny random model with 7 classes predicts labels in the unused slots 2, 4-6 too:
    evaluate() scores the 3 categories only (per_class.csv, metrics)."""
    cfg = coco_cfg(tmp_path, "data.label_space=category_id", "model.num_classes=auto", "roi_heads.score_thresh=0.0")
    ds = build_dataset(cfg, "val", is_train=False)
    cfg = resolve_num_classes(cfg, ds, split="val")
    torch.manual_seed(0)
    model = build_model(cfg)
    metrics = evaluate(model, ds, cfg, output_dir=tmp_path / "eval")
    assert 0.0 <= metrics["AP"] <= 1.0
    lines = (tmp_path / "eval" / "per_class.csv").read_text().splitlines()
    assert [line.split(",")[:2] for line in lines[1:]] == [["1", "person"], ["3", "car"], ["7", "train"]]
    found = {d["category_id"] for d in json.loads((tmp_path / "eval" / "detections.json").read_text())}
    assert found and found <= {1, 3, 7}


@pytest.mark.realdata
def test_coco16_category_ids_and_torchvision_state_dict(real_data, repo_root):
    """configs/torchvision_r50_fpn_coco.yaml on the 16 real COCO images: labels are the
    category ids, auto gives 90, and torchvision's fasterrcnn_resnet50_fpn state dict
    (no weights downloaded) loads strictly."""
    from torchvision.models.detection import fasterrcnn_resnet50_fpn

    root = real_data / "coco2017_16"
    data = [f"data.{s}.{k}={v}" for s in ("train", "val")
            for k, v in (("root", root / "images"), ("ann_file", root / "instances.json"))]
    cfg = load_config(repo_root / "configs" / "torchvision_r50_fpn_coco.yaml", [*data, "model.num_classes=auto"])
    ds = CocoDetection(root / "images", root / "instances.json", label_space=cfg.data.label_space)
    raw = json.loads((root / "instances.json").read_text())
    names = {c["id"]: c["name"] for c in raw["categories"]}
    assert ds.label_to_category_id == {c: c for c in sorted(names)} and ds.num_classes == 90
    assert [n for n in ds.class_names if n.startswith("unused_")] == [f"unused_{i}" for i in range(1, 91) if i not in names]
    first = ds.get_annotation(0)
    assert sorted(first["labels"].tolist()) == sorted(a["category_id"] for a in raw["annotations"]
                                                      if a["image_id"] == first["image_id"])
    cfg = resolve_num_classes(cfg)
    assert cfg.model.num_classes == 90
    model = build_model(cfg)
    assert model.roi_heads.box_predictor.cls_score.out_features == 91
    reference = fasterrcnn_resnet50_fpn(weights=None, weights_backbone=None).state_dict()
    report = load_weights(model, reference, strict=True)
    assert not report.missing and not report.unexpected and not report.skipped
    assert torch.equal(model.state_dict()["roi_heads.box_predictor.cls_score.weight"],
                       reference["roi_heads.box_predictor.cls_score.weight"])


@pytest.mark.slow  # ~25 s: ResNet-50 on 16 images, 80-class PR curves
@pytest.mark.realdata
def test_eval_tool_with_torchvision_state_dict_on_coco16(real_data, repo_root, tmp_path):
    """The user's command: tools/eval.py, the torchvision config (category_id labels,
    91 outputs) and a torchvision fasterrcnn_resnet50_fpn state dict file, on the 16
    real COCO images (at 128 px): per_class.csv lists the 80 COCO categories only, and
    detections.json holds COCO category ids only."""
    from torchvision.models.detection import fasterrcnn_resnet50_fpn

    torch.manual_seed(0)
    weights = tmp_path / "tv.pth"
    torch.save(fasterrcnn_resnet50_fpn(weights=None, weights_backbone=None).state_dict(), weights)
    root = real_data / "coco2017_16"
    out = tmp_path / "eval"
    rc = load_tool("eval").main([
        "--config", str(repo_root / "configs" / "torchvision_r50_fpn_coco.yaml"), "--weights", str(weights),
        "--output-dir", str(out), f"data.val.root={root / 'images'}", f"data.val.ann_file={root / 'instances.json'}",
        "input.min_size_test=128", "input.max_size_test=192", "roi_heads.score_thresh=0.0", "train.device=cpu",
        "data.num_workers=0", "eval.images_per_gpu=4",
    ])
    assert rc == 0
    ids = sorted(c["id"] for c in json.loads((root / "instances.json").read_text())["categories"])
    rows = (out / "per_class.csv").read_text().splitlines()[1:]
    assert [int(r.split(",")[0]) for r in rows] == ids
    found = {d["category_id"] for d in json.loads((out / "detections.json").read_text())}
    assert found and found <= set(ids)
