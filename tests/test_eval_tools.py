"""tools/eval.py (file mode), tools/infer.py, result files and plots."""

from __future__ import annotations

import csv
import copy
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from detector.evaluation import COCO_METRIC_NAMES
from detector.evaluation.plots import plot_confusion_matrix, plot_pr_curves
from conftest import TINY_CONFIG, load_tool, tiny_overrides
from cases import make_coco_case, pycocotools_stats

from conftest import ROOT  # noqa: E402


def printed_numbers(text):
    """The 12 COCO numbers from the printed table."""
    values = {}
    for line in text.splitlines():
        parts = line.split()
        if parts and parts[0] in COCO_METRIC_NAMES and len(parts) > 2:
            values[parts[0]] = float(parts[-1])
    return np.array([values[k] for k in COCO_METRIC_NAMES])


def assert_png_not_blank(path):
    assert path.is_file() and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with Image.open(path) as img:
        img.verify()
    with Image.open(path) as img:
        pixels = np.asarray(img.convert("RGB"), dtype=np.float64)
    assert pixels.shape[0] > 100 and pixels.shape[1] > 100
    assert pixels.std() > 5.0  # not a flat image
    assert len(np.unique(pixels.reshape(-1, 3), axis=0)) > 20  # more than a few colours


@pytest.fixture(scope="module")
def case_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("case")
    gt, dets = make_coco_case()
    (d / "gt.json").write_text(json.dumps(gt))
    (d / "dets.json").write_text(json.dumps(dets))
    return d, gt, dets


@pytest.mark.parametrize("backend", ["pycocotools", "faster"])
def test_file_mode_matches_pycocotools(case_files, tmp_path, capsys, backend):
    d, gt, dets = case_files
    out = tmp_path / "out"
    rc = load_tool("eval").main(
        ["--predictions", str(d / "dets.json"), "--annotations", str(d / "gt.json"), "--output-dir", str(out),
         f"eval.backend={backend}"]
    )
    assert rc == 0
    text = capsys.readouterr().out
    ref = pycocotools_stats(gt, dets)
    # The table prints 10 decimals; metrics.json holds the full floats.
    np.testing.assert_allclose(printed_numbers(text), ref, atol=1e-9)
    metrics = json.loads((out / "metrics.json").read_text())
    np.testing.assert_allclose([metrics[k] for k in COCO_METRIC_NAMES], ref, rtol=0, atol=1e-9)
    for key in ("mAP_voc07", "mAP_voc_area", "mean_iou", "precision_50", "recall_75", "count_mae"):
        assert key in metrics
    assert json.loads((out / "detections.json").read_text()) == dets
    with (out / "per_class.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [int(r["category_id"]) for r in rows] == [c["id"] for c in gt["categories"]]
    assert_png_not_blank(out / "pr_curves.png")
    assert_png_not_blank(out / "confusion_matrix.png")


@pytest.mark.slow
def test_file_mode_errors_exit_nonzero_with_one_line(case_files, tmp_path):
    d, gt, dets = case_files
    bad = dets + [{"image_id": 4242, "category_id": 1, "bbox": [1, 1, 5, 5], "score": 0.3}]
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "eval.py"), "--predictions", str(tmp_path / "bad.json"),
         "--annotations", str(d / "gt.json")],
        capture_output=True, text=True, cwd=ROOT,
    )
    assert proc.returncode != 0
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and "image_id 4242" in err[0], proc.stderr
    tool = load_tool("eval")
    assert tool.main(["--predictions", str(tmp_path / "missing.json"), "--annotations", str(d / "gt.json")]) == 1
    with pytest.raises(SystemExit):  # argparse: needs exactly one ground truth
        tool.main(["--predictions", str(d / "dets.json")])


def test_predictions_as_coco_dict_are_matched_by_name(case_files, tmp_path, capsys):
    """A COCO-format dict with its own ids maps onto the ground truth by file and class name."""
    d, gt, dets = case_files
    img_ids = {img["id"]: k for k, img in enumerate(gt["images"])}
    cat_ids = {c["id"]: 50 + k for k, c in enumerate(gt["categories"])}
    other = {
        "images": [{"id": img_ids[i["id"]], "file_name": i["file_name"]} for i in gt["images"]],
        "categories": [{"id": cat_ids[c["id"]], "name": c["name"]} for c in gt["categories"]],
        "annotations": [dict(r, image_id=img_ids[r["image_id"]], category_id=cat_ids[r["category_id"]]) for r in dets],
    }
    (tmp_path / "dict.json").write_text(json.dumps(other))
    assert load_tool("eval").main(["--predictions", str(tmp_path / "dict.json"), "--annotations", str(d / "gt.json")]) == 0
    np.testing.assert_allclose(printed_numbers(capsys.readouterr().out), pycocotools_stats(gt, dets), atol=1e-9)


def test_plots_are_valid_pngs(tmp_path):
    rng = np.random.default_rng(0)
    curves = {f"c{i}": (np.sort(rng.random(20)), rng.random(20), 0.5) for i in range(4)}
    assert_png_not_blank(plot_pr_curves(curves, tmp_path / "pr.png"))
    matrix = rng.integers(0, 10, size=(5, 5))
    assert_png_not_blank(plot_confusion_matrix(matrix, ["a", "b", "c", "d"], tmp_path / "cm.png"))
    with pytest.raises(ValueError, match="does not fit 3 classes"):
        plot_confusion_matrix(matrix, ["a", "b", "c"], tmp_path / "bad.png")


def test_infer_writes_one_annotated_image_per_input(tmp_path):
    from detector.config import load_config
    from detector.modeling import build_model

    cfg_args = ["roi_heads.score_thresh=0.01", "input.min_size_test=96", "input.max_size_test=128"]
    torch.manual_seed(0)
    model = build_model(load_config(TINY_CONFIG, cfg_args))
    torch.save(model.state_dict(), tmp_path / "w.pth")
    inputs = tmp_path / "in"
    inputs.mkdir()
    rng = np.random.default_rng(0)
    sizes = [(90, 120), (140, 100)]
    for i, (h, w) in enumerate(sizes):
        Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(inputs / f"im{i}.jpg")
    (inputs / "notes.txt").write_text("not an image")
    out = tmp_path / "out"
    rc = load_tool("infer").main(
        ["--config", str(TINY_CONFIG), "--weights", str(tmp_path / "w.pth"),
         "--input", str(inputs), "--output-dir", str(out), "--score-thresh", "0.0", *cfg_args]
    )
    assert rc == 0
    pngs = sorted(out.glob("*.png"))
    assert [p.name for p in pngs] == ["im0.png", "im1.png"]
    records = json.loads((out / "detections.json").read_text())
    assert len(records) == 2
    for (h, w), png, rec in zip(sizes, pngs, records):
        drawn = np.asarray(Image.open(png).convert("RGB"))
        s = drawn.shape[1] // w  # small images are scaled up by an integer factor, a legend band below
        assert s >= 2 and drawn.shape[1] == w * s and drawn.shape[0] > h * s
        original = np.asarray(Image.open(inputs / Path(rec["file"]).name).convert("RGB"))
        scaled = original.repeat(s, axis=0).repeat(s, axis=1)
        assert len(rec["boxes"]) > 0 and (drawn[: h * s] != scaled).any()  # boxes were drawn
        boxes = np.array(rec["boxes"])
        assert (boxes[:, 2] <= w + 1e-3).all() and (boxes[:, 3] <= h + 1e-3).all() and (boxes >= 0).all()
    rc = load_tool("infer").main(
        ["--config", str(TINY_CONFIG), "--weights", str(tmp_path / "w.pth"),
         "--input", str(tmp_path / "nothing"), "--output-dir", str(out)]
    )
    assert rc == 1


@pytest.mark.parametrize("value", ["2", "-0.1", "nan", "inf"])
def test_infer_score_thresh_outside_0_1_is_a_usage_error(value, capsys):
    tool = load_tool("infer")
    with pytest.raises(SystemExit) as exit_:
        tool.parse_args(["--config", "c.yaml", "--weights", "w.pth", "--input", "x", "--output-dir", "o",
                         "--score-thresh", value])
    assert exit_.value.code == 2
    assert f"error: --score-thresh must be in [0, 1], got {float(value)}" in capsys.readouterr().err
    assert tool.parse_args(["--config", "c", "--weights", "w", "--input", "x", "--output-dir", "o",
                            "--score-thresh", "1"]).score_thresh == 1.0


def test_infer_reads_exif_orientation_as_the_data_sets_do(tmp_path, caplog):
    """A JPEG stored 60x100 with EXIF orientation 6 (viewers turn it a quarter): with
    data.apply_exif=true, tools/infer.py reads it turned, as training and evaluation do
    (detector.data.files.decode_image): the record has the displayed size 100x60 and the
    boxes of the same pixels saved turned, without a tag; with the default (false) it
    is read as stored, with the data sets' warning naming the file."""
    from PIL import ImageOps

    from detector.config import load_config
    from detector.modeling import build_model

    cfg_args = ["roi_heads.score_thresh=0.01", "input.min_size_test=96", "input.max_size_test=128"]
    torch.manual_seed(0)
    torch.save(build_model(load_config(TINY_CONFIG, cfg_args)).state_dict(), tmp_path / "w.pth")
    (tmp_path / "tagged").mkdir()
    (tmp_path / "plain").mkdir()
    stored = Image.fromarray(np.random.default_rng(0).integers(0, 255, (60, 100, 3), dtype=np.uint8))
    exif = Image.Exif()
    exif[0x0112] = 6
    stored.save(tmp_path / "tagged" / "photo.jpg", exif=exif)
    with Image.open(tmp_path / "tagged" / "photo.jpg") as img:
        ImageOps.exif_transpose(img).save(tmp_path / "plain" / "photo.png")

    def infer(folder, *extra):
        out = tmp_path / f"out_{folder}_{len(extra)}"
        rc = load_tool("infer").main(["--config", str(TINY_CONFIG), "--weights", str(tmp_path / "w.pth"),
                                      "--input", str(tmp_path / folder), "--output-dir", str(out),
                                      "--score-thresh", "0.0", *cfg_args, *extra])
        assert rc == 0
        return json.loads((out / "detections.json").read_text())[0]

    turned, plain = infer("tagged", "data.apply_exif=true"), infer("plain")
    assert (turned["height"], turned["width"]) == (plain["height"], plain["width"]) == (100, 60)
    assert len(plain["boxes"]) > 0 and turned["boxes"] == plain["boxes"] and turned["scores"] == plain["scores"]
    assert not [r for r in caplog.records if "EXIF" in r.getMessage()]
    as_stored = infer("tagged")
    assert (as_stored["height"], as_stored["width"]) == (60, 100)
    assert [r.getMessage() for r in caplog.records if "EXIF orientation 6" in r.getMessage()
            and "photo.jpg" in r.getMessage() and r.levelname == "WARNING"]


# --------------------------------------------------------------------------- model-based parts


def test_boxes_back_to_original_size_and_clipped():
    from detector.evaluation.inference import detections_of_image, to_original_boxes

    target = {"scale": torch.tensor([0.5, 0.25]), "orig_size": torch.tensor([100, 200])}  # h=100, w=200
    boxes = torch.tensor([[10.0, 10.0, 50.0, 30.0], [-2.0, 5.0, 120.0, 20.0]])
    out = to_original_boxes(boxes, target)
    expected = torch.tensor([[20.0, 40.0, 100.0, 100.0], [0.0, 20.0, 200.0, 80.0]])
    torch.testing.assert_close(out, expected)
    dets = detections_of_image(7, out, torch.tensor([0.9, 0.4]), torch.tensor([2, 1]), {1: 11, 2: 22})
    assert dets.image_id.tolist() == [7, 7] and dets.category_id.tolist() == [22, 11]
    assert dets.bbox[0].tolist() == [20.0, 40.0, 80.0, 60.0]  # x, y, w, h
    with pytest.raises(ValueError, match="predicted label 3"):
        detections_of_image(7, out, torch.tensor([0.9, 0.4]), torch.tensor([3, 1]), {1: 11, 2: 22})
    with pytest.raises(ValueError, match=f"image_id {2**64} does not fit a 64-bit integer"):
        detections_of_image(2**64, out, torch.tensor([0.9, 0.4]), torch.tensor([2, 1]), {1: 11, 2: 22})


@pytest.fixture(scope="module")
def tiny_setup(tmp_path_factory):
    from detector.config import load_config
    from detector.data import build_dataset

    data = tmp_path_factory.mktemp("shapes") / "data"
    overrides = tiny_overrides(
        data, None, "data.shapes.num_train=1", "data.shapes.num_val=3", "data.shapes.max_side=112",
        "input.min_size_test=96", "input.max_size_test=128", "roi_heads.score_thresh=0.01", "eval.score_thresh=0.2",
    )
    cfg = load_config(TINY_CONFIG, overrides)
    return cfg, overrides, build_dataset(cfg, "val", is_train=False)


def test_evaluate_in_process(tiny_setup, tmp_path, capsys):
    from detector.evaluation import evaluate, score_detections
    from detector.modeling import build_model

    cfg, _, dataset = tiny_setup
    cfg.eval.compute_val_loss = True
    torch.manual_seed(0)
    model = build_model(cfg)
    model.train()
    metrics = evaluate(model, dataset, cfg, output_dir=tmp_path)
    assert model.training  # mode restored
    for key in (*COCO_METRIC_NAMES, "mAP_voc07", "mAP_voc_area", "mean_iou", "f1_50", "count_pearson"):
        assert key in metrics
    for key in ("val_loss_rpn_cls", "val_loss_rpn_box", "val_loss_roi_cls", "val_loss_roi_box"):
        assert np.isfinite(metrics[key]) and metrics[key] >= 0
    assert metrics["val_loss"] == pytest.approx(sum(metrics[f"val_{k}"] for k in
                                                    ("loss_rpn_cls", "loss_rpn_box", "loss_roi_cls", "loss_roi_box")))
    dets = json.loads((tmp_path / "detections.json").read_text())
    assert len(dets) > 0
    assert {d["category_id"] for d in dets} <= set(dataset.label_to_category_id.values())
    assert {d["image_id"] for d in dets} <= set(dataset.image_ids)
    # The returned numbers are those of the written detections against the ground truth.
    again = score_detections(dataset.coco_gt(), dets, score_thresh=cfg.eval.score_thresh).metrics
    for k in COCO_METRIC_NAMES:
        assert metrics[k] == again[k]
    for name in ("metrics.json", "per_class.csv", "pr_curves.png", "confusion_matrix.png"):
        assert (tmp_path / name).is_file()
    err = capsys.readouterr().err  # stderr is no terminal here: no progress-bar lines
    assert "eval:" not in err and "val loss:" not in err, err


def test_image_ids_above_2_53_stay_apart(tmp_path):
    """Image ids past float64's exact integers (2**53 and its odd and even neighbours):
    evaluate() files each detection under its own id, in detections.json and in the
    scores, exactly as with the ids 1..4 (ids once went through float64, merging each
    odd id into its even neighbour)."""
    from detector.config import load_config
    from detector.data import build_dataset
    from detector.evaluation import evaluate
    from detector.modeling import build_model

    data = tmp_path / "data"
    base = tiny_overrides(data, None, "data.shapes.num_train=1", "data.shapes.num_val=4", "data.shapes.max_side=112",
                          "input.min_size_test=96", "input.max_size_test=128", "roi_heads.score_thresh=0.01",
                          "eval.score_thresh=0.2")
    small_cfg = load_config(TINY_CONFIG, base)
    small = build_dataset(small_cfg, "val", is_train=False)
    gt = json.loads((data / "val.json").read_text())
    big_id = {img["id"]: 2**53 - 1 + img["id"] for img in gt["images"]}  # 2**53, 2**53 + 1, ... + 3
    for img in gt["images"]:
        img["id"] = big_id[img["id"]]
    for ann in gt["annotations"]:
        ann["image_id"] = big_id[ann["image_id"]]
    (tmp_path / "big.json").write_text(json.dumps(gt))
    big_cfg = load_config(TINY_CONFIG, base + ["data.format=coco", f"data.val.root={data / 'val'}",
                                              f"data.val.ann_file={tmp_path / 'big.json'}"])
    big = build_dataset(big_cfg, "val", is_train=False)
    assert big.image_ids == [big_id[i] for i in small.image_ids]
    torch.manual_seed(0)
    model = build_model(small_cfg)
    small_metrics = evaluate(model, small, small_cfg, output_dir=tmp_path / "small")
    big_metrics = evaluate(model, big, big_cfg, output_dir=tmp_path / "big")
    small_dets = json.loads((tmp_path / "small" / "detections.json").read_text())
    big_dets = json.loads((tmp_path / "big" / "detections.json").read_text())
    assert len({d["image_id"] for d in small_dets}) == 4
    assert big_dets == [dict(d, image_id=big_id[d["image_id"]]) for d in small_dets]
    assert all(type(d["image_id"]) is int for d in big_dets)
    for k in (*COCO_METRIC_NAMES, "mAP_voc07", "mAP_voc_area", "mean_iou", "count_pearson"):
        assert big_metrics[k] == small_metrics[k] or (np.isnan(big_metrics[k]) and np.isnan(small_metrics[k])), k


def test_val_loss_keeps_norm_layers_and_rng(tiny_setup):
    from detector.config import load_config
    from detector.data import build_test_loader
    from detector.evaluation.inference import compute_val_loss
    from detector.modeling import build_model

    _, overrides, dataset = tiny_setup
    cfg = load_config(TINY_CONFIG, [*overrides, "model.norm=bn"])
    torch.manual_seed(0)
    model = build_model(cfg)
    model.eval()
    norms = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    assert norms, "the bn model should have BatchNorm layers"
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    out = compute_val_loss(model, build_test_loader(cfg, dataset), progress=False)
    assert out["count"] == len(dataset)
    assert all(np.isfinite(v) and v >= 0 for v in out["sum"].values())
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # running stats untouched
    assert not model.training and not any(m.training for m in model.modules())
    assert torch.equal(rng, torch.get_rng_state())


@pytest.mark.gpu
def test_evaluate_on_cuda_with_amp(tiny_setup, tmp_path):
    from detector.evaluation import evaluate
    from detector.modeling import build_model

    cfg, _, dataset = tiny_setup
    cfg.eval.amp = True
    cfg.train.amp.dtype = "bfloat16"
    torch.manual_seed(0)
    model = build_model(cfg).to("cuda")
    metrics = evaluate(model, dataset, cfg, output_dir=tmp_path)
    assert all(k in metrics for k in COCO_METRIC_NAMES)
    written = json.loads((tmp_path / "metrics.json").read_text())
    assert written["num_images"] == len(dataset) and written["time_per_image_ms"] > 0
    assert next(model.parameters()).device.type == "cuda"


def test_prediction_file_errors_are_named(case_files, tmp_path):
    from detector.evaluation import load_ground_truth, load_predictions

    d, gt, _ = case_files
    bad = {"images": [{"id": 0, "file_name": "nowhere.jpg"}], "annotations": []}
    (tmp_path / "p.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match=r"images\[0\] \(file_name 'nowhere.jpg'\) is not in the ground truth"):
        load_predictions(tmp_path / "p.json", gt)
    no_score = {"annotations": [{"image_id": 100, "category_id": 1, "bbox": [0, 0, 1, 1]}]}
    (tmp_path / "q.json").write_text(json.dumps(no_score))
    with pytest.raises(ValueError, match=r"annotations\[0\] has no 'score'"):
        load_predictions(tmp_path / "q.json", gt)
    (tmp_path / "r.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"r\.json is not valid JSON: .* line 1 column 2"):
        load_ground_truth(tmp_path / "r.json")
    (tmp_path / "s.json").write_text(json.dumps({"images": [], "annotations": []}))
    with pytest.raises(ValueError, match="s.json: missing the 'categories' section"):
        load_ground_truth(tmp_path / "s.json")


def test_empty_detections_through_every_metric(case_files, tmp_path):
    from detector.evaluation import OUTPUT_FILES, score_detections, write_outputs

    _, gt, _ = case_files
    report = score_detections(gt, [], backend="faster")
    m = report.metrics
    assert all(m[k] == 0.0 for k in COCO_METRIC_NAMES)
    assert m["mAP_voc07"] == 0.0 and m["mAP_voc_area"] == 0.0
    assert m["precision_50"] == 0.0 and m["recall_50"] == 0.0 and m["mean_iou"] == 0.0
    assert report.confusion[1:, 0].sum() == sum(1 for a in gt["annotations"] if not a["iscrowd"])  # all missed
    paths = write_outputs(report, [], tmp_path / "out")
    assert json.loads((tmp_path / "out" / "detections.json").read_text()) == []
    assert_png_not_blank(tmp_path / "out" / "pr_curves.png")
    # What tools/eval.py's overwrite check names is what is written (and nothing else is left).
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(OUTPUT_FILES)
    assert sorted(Path(p).name for p in paths.values()) == sorted(OUTPUT_FILES)


def test_a_val_set_without_boxes_is_said_once(tiny_setup, tmp_path):
    """Every COCO metric is -1 (pycocotools: no ground truth) for a val set whose images hold
    no box, or only crowd ones: one warning says so, rather than a table of -1 alone (also
    for ``tools/eval.py --predictions``: ``score_detections`` says it)."""
    import logging

    from detector.config import load_config
    from detector.data import build_dataset
    from detector.evaluation import evaluate
    from detector.modeling import build_model

    cfg, overrides, dataset = tiny_setup
    root = Path(dataset.image_dir).parent
    data = json.loads((root / "val.json").read_text())
    model = build_model(cfg)
    log = logging.getLogger("detector.evaluation.report")
    for name, keep in (("boxes", lambda a: True), ("crowd", lambda a: a.update(iscrowd=1) or True),
                       ("none", lambda a: False)):
        variant = {**data, "annotations": [a for a in json.loads(json.dumps(data["annotations"])) if keep(a)]}
        ann_file = tmp_path / f"{name}.json"
        ann_file.write_text(json.dumps(variant))
        val_cfg = load_config(TINY_CONFIG, [*overrides, "data.format=coco", f"data.val.root={root / 'val'}",
                                            f"data.val.ann_file={ann_file}"])
        seen: list = []
        handler = logging.Handler(logging.WARNING)
        handler.emit = lambda record: seen.append(record.getMessage())
        log.addHandler(handler)
        try:
            metrics = evaluate(model, build_dataset(val_cfg, "val", is_train=False), val_cfg)
        finally:
            log.removeHandler(handler)
        no_gt = [m for m in seen if "holds no box to score" in m]
        if name == "boxes":
            assert no_gt == [] and metrics["AR100"] >= 0
        else:
            assert no_gt == [f"{ann_file} holds no box to score (none, or crowd ones only): every COCO metric and the "
                             "VOC mAPs are -1 (no ground truth)"], name
            assert metrics["AP"] == metrics["mAP_voc07"] == metrics["mAP_voc_area"] == -1  # the VOC ones were 0.0


def _dict_form(gt, dets, file_names=None):
    """``dets`` as a COCO-format dict with its own image and category ids (reversed),
    mapped back by file name and category name."""
    n = len(gt["images"])
    own_image = {img["id"]: n - k for k, img in enumerate(gt["images"])}
    own_cat = {c["id"]: 100 + k for k, c in enumerate(gt["categories"])}
    names = file_names or {img["id"]: img["file_name"] for img in gt["images"]}
    return {"images": [{"id": own_image[img["id"]], "file_name": names[img["id"]]} for img in gt["images"]],
            "categories": [{"id": own_cat[c["id"]], "name": c["name"]} for c in gt["categories"]],
            "annotations": [dict(d, image_id=own_image[d["image_id"]], category_id=own_cat[d["category_id"]])
                            for d in dets]}


def test_dict_form_predictions_map_every_entry_or_none(case_files, tmp_path):
    """A dict-form results file maps its own ids by file name and category name. One entry
    without a name turned the mapping off: the file's own ids were taken as the ground
    truth's, silently (AP 0)."""
    from detector.evaluation import coco_evaluate, load_predictions

    d, gt, dets = case_files
    full = _dict_form(gt, dets)
    (tmp_path / "ok.json").write_text(json.dumps(full))
    mapped = load_predictions(tmp_path / "ok.json", gt)
    assert coco_evaluate(gt, mapped).metrics["AP"] == pytest.approx(coco_evaluate(gt, dets).metrics["AP"], abs=1e-12)
    cases = {
        "no_file_name": (lambda p: p["images"][3].pop("file_name"),
                         r"images\[3\] has no 'file_name' \(images\[0\] has one"),
        "no_name": (lambda p: p["categories"][1].pop("name"), r"categories\[1\] has no 'name'"),
        "int_file_name": (lambda p: p["images"][0].update(file_name=7), r"images\[0\]: 'file_name' must be a string, got 7"),
        "list_image_id": (lambda p: p["annotations"][0].update(image_id=[1]),
                          r"annotations\[0\] has image_id \[1\], not an id of its 'images'"),
        "str_id": (lambda p: p["categories"][0].update(id="a"), r"categories\[0\]: 'id' must be an integer, got \"a\""),
    }
    for name, (edit, expected) in cases.items():
        bad = json.loads(json.dumps(full))
        edit(bad)
        (tmp_path / f"{name}.json").write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=expected):
            load_predictions(tmp_path / f"{name}.json", gt)


def test_dict_form_file_names_match_whole_paths_not_only_base_names(case_files, tmp_path):
    """Ground truth a/x.jpg and b/x.jpg: matching by base name gave both images one id
    (their detections mixed, AP 0.73 for perfect boxes). Whole names match; an
    ambiguous base name is refused; a unique base name still matches."""
    from detector.evaluation import coco_evaluate, load_predictions

    d, gt, dets = case_files
    gt = json.loads(json.dumps(gt))
    for k, img in enumerate(gt["images"]):
        img["file_name"] = f"{'ab'[k % 2]}/{k // 2:04d}.jpg"  # a/0000.jpg, b/0000.jpg, ...
    (tmp_path / "p.json").write_text(json.dumps(_dict_form(gt, dets)))
    mapped = load_predictions(tmp_path / "p.json", gt)
    assert coco_evaluate(gt, mapped).metrics["AP"] == pytest.approx(coco_evaluate(gt, dets).metrics["AP"], abs=1e-12)
    base = {img["id"]: img["file_name"].split("/")[1] for img in gt["images"]}
    (tmp_path / "q.json").write_text(json.dumps(_dict_form(gt, dets, base)))
    with pytest.raises(ValueError, match=r"images\[0\]: file name '0000.jpg' matches 2 ground-truth images by its "
                                         r"base name \('a/0000.jpg', 'b/0000.jpg'\)"):
        load_predictions(tmp_path / "q.json", gt)
    gt["images"] = gt["images"][:1] + [dict(img, file_name=f"c/{img['id']}.jpg") for img in gt["images"][1:]]
    elsewhere = {img["id"]: "other/" + img["file_name"].split("/")[1] for img in gt["images"]}
    (tmp_path / "r.json").write_text(json.dumps(_dict_form(gt, dets, elsewhere)))
    assert len(load_predictions(tmp_path / "r.json", gt).score) == len(dets)


def test_dict_form_category_names_two_ground_truth_categories_share_are_refused(case_files, tmp_path):
    """Ground-truth categories 1 and 2 both named 'x': a results category 'x' was mapped
    onto the last of them, silently, and its detections scored as that one's. Refused
    naming both ids; a name of its own still maps."""
    from detector.evaluation import load_predictions

    d, gt, dets = case_files
    gt = json.loads(json.dumps(gt))
    assert len(gt["categories"]) >= 3
    first, second = gt["categories"][0], gt["categories"][1]
    second["name"] = first["name"]
    (tmp_path / "p.json").write_text(json.dumps(_dict_form(gt, dets)))
    with pytest.raises(ValueError, match=rf"categories\[0\]: name '{first['name']}' is the name of 2 ground-truth "
                                         rf"categories \(ids {first['id']}, {second['id']}\)"):
        load_predictions(tmp_path / "p.json", gt)
    keep = [c["id"] for c in gt["categories"][2:]]
    only = _dict_form(gt, [x for x in dets if x["category_id"] in keep])
    only["categories"] = only["categories"][2:]
    (tmp_path / "q.json").write_text(json.dumps(only))
    assert len(load_predictions(tmp_path / "q.json", gt).score) == len([x for x in dets if x["category_id"] in keep])


def test_an_empty_predictions_file_is_scored_with_a_warning(case_files, tmp_path, caplog):
    """[] scored AP 0, exit 0, without a word (an export that wrote nothing looks like a
    model that finds nothing)."""
    from detector.evaluation import load_predictions

    d, gt, _ = case_files
    (tmp_path / "p.json").write_text("[]")
    with caplog.at_level("WARNING", logger="detector"):
        assert len(load_predictions(tmp_path / "p.json", gt).score) == 0
    assert f"{tmp_path / 'p.json'} holds no detections: every metric is 0" in caplog.text


def test_an_evaluation_without_any_detection_says_where_to_look(tiny_setup, tmp_path, caplog):
    """Every metric 0 and nothing said (a score threshold nothing passes, a test size
    below every anchor): one warning naming the keys."""
    from detector.evaluation import evaluate
    from detector.modeling import build_model

    cfg, _, dataset = tiny_setup
    cfg = copy.deepcopy(cfg)
    cfg.roi_heads.score_thresh = 0.9999
    torch.manual_seed(0)
    with caplog.at_level("WARNING", logger="detector"):
        metrics = evaluate(build_model(cfg), dataset, cfg, output_dir=tmp_path)
    assert metrics["AP"] == 0.0
    assert f"no detections on any of the {len(dataset)} images, so every metric is 0" in caplog.text
    assert "roi_heads.score_thresh=0.9999" in caplog.text
