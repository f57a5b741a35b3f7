"""COCO and VOC data sets: id mapping, coordinates, crowd/difficult handling, bad input."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from pycocotools.coco import COCO

from detector.config import load_config
from detector.data.check import check_dataset
from detector.data import CocoDetection, DataError, VOCDetection, build_dataset
from detector.data.voc import voc_image_ids


def _write_image(path: Path, w: int, h: int, fmt: str = "JPEG") -> None:
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 255, size=(h, w, 3), dtype=np.uint8)).save(path, fmt)


def make_coco(tmp: Path, annotations=None, images=None, categories=None) -> tuple[Path, Path]:
    """Three images (40x30, 50x60, 32x32); categories with ids 1, 7, 90."""
    img_dir = tmp / "images"
    img_dir.mkdir(parents=True, exist_ok=True)
    if images is None:
        images = [
            {"id": 10, "file_name": "a.jpg", "width": 40, "height": 30},
            {"id": 11, "file_name": "b.jpg", "width": 50, "height": 60},
            {"id": 12, "file_name": "c.jpg", "width": 32, "height": 32},  # no annotations
        ]
    for im in images:
        if not (img_dir / im["file_name"]).exists() and im["width"] > 0 and im["height"] > 0:
            _write_image(img_dir / im["file_name"], im["width"], im["height"])
    if categories is None:
        categories = [{"id": 90, "name": "toothbrush"}, {"id": 1, "name": "person"}, {"id": 7, "name": "train"}]
    if annotations is None:
        annotations = [
            {"id": 1, "image_id": 10, "category_id": 7, "bbox": [2, 3, 10, 5], "area": 50, "iscrowd": 0},
            {"id": 2, "image_id": 10, "category_id": 90, "bbox": [20.5, 4, 8, 12.25], "area": 98, "iscrowd": 0},
            {"id": 3, "image_id": 10, "category_id": 1, "bbox": [0, 0, 40, 30], "area": 1200, "iscrowd": 1},
            {"id": 4, "image_id": 11, "category_id": 1, "bbox": [5, 6, 20, 30], "area": 600, "iscrowd": 0},
        ]
    ann_file = tmp / "instances.json"
    ann_file.write_text(json.dumps({"images": images, "annotations": annotations, "categories": categories}))
    return img_dir, ann_file


# ----------------------------------------------------------------------------- COCO


def test_coco_category_ids_map_to_contiguous_labels_and_back(tmp_path):
    ds = CocoDetection(*make_coco(tmp_path))
    assert ds.label_to_category_id == {1: 1, 2: 7, 3: 90}
    assert ds.class_names == ["person", "train", "toothbrush"]
    assert ds.image_ids == [10, 11, 12]
    assert ds.aspect_ratios == pytest.approx([40 / 30, 50 / 60, 1.0])
    # Round trip through the dataset's maps.
    for label, cat in ds.label_to_category_id.items():
        assert ds.category_id_to_label[cat] == label


def test_coco_xywh_to_xyxy_and_crowd_kept_out_of_targets(tmp_path):
    ds = CocoDetection(*make_coco(tmp_path))
    image, target = ds[0]
    assert image.dtype == torch.uint8 and image.shape == (3, 30, 40)
    torch.testing.assert_close(target["boxes"], torch.tensor([[2, 3, 12, 8], [20.5, 4, 28.5, 16.25]]))
    assert target["labels"].tolist() == [2, 3]  # category 7 -> 2, 90 -> 3; the crowd box is absent
    assert target["image_id"] == 10
    assert target["orig_size"].tolist() == [30, 40]
    assert target["scale"].tolist() == [1.0, 1.0]
    ann = ds.get_annotation(0)
    assert ann["iscrowd"].tolist() == [False, False, True]
    assert ann["labels"].tolist() == [2, 3, 1]
    torch.testing.assert_close(ann["boxes"][2], torch.tensor([0.0, 0.0, 40.0, 30.0]))


def test_coco_gt_round_trips_through_pycocotools(tmp_path):
    img_dir, ann_file = make_coco(tmp_path)
    ds = CocoDetection(img_dir, ann_file)
    gt = COCO()
    gt.dataset = ds.coco_gt()
    gt.createIndex()
    original = json.loads(ann_file.read_text())
    by_id = {a["id"]: a for a in gt.dataset["annotations"]}
    for a in original["annotations"]:
        assert by_id[a["id"]]["category_id"] == a["category_id"]
        assert by_id[a["id"]]["bbox"] == pytest.approx(a["bbox"])
        assert by_id[a["id"]]["iscrowd"] == a["iscrowd"]
        assert by_id[a["id"]]["area"] == pytest.approx(a["area"])
    assert sorted(gt.getCatIds()) == [1, 7, 90]
    assert sorted(gt.getImgIds()) == [10, 11, 12]


def test_coco_filter_empty(tmp_path):
    args = make_coco(tmp_path)
    assert len(CocoDetection(*args, filter_empty=False)) == 3
    kept = CocoDetection(*args, filter_empty=True)
    assert kept.image_ids == [10, 11]


def test_coco_degenerate_and_outside_boxes_are_counted_skips(tmp_path, caplog):
    anns = [
        {"id": 21, "image_id": 10, "category_id": 1, "bbox": [2, 3, 0, 5], "iscrowd": 0},  # zero width
        {"id": 22, "image_id": 10, "category_id": 1, "bbox": [50, 3, 4, 5], "iscrowd": 0},  # right of the image
        {"id": 23, "image_id": 10, "category_id": 1, "bbox": [30, 20, 20, 20], "iscrowd": 0},  # partly out: clipped
        {"id": 24, "image_id": 11, "category_id": 7, "bbox": [1, 1, 5, 5], "iscrowd": 0},
    ]
    with caplog.at_level(logging.WARNING, logger="detector.data"):
        ds = CocoDetection(*make_coco(tmp_path, annotations=anns))
    assert ds.skipped["degenerate"] == 1 and ds.skipped["outside"] == 1 and ds.skipped["clipped"] == 1
    text = caplog.text
    assert "annotation id 21" in text and "non-positive width or height" in text
    assert "annotation id 22" in text and "wholly outside the 40x30 image" in text
    ann = ds.get_annotation(0)
    torch.testing.assert_close(ann["boxes"], torch.tensor([[30.0, 20.0, 40.0, 30.0]]))


def test_missing_image_file_error_names_file(tmp_path):
    img_dir, ann_file = make_coco(tmp_path)
    (img_dir / "b.jpg").unlink()
    ds = CocoDetection(img_dir, ann_file)
    with pytest.raises(FileNotFoundError, match=r"image file .*b\.jpg \(image_id 11\) not found"):
        ds[1]


def test_truncated_jpeg_error_names_file(tmp_path):
    img_dir, ann_file = make_coco(tmp_path)
    data = (img_dir / "a.jpg").read_bytes()
    (img_dir / "a.jpg").write_bytes(data[: len(data) // 2])
    ds = CocoDetection(img_dir, ann_file)
    with pytest.raises(DataError, match=r"cannot decode image file .*a\.jpg \(image_id 10\): .*truncated"):
        ds[0]


def test_image_size_differs_from_annotation(tmp_path):
    img_dir, ann_file = make_coco(tmp_path)
    _write_image(img_dir / "a.jpg", 41, 30)
    ds = CocoDetection(img_dir, ann_file)
    with pytest.raises(DataError, match=r"a\.jpg \(image_id 10\) is 41x30 but its annotation says 40x30"):
        ds[0]


def test_invalid_json_error_names_file_and_position(tmp_path):
    img_dir, ann_file = make_coco(tmp_path)
    ann_file.write_text('{"images": [}')
    with pytest.raises(DataError, match=r"instances\.json is not valid JSON: .* line 1 column 13"):
        CocoDetection(img_dir, ann_file)


def test_missing_annotation_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"annotation file not found: .*nope\.json"):
        CocoDetection(tmp_path, tmp_path / "nope.json")


def test_unknown_category_id_error_names_annotation(tmp_path):
    anns = [{"id": 5, "image_id": 10, "category_id": 12, "bbox": [1, 1, 5, 5], "iscrowd": 0}]
    with pytest.raises(DataError, match=r"annotation id 5: category_id 12 is not in 'categories'"):
        CocoDetection(*make_coco(tmp_path, annotations=anns))


@pytest.mark.parametrize("label_space", ["contiguous", "category_id"])
@pytest.mark.parametrize("categories,match", [
    ([{"id": 1, "name": ""}], r"category id 1 has an empty name ''"),
    ([{"id": 1, "name": "cat"}, {"id": 2, "name": "  "}], r"category id 2 has an empty name '  '"),
])
def test_categories_in_use_have_a_name(tmp_path, categories, match, label_space):
    """Labels are known by name (results, per-class metrics, class checks): an empty
    name is refused naming the id; a category left out of data.class_names is not read."""
    with pytest.raises(DataError, match=match):
        CocoDetection(*make_coco(tmp_path, annotations=[], categories=categories), label_space=label_space)
    ds = CocoDetection(*make_coco(tmp_path, annotations=[], categories=[*categories, {"id": 9, "name": "dog"}]),
                       class_names=["dog"])
    assert ds.class_names == ["dog"]


def test_unknown_image_id_error(tmp_path):
    anns = [{"id": 6, "image_id": 99, "category_id": 1, "bbox": [1, 1, 5, 5], "iscrowd": 0}]
    with pytest.raises(DataError, match=r"annotation id 6: image_id 99 is not in 'images'"):
        CocoDetection(*make_coco(tmp_path, annotations=anns))


def test_duplicate_image_id_error(tmp_path):
    images = [
        {"id": 10, "file_name": "a.jpg", "width": 40, "height": 30},
        {"id": 10, "file_name": "b.jpg", "width": 50, "height": 60},
    ]
    with pytest.raises(DataError, match=r"image_id 10 appears twice \('a\.jpg' and 'b\.jpg'\)"):
        CocoDetection(*make_coco(tmp_path, images=images, annotations=[]))


@pytest.mark.parametrize("second", ["a.jpg", "./a.jpg", "sub/../a.jpg", "link.jpg"])
def test_two_entries_of_one_image_file_are_an_error(tmp_path, second):
    """Two annotation jobs merged without merging their images (one entry per class):
    each entry would train the other's boxes as background. A link to the file is the
    file (it passed the check)."""
    images = [{"id": 10, "file_name": "a.jpg", "width": 40, "height": 30},
              {"id": 11, "file_name": second, "width": 40, "height": 30}]
    anns = [{"id": 1, "image_id": 10, "category_id": 1, "bbox": [2, 3, 10, 5], "iscrowd": 0},
            {"id": 2, "image_id": 11, "category_id": 7, "bbox": [20, 4, 8, 12], "iscrowd": 0}]
    img_dir, ann_file = make_coco(tmp_path, images=images[:1], annotations=[])
    (img_dir / "link.jpg").symlink_to(img_dir / "a.jpg")
    ann_file.write_text(json.dumps({"images": images, "annotations": anns,
                                    "categories": [{"id": 1, "name": "person"}, {"id": 7, "name": "train"}]}))
    with pytest.raises(DataError) as err:
        CocoDetection(img_dir, ann_file)
    named = "'a.jpg'" if second == "a.jpg" else f"'a.jpg' (as {second!r})"
    assert str(err.value) == (f"annotation file {ann_file}: image_ids 10 and 11 both name the file {named}: one image "
                              "takes one entry (each entry's boxes would be background to the other); merge their "
                              "annotations")
    report = check_dataset(load_config(None, ["data.format=coco", f"data.train.root={img_dir}",
                                              f"data.train.ann_file={ann_file}"]))
    assert str(err.value) in report.errors


def test_empty_after_filtering_error(tmp_path):
    anns = [{"id": 3, "image_id": 10, "category_id": 1, "bbox": [0, 0, 40, 30], "iscrowd": 1}]
    with pytest.raises(DataError, match=r"instances\.json: data set is empty after filtering \(3 images before"):
        CocoDetection(*make_coco(tmp_path, annotations=anns), filter_empty=True)


def test_malformed_bbox_error(tmp_path):
    anns = [{"id": 8, "image_id": 10, "category_id": 1, "bbox": [1, 1, 5], "iscrowd": 0}]
    with pytest.raises(DataError, match=r"instances\.json: annotations\[0\]\.bbox: expected 4 numbers \[x, y, w, h\], got \[1, 1, 5\]"):
        CocoDetection(*make_coco(tmp_path, annotations=anns))


# ----------------------------------------------------------------------------- VOC

VOC_XML = """<annotation><filename>{name}.jpg</filename>
<size><width>{w}</width><height>{h}</height><depth>3</depth></size>
{objects}</annotation>"""
VOC_OBJ = """<object><name>{cls}</name><difficult>{diff}</difficult>
<bndbox><xmin>{x1}</xmin><ymin>{y1}</ymin><xmax>{x2}</xmax><ymax>{y2}</ymax></bndbox></object>"""


def make_voc(tmp: Path, images: dict, split: str = "train") -> Path:
    """images: {id: (w, h, [(cls, difficult, xmin, ymin, xmax, ymax), ...])}"""
    root = tmp / "VOCdevkit" / "VOC2012"
    for sub in ("JPEGImages", "Annotations", "ImageSets/Main"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    for vid, (w, h, objs) in images.items():
        _write_image(root / "JPEGImages" / f"{vid}.jpg", w, h)
        objects = "".join(VOC_OBJ.format(cls=c, diff=d, x1=a, y1=b, x2=x, y2=y) for c, d, a, b, x, y in objs)
        (root / "Annotations" / f"{vid}.xml").write_text(VOC_XML.format(name=vid, w=w, h=h, objects=objects))
    (root / "ImageSets" / "Main" / f"{split}.txt").write_text("\n".join(images) + "\n")
    return root


VOC_IMAGES = {
    "2008_000123": (60, 40, [("dog", 0, 10, 20, 50, 40), ("cat", 1, 1, 1, 5, 8)]),
    "2008_000200": (30, 50, [("cat", 0, 3, 4, 30, 50)]),
}


def test_voc_coordinates_difficult_and_ids(tmp_path):
    root = make_voc(tmp_path, VOC_IMAGES)
    ds = VOCDetection(root, "train", class_names=["cat", "dog"])
    assert ds.image_ids == [2008000123, 2008000200]
    assert ds.aspect_ratios == pytest.approx([60 / 40, 30 / 50])
    assert ds.label_to_category_id == {1: 1, 2: 2}
    ann = ds.get_annotation(0)
    # 1-based inclusive pixels -> continuous 0-based: [xmin - 1, ymin - 1, xmax, ymax]
    torch.testing.assert_close(ann["boxes"], torch.tensor([[9.0, 19.0, 50.0, 40.0], [0.0, 0.0, 5.0, 8.0]]))
    assert ann["labels"].tolist() == [2, 1]
    assert ann["difficult"].tolist() == [False, True]
    _, target = ds[0]
    assert target["labels"].tolist() == [2]  # difficult not trained on by default
    torch.testing.assert_close(target["boxes"], torch.tensor([[9.0, 19.0, 50.0, 40.0]]))
    _, target = VOCDetection(root, "train", class_names=["cat", "dog"], use_difficult=True)[0]
    assert target["labels"].tolist() == [2, 1]
    gt = ds.coco_gt()
    difficult = [a for a in gt["annotations"] if a.get("difficult")]
    assert len(difficult) == 1 and difficult[0]["ignore"] == 1 and difficult[0]["iscrowd"] == 0
    assert difficult[0]["bbox"] == pytest.approx([0.0, 0.0, 5.0, 8.0])  # width = xmax - xmin + 1


def test_voc_default_class_names_and_unknown_class(tmp_path):
    root = make_voc(tmp_path, {"000005": (20, 20, [("unicorn", 0, 1, 1, 5, 5)])})
    with pytest.raises(DataError, match=r"000005\.xml: object 0: class name 'unicorn' is not in data\.class_names"):
        VOCDetection(root, "train")


def test_voc_missing_split_file(tmp_path):
    root = make_voc(tmp_path, VOC_IMAGES)
    with pytest.raises(FileNotFoundError, match=r"VOC split file not found: .*ImageSets/Main/val\.txt"):
        VOCDetection(root, "val")


def test_voc_duplicate_id_in_split_file(tmp_path):
    root = make_voc(tmp_path, VOC_IMAGES)
    (root / "ImageSets/Main/train.txt").write_text("2008_000123\n2008_000200\n2008_000123\n")
    with pytest.raises(DataError, match=r"image id '2008_000123' appears 2 times"):
        VOCDetection(root, "train", class_names=["cat", "dog"])


@pytest.mark.parametrize("encoding", ["utf-8-sig", "utf-16", "utf-32"])
def test_voc_split_file_in_any_unicode_encoding(tmp_path, encoding):
    """A split file saved as "Unicode" (UTF-16) or with a byte-order mark lists the same
    ids; one that is no text is one line naming it (both were a UnicodeDecodeError)."""
    root = make_voc(tmp_path, VOC_IMAGES)
    split = root / "ImageSets/Main/train.txt"
    plain = VOCDetection(root, "train", class_names=["cat", "dog"]).image_ids
    split.write_bytes(split.read_text().encode(encoding))
    assert VOCDetection(root, "train", class_names=["cat", "dog"]).image_ids == plain
    split.write_bytes(bytes(range(200, 256)))
    with pytest.raises(DataError) as err:
        VOCDetection(root, "train", class_names=["cat", "dog"])
    assert str(err.value) == f"VOC split file {split} is not valid utf-8 text (invalid continuation byte at byte 0)"


def test_voc_image_ids_fallback():
    assert voc_image_ids(["000005", "000007"]) == [5, 7]
    assert voc_image_ids(["img_a", "img_b"]) == [1, 2]
    assert voc_image_ids(["1_1", "11"]) == [1, 2]  # "1_1" and "11" would collide
    assert voc_image_ids([str(2**63 - 1), "5"]) == [2**63 - 1, 5]
    # Wider than int64 (the records' and pycocotools' id type): it was an OverflowError in training and eval.
    assert voc_image_ids(["1" + "0" * 25, "5"]) == [1, 2]


# ----------------------------------------------------------------------------- build_dataset


def test_build_dataset_coco_and_voc_from_config(tmp_path):
    img_dir, ann_file = make_coco(tmp_path / "coco")
    cfg = load_config(None, ["data.format=coco", f"data.train.root={img_dir}", f"data.train.ann_file={ann_file}",
                             "input.min_size_train=[60]", "input.max_size_train=100", "input.hflip_prob=0"])
    ds = build_dataset(cfg, "train", is_train=True)
    assert len(ds) == 2  # filter_empty (default true) in training
    image, target = ds[0]
    assert image.shape == (3, 60, 80)
    torch.testing.assert_close(target["scale"], torch.tensor([2.0, 2.0]))
    torch.testing.assert_close(target["boxes"], torch.tensor([[4, 6, 24, 16], [41, 8, 57, 32.5]]))

    root = make_voc(tmp_path / "voc", VOC_IMAGES)
    cfg = load_config(None, ["data.format=voc", f"data.val.root={root}", "data.val.split=train",
                             "data.class_names=[cat,dog]", "input.min_size_test=20", "input.max_size_test=100"])
    ds = build_dataset(cfg, "val", is_train=False)
    image, target = ds[1]
    assert image.shape == (3, 33, 20)
    assert target["orig_size"].tolist() == [50, 30]


def test_build_dataset_config_errors(tmp_path):
    cfg = load_config(None, ["data.format=coco", f"data.train.root={tmp_path}"])
    with pytest.raises(ValueError, match=r"data\.train\.ann_file is empty"):
        build_dataset(cfg, "train", True)
    with pytest.raises(ValueError, match=r"split must be 'train' or 'val', got 'test'"):
        build_dataset(cfg, "test", True)


def test_duplicate_annotation_id_and_bad_image_fields(tmp_path):
    anns = [{"id": 1, "image_id": 10, "category_id": 1, "bbox": [1, 1, 5, 5]},
            {"id": 1, "image_id": 11, "category_id": 1, "bbox": [1, 1, 5, 5]}]
    with pytest.raises(DataError, match=r"annotation id 1 appears twice"):
        CocoDetection(*make_coco(tmp_path / "a", annotations=anns))
    images = [{"id": "x", "file_name": "a.jpg", "width": 40, "height": 30}]
    with pytest.raises(DataError, match=r"instances\.json: images\[0\]\.id: expected an integer, got \"x\""):
        CocoDetection(*make_coco(tmp_path / "b", images=images, annotations=[]))
    images = [{"id": 3, "file_name": "a.jpg", "width": 0, "height": 30}]
    with pytest.raises(DataError, match=r"instances\.json: images\[0\]\.width: expected a positive number, got 0"):
        CocoDetection(*make_coco(tmp_path / "c", images=images, annotations=[]))
    # A size of whole pixels written as a float is read; a fractional one was cut to an int, silently.
    img_dir, ann_file = make_coco(tmp_path / "d", annotations=[])
    data = json.loads(ann_file.read_text())
    data["images"][0]["width"] = 40.0
    ann_file.write_text(json.dumps(data))
    assert CocoDetection(img_dir, ann_file).records[0].width == 40
    data["images"][0]["width"] = 40.5
    ann_file.write_text(json.dumps(data))
    with pytest.raises(DataError) as info:
        CocoDetection(img_dir, ann_file)
    assert str(info.value) == f"annotation file {ann_file}: image_id 10: width 40.5 is not a whole number of pixels"
