"""COCO metrics: parity with pycocotools run directly, both backends, bad input."""

from __future__ import annotations

import contextlib
import copy
import io

import numpy as np
import pytest
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval

from detector.evaluation.coco import COCO_METRIC_NAMES, UnknownImageError, coco_evaluate
from cases import make_coco_case


def reference_stats(gt, dets, cat_ids=None):
    """pycocotools called directly, the documented way."""
    with contextlib.redirect_stdout(io.StringIO()):
        coco_gt = COCO()
        coco_gt.dataset = copy.deepcopy(gt)
        coco_gt.createIndex()
        coco_dt = coco_gt.loadRes(copy.deepcopy(dets))
        ev = COCOeval(coco_gt, coco_dt, "bbox")
        if cat_ids is not None:
            ev.params.catIds = cat_ids
        ev.evaluate()
        ev.accumulate()
        ev.summarize()
    return np.asarray(ev.stats)


@pytest.fixture(scope="module")
def case():
    gt, dets = make_coco_case()
    # The case covers what the parity claim needs.
    areas = [a["area"] for a in gt["annotations"] if not a["iscrowd"]]
    assert min(areas) < 32**2 and max(areas) > 96**2 and any(32**2 < a < 96**2 for a in areas)
    assert any(a["iscrowd"] for a in gt["annotations"])
    assert {d["image_id"] for d in dets} < {img["id"] for img in gt["images"]}
    assert len(gt["images"]) >= 20 and len(gt["categories"]) == 5
    return gt, dets


@pytest.mark.parametrize("backend", ["pycocotools", "faster"])
def test_twelve_numbers_equal_pycocotools(case, backend):
    gt, dets = case
    ref = reference_stats(gt, dets)
    res = coco_evaluate(gt, dets, backend=backend)
    assert list(res.metrics) == list(COCO_METRIC_NAMES)
    ours = np.array([res.metrics[k] for k in COCO_METRIC_NAMES])
    np.testing.assert_allclose(ours, ref[:12], rtol=0, atol=1e-9)
    assert 0.05 < res.metrics["AP"] < 0.95  # a non-trivial case


def test_per_class_ap_equals_single_class_cocoeval(case):
    gt, dets = case
    res = coco_evaluate(gt, dets)
    for cat in res.cat_ids:
        ref = reference_stats(gt, dets, cat_ids=[cat])
        assert res.per_class_ap[cat] == pytest.approx(ref[0], abs=1e-9)
        assert res.per_class_ap50[cat] == pytest.approx(ref[1], abs=1e-9)


def test_inputs_not_mutated(case):
    gt, dets = case
    gt0, dets0 = copy.deepcopy(gt), copy.deepcopy(dets)
    coco_evaluate(gt, dets)
    assert gt == gt0 and dets == dets0


@pytest.mark.parametrize("backend", ["pycocotools", "faster"])
def test_empty_detections_give_zero(case, backend):
    gt, _ = case
    res = coco_evaluate(gt, [], backend=backend)
    assert all(res.metrics[k] == 0.0 for k in COCO_METRIC_NAMES)
    assert all(v == 0.0 for v in res.per_class_ap.values())


def test_unknown_image_id_is_named(case):
    gt, dets = case
    bad = dets + [{"image_id": 987654, "category_id": 1, "bbox": [0, 0, 5, 5], "score": 0.5}]
    with pytest.raises(UnknownImageError, match="image_id 987654"):
        coco_evaluate(gt, bad)


def test_unknown_category_and_bad_bbox_are_named(case):
    gt, dets = case
    with pytest.raises(ValueError, match="category_id 99"):
        coco_evaluate(gt, [{"image_id": 100, "category_id": 99, "bbox": [0, 0, 5, 5], "score": 0.5}])
    with pytest.raises(ValueError, match=r"result 0: 'bbox' must be 4 numbers \[x, y, w, h\], got \[0, 0, 5\]"):
        coco_evaluate(gt, [{"image_id": 100, "category_id": 1, "bbox": [0, 0, 5], "score": 0.5}])
    with pytest.raises(ValueError, match="result 0 has no 'score'"):
        coco_evaluate(gt, [{"image_id": 100, "category_id": 1, "bbox": [0, 0, 5, 5]}])
    with pytest.raises(ValueError, match="backend"):
        coco_evaluate(gt, dets, backend="nope")
    with pytest.raises(ValueError, match="missing the 'categories' section"):
        coco_evaluate({"images": [], "annotations": []}, dets)
    orphan = copy.deepcopy(gt)
    orphan["annotations"][3]["image_id"] = 555
    with pytest.raises(ValueError, match=r"annotations\[3\]: image_id 555 is not in 'images'"):
        coco_evaluate(orphan, dets)


def test_a_config_naming_a_removed_backend_is_one_line():
    """``eval.backend=numpy`` (the hand-written COCOeval, removed) is refused by the config
    check in one line naming the key and the choices."""
    from detector.config import ConfigError, load_config

    with pytest.raises(ConfigError) as info:
        load_config(None, ["eval.backend=numpy"])
    assert str(info.value) == "config key 'eval.backend' is 'numpy'; expected one of pycocotools, faster"


@pytest.mark.parametrize("backend", ["pycocotools", "faster"])
def test_image_and_annotation_ids_above_2_53_score_as_small_ones(backend):
    """Ids 2**53 .. 2**53 + k (odd and even neighbours; faster-coco-eval holds ids as
    float64 and would merge them): the twelve numbers and per-class AP of ids 1 .. k."""
    gt, dets = make_coco_case()
    big = {img["id"]: 2**53 + k for k, img in enumerate(sorted(gt["images"], key=lambda i: i["id"]))}
    big_gt = copy.deepcopy(gt)
    for img in big_gt["images"]:
        img["id"] = big[img["id"]]
    for k, ann in enumerate(big_gt["annotations"]):
        ann["image_id"] = big[ann["image_id"]]
        ann["id"] = 2**60 + k
    big_dets = [dict(d, image_id=big[d["image_id"]]) for d in dets]
    assert len({float(i) for i in big.values()}) < len(big)  # float64 would merge them
    small = coco_evaluate(gt, dets, backend=backend)
    got = coco_evaluate(big_gt, big_dets, backend=backend)
    assert got.metrics == small.metrics and got.per_class_ap == small.per_class_ap
    np.testing.assert_array_equal(got.precision, small.precision)


@pytest.mark.parametrize("bad_area", [-1.0, 0.0, 1e11, None])
def test_an_impossible_area_is_the_box_area_not_an_ignored_box(case, bad_area, caplog):
    """An area no object in its box can have (-1, 0, 1e11 in another unit; null) put the
    box outside every COCO area range: ignored, so a missed box cost no AP (AP 1.0 for
    half the boxes found). It is scored as a box of area w * h, with a warning."""
    gt, dets = case
    bad, fixed = copy.deepcopy(gt), copy.deepcopy(gt)
    changed = [a for a in bad["annotations"] if not a["iscrowd"]][::3]
    for a in changed:
        a["area"] = bad_area
    for a in [a for a in fixed["annotations"] if not a["iscrowd"]][::3]:
        a["area"] = a["bbox"][2] * a["bbox"][3]
    with caplog.at_level("WARNING", logger="detector"):
        res = coco_evaluate(bad, dets)
    ref = reference_stats(fixed, dets)
    np.testing.assert_allclose([res.metrics[k] for k in COCO_METRIC_NAMES], ref[:12], rtol=0, atol=1e-9)
    if bad_area is not None:  # pycocotools on the file as it is scores otherwise (null: a TypeError)
        assert not np.allclose(reference_stats(bad, dets)[:12], ref[:12], rtol=0, atol=1e-6)
    if bad_area is not None:
        assert f"{len(changed)} annotation(s) have an 'area' no object in their box can have" in caplog.text
