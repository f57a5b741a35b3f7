"""Annotation files checked against the declared COCO and VOC record types
(``detector/data/schema.py``): every field of every record type, by class of fault
(wrong type, not finite, out of int64, a flag that is not 0/1, bad nesting, unreadable
files), through the data set, the checker, the splitter and the evaluator, each giving
one line that names the file and the field's path."""

from __future__ import annotations

import json
import re

import pytest
import yaml

from conftest import load_tool
from detector.config import load_config
from detector.data import CocoDetection, VOCDetection
from detector.data.check import check_dataset
from detector.data.files import DataError
from detector.data.schema import raise_error, read_coco

IMAGE = '{"id": 10, "file_name": "a.jpg", "width": 40, "height": 30}'
CATEGORY = '{"id": 1, "name": "cat"}'
ANNOTATION = '{"id": 5, "image_id": 10, "category_id": 1, "bbox": [1, 2, 10, 8], "area": 80, "iscrowd": 0}'


def coco_text(image: str = IMAGE, category: str = CATEGORY, annotation: str = ANNOTATION) -> str:
    """A one-image COCO file as text, so that NaN, Infinity, 1e309 and 2**70 are written as they stand."""
    return f'{{"images": [{image}], "categories": [{category}], "annotations": [{annotation}]}}'


def with_field(record: str, key: str, value: str) -> str:
    """``record`` (JSON object text) with ``key`` set to the JSON text ``value``."""
    fields = json.loads(record)
    fields[key] = "@@"
    return json.dumps(fields).replace('"@@"', value)


def write(tmp_path, text: str):
    img_dir = tmp_path / "images"
    img_dir.mkdir(parents=True, exist_ok=True)
    ann = tmp_path / "instances.json"
    ann.write_text(text)
    return img_dir, ann


# (section, field, JSON value, expected reason): every declared field of every COCO record.
COCO_FIELD_CASES = [
    ("images", "id", "[10]", 'expected an integer, got [10]'),
    ("images", "id", '{"a": 1}', 'expected an integer, got {"a": 1}'),
    ("images", "id", "true", "expected an integer, got true"),
    ("images", "id", "10.5", "expected an integer, got 10.5"),
    ("images", "id", str(2**70), f"expected an integer that fits int64, got {2**70}"),
    ("images", "file_name", "7", "expected a string, got 7"),
    ("images", "width", "Infinity", "expected a finite number, got Infinity"),
    ("images", "width", "1e309", "number out of range"),
    ("images", "width", "true", "expected a number, got true"),
    ("images", "width", '"40"', 'expected a number, got "40"'),
    ("images", "width", "0", "expected a positive number, got 0"),
    ("images", "height", "NaN", "expected a finite number, got NaN"),
    ("images", "height", "-30", "expected a positive number, got -30"),
    ("categories", "id", '"1"', 'expected an integer, got "1"'),
    ("categories", "id", "[1]", "expected an integer, got [1]"),
    ("categories", "name", "5", "expected a string or null, got 5"),
    ("annotations", "id", '"abc"', 'expected an integer, got "abc"'),
    ("annotations", "id", str(2**70), f"expected an integer that fits int64, got {2**70}"),
    ("annotations", "id", "[5]", "expected an integer, got [5]"),
    ("annotations", "image_id", '{"id": 10}', 'expected an integer, got {"id": 10}'),
    ("annotations", "image_id", "false", "expected an integer, got false"),
    ("annotations", "category_id", '"1"', 'expected an integer, got "1"'),
    ("annotations", "bbox", "[true, true, true, true]", "expected a number, got true"),
    ("annotations", "bbox", "[1, 2, 3]", "expected 4 numbers [x, y, w, h], got [1, 2, 3]"),
    ("annotations", "bbox", '"1 2 3 4"', 'expected a list, got "1 2 3 4"'),
    ("annotations", "bbox", "[1, 2, 3, Infinity]", "expected a finite number, got Infinity"),
    ("annotations", "bbox", "null", "expected a list, got null"),
    ("annotations", "area", "Infinity", "expected a finite number, got Infinity"),
    ("annotations", "area", "1e309", "number out of range"),
    ("annotations", "area", '"80"', 'expected a number or null, got "80"'),
    ("annotations", "iscrowd", '"0"', 'expected 0 or 1, got "0"'),
    ("annotations", "iscrowd", "true", "expected 0 or 1, got true"),
    ("annotations", "iscrowd", "2", "expected 0 or 1, got 2"),
    ("annotations", "ignore", '"1"', 'expected 0 or 1, got "1"'),
    ("annotations", "difficult", "true", "expected 0 or 1, got true"),
]


def _field_path(section: str, field: str, value: str) -> str:
    path = f"{section}[0].{field}"
    if field == "bbox" and value.startswith("[") and value.count(",") == 3:
        index = 3 if "Infinity" in value else 0
        path += f"[{index}]"
    return path


@pytest.mark.parametrize("section,field,value,reason", COCO_FIELD_CASES,
                         ids=[f"{s}.{f}={v[:12]}" for s, f, v, _ in COCO_FIELD_CASES])
def test_coco_field_of_wrong_type_is_one_named_line(tmp_path, section, field, value, reason):
    parts = {"images": IMAGE, "categories": CATEGORY, "annotations": ANNOTATION}
    parts[section] = with_field(parts[section], field, value)
    img_dir, ann = write(tmp_path, coco_text(parts["images"], parts["categories"], parts["annotations"]))
    with pytest.raises(DataError) as info:
        CocoDetection(img_dir, ann)
    msg = str(info.value)
    assert "\n" not in msg
    expected = f"annotation file {ann}: {_field_path(section, field, value)}: {reason}"
    assert msg.startswith(expected), msg


REQUIRED_FIELDS = [("images", f) for f in ("id", "file_name", "width", "height")] + \
                  [("annotations", f) for f in ("id", "image_id", "category_id", "bbox")]


@pytest.mark.parametrize("section,field", REQUIRED_FIELDS, ids=[f"{s}.{f}" for s, f in REQUIRED_FIELDS])
def test_coco_record_without_a_required_field(tmp_path, section, field):
    parts = {"image": IMAGE, "annotation": ANNOTATION}
    key = section[:-1]  # images -> image: coco_text's argument
    record = json.loads(parts[key])
    del record[field]
    img_dir, ann = write(tmp_path, coco_text(**{key: json.dumps(record)}))
    with pytest.raises(DataError, match=rf"^annotation file .*instances\.json: {section}\[0\] has no '{field}'$"):
        CocoDetection(img_dir, ann)


def test_valid_flags_and_optional_fields_are_read(tmp_path):
    """0/1 flags and a null or missing area are read as before; crowd only when iscrowd is 1."""
    anns = [with_field(ANNOTATION, "iscrowd", "1"),
            with_field(with_field(ANNOTATION, "id", "6"), "area", "null"),
            with_field(ANNOTATION, "id", "7").replace(', "iscrowd": 0', "")]
    text = f'{{"images": [{IMAGE}], "categories": [{CATEGORY}], "annotations": [{", ".join(anns)}]}}'
    ds = CocoDetection(*write(tmp_path, text))
    r = ds.records[0]
    assert r.iscrowd.tolist() == [True, False, False] and r.ann_ids.tolist() == [5, 6, 7]
    assert r.areas.tolist() == [80.0, 80.0, 80.0]  # null area: w * h


# ---------------------------------------------------------------------------- the top level, nesting, not JSON

TOP_LEVEL_CASES = {
    "annotations_null": ('{"images": [], "categories": [], "annotations": null}',
                         r"annotations: expected a list, got null"),
    "images_missing": ('{"categories": [], "annotations": []}', r"missing the 'images' section"),
    "top_level_list": ("[1, 2]", r"the top level: expected an object, got \[1, 2\]"),
    "nested_deep": ('{"images": [], "categories": [], "annotations": [{"segmentation": '
                    + "[" * 100_000 + "]" * 100_000 + "}]}", r"nested too deep"),
    "nested_deep_top": ('{"info": ' + "[" * 100_000 + "]" * 100_000 + "}", r"nested too deep"),
    "deep_list_as_top_level": ("[" * 100_000 + "]" * 100_000, r"the top level: expected an object, got a list"),
    "not_json": ('{"images": [}', r"is not valid JSON: .* at line 1 column 13"),
    "not_finite_outside_an_entry": ('{"images": [], "categories": [], "annotations": NaN}',
                                    r"annotations: expected a list, got NaN"),
}


@pytest.mark.parametrize("name", sorted(TOP_LEVEL_CASES))
def test_bad_top_level_is_one_named_line(tmp_path, name):
    text, message = TOP_LEVEL_CASES[name]
    img_dir, ann = write(tmp_path, text)
    with pytest.raises(DataError) as info:
        CocoDetection(img_dir, ann)
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith(f"annotation file {ann}") and re.search(message, msg), msg


@pytest.mark.parametrize("encoding", ["utf-8-sig", "utf-16", "utf-16-le", "utf-32"])
def test_coco_file_with_a_byte_order_mark_or_in_utf16_reads_as_utf8(tmp_path, encoding):
    """A UTF-8 byte-order mark (Windows editors) or UTF-16/32 text reads as the UTF-8
    file does (as Python's ``json`` reads bytes), a non-ASCII file name included."""
    text = coco_text(image=IMAGE.replace('"a.jpg"', '"caf\u00e9 \u732b.jpg"'))
    img_dir, ann = write(tmp_path, text)
    plain = read_coco(str(ann), raise_error)
    ann.write_bytes(text.encode(encoding))
    assert ann.read_bytes() != text.encode()
    other = read_coco(str(ann), raise_error)
    assert other == plain and other.images[0].file_name == "caf\u00e9 \u732b.jpg"
    assert CocoDetection(img_dir, ann).records[0].ann_ids.tolist() == [5]


def test_coco_file_that_is_not_text_in_its_encoding_is_one_line(tmp_path):
    img_dir, ann = write(tmp_path, "")
    ann.write_bytes(coco_text().encode("utf-16") + b"\x00")  # an odd byte count
    with pytest.raises(DataError, match=r"^annotation file .*instances\.json is not valid utf-16 text \(truncated data"):
        CocoDetection(img_dir, ann)


def test_annotation_file_that_is_a_directory(tmp_path):
    (tmp_path / "instances.json").mkdir()
    with pytest.raises(DataError, match=r"^annotation file .*instances\.json is a folder, not a file$"):
        CocoDetection(tmp_path, tmp_path / "instances.json")


# ---------------------------------------------------------------------------- every bad entry, good ones kept


def bad_entries_text() -> str:
    images = [IMAGE, with_field(with_field(IMAGE, "id", "11"), "width", "Infinity"),
              with_field(with_field(IMAGE, "id", "12"), "file_name", '"c.jpg"')]
    anns = [ANNOTATION, with_field(with_field(ANNOTATION, "id", "6"), "iscrowd", '"0"'),
            with_field(ANNOTATION, "id", '"abc"'), with_field(with_field(ANNOTATION, "id", "8"), "image_id", "12")]
    return (f'{{"images": [{", ".join(images)}], "categories": [{CATEGORY}, {{"id": "2", "name": "dog"}}], '
            f'"annotations": [{", ".join(anns)}]}}')


def test_reader_reports_every_bad_entry_and_keeps_the_good_ones(tmp_path):
    _, ann = write(tmp_path, bad_entries_text())
    errors = []
    data = read_coco(str(ann), errors.append)
    assert [e.split(": ", 1)[1] for e in errors] == [
        "images[1].width: expected a finite number, got Infinity",
        'categories[1].id: expected an integer, got "2"',
        'annotations[1].iscrowd: expected 0 or 1, got "0"',
        'annotations[2].id: expected an integer, got "abc"',
    ]
    assert all(e.startswith(f"annotation file {ann}: ") for e in errors)
    assert [im.id for im in data.images] == [10, 12] and [a.id for a in data.annotations] == [5, 8]


def coco_config(tmp_path, ann):
    return load_config(None, ["data.format=coco", f"data.train.root={tmp_path / 'images'}",
                              f"data.train.ann_file={ann}"])


def test_checker_reports_every_bad_entry(tmp_path):
    _, ann = write(tmp_path, bad_entries_text())
    report = check_dataset(coco_config(tmp_path, ann), "train", decode=False)
    text = "\n".join(report.errors)
    for expected in ("images[1].width: expected a finite number, got Infinity",
                     'categories[1].id: expected an integer, got "2"',
                     'annotations[1].iscrowd: expected 0 or 1, got "0"',
                     'annotations[2].id: expected an integer, got "abc"'):
        assert f"annotation file {ann}: {expected}" in text
    assert report.num_images == 2 and report.num_boxes == 2  # the good images and annotations
    assert report.num_crowd == 0  # iscrowd "0" is not read as crowd


# ---------------------------------------------------------------------------- VOC


def voc_root(tmp_path, size="<width>40</width><height>30</height>", obj=None, declaration=""):
    root = tmp_path / "VOC2007"
    (root / "ImageSets" / "Main").mkdir(parents=True)
    (root / "Annotations").mkdir()
    (root / "JPEGImages").mkdir()
    (root / "ImageSets" / "Main" / "train.txt").write_text("000001\n")
    if obj is None:
        obj = "<name>cat</name><difficult>0</difficult><bndbox><xmin>2</xmin><ymin>3</ymin><xmax>20</xmax><ymax>25</ymax></bndbox>"
    (root / "Annotations" / "000001.xml").write_text(
        f"{declaration}<annotation><size>{size}<depth>3</depth></size><object>{obj}</object></annotation>")
    return root


def box(xmin="2", ymin="3", xmax="20", ymax="25", extra="<difficult>0</difficult>"):
    return (f"<name>cat</name>{extra}<bndbox><xmin>{xmin}</xmin><ymin>{ymin}</ymin>"
            f"<xmax>{xmax}</xmax><ymax>{ymax}</ymax></bndbox>")


VOC_CASES = {
    "width_inf": ({"size": "<width>inf</width><height>30</height>"}, "size.width: expected an integer, got \"inf\""),
    "width_1e309": ({"size": "<width>1e309</width><height>30</height>"}, "size.width: number out of range"),
    "width_fraction": ({"size": "<width>40.5</width><height>30</height>"}, "size.width: expected an integer, got \"40.5\""),
    "height_zero": ({"size": "<width>40</width><height>0</height>"}, "size.height: expected a positive integer, got \"0\""),
    "height_missing": ({"size": "<width>40</width>"}, "size has no 'height'"),
    "xmin_inf": ({"obj": box(xmin="inf")}, "object[0].bndbox.xmin: expected a finite number, got \"inf\""),
    "ymax_nan": ({"obj": box(ymax="nan")}, "object[0].bndbox.ymax: expected a finite number, got \"nan\""),
    "xmax_text": ({"obj": box(xmax="ten")}, "object[0].bndbox.xmax: expected a number, got \"ten\""),
    "ymin_missing": ({"obj": box().replace("<ymin>3</ymin>", "")}, "object[0].bndbox has no 'ymin'"),
    "no_bndbox": ({"obj": "<name>cat</name>"}, "object[0] has no 'bndbox'"),
    "difficult_false": ({"obj": box(extra="<difficult>false</difficult>")},
                        "object[0].difficult: expected 0 or 1, got \"false\""),
    "difficult_true": ({"obj": box(extra="<difficult>true</difficult>")},
                       "object[0].difficult: expected 0 or 1, got \"true\""),
    "difficult_two": ({"obj": box(extra="<difficult>2</difficult>")}, "object[0].difficult: expected 0 or 1, got \"2\""),
    "truncated_yes": ({"obj": box(extra="<truncated>yes</truncated>")},
                      "object[0].truncated: expected 0 or 1, got \"yes\""),
    # an element that holds one value, given twice: which one counts would be a guess
    "two_bndbox": ({"obj": box() + "<bndbox><xmin>1</xmin><ymin>1</ymin><xmax>9</xmax><ymax>9</ymax></bndbox>"},
                   "object[0] has 2 <bndbox> elements; one is expected"),
    "two_names": ({"obj": "<name>dog</name>" + box()}, "object[0] has 2 <name> elements; one is expected"),
    "two_xmin": ({"obj": box(xmin="2</xmin><xmin>5")}, "object[0].bndbox has 2 <xmin> elements; one is expected"),
    "two_difficult": ({"obj": box(extra="<difficult>0</difficult><difficult>1</difficult>")},
                      "object[0] has 2 <difficult> elements; one is expected"),
    "two_widths": ({"size": "<width>40</width><width>50</width><height>30</height>"},
                   "size has 2 <width> elements; one is expected"),
    "two_sizes": ({"size": "<width>40</width><height>30</height></size><size><width>4</width><height>3</height>"},
                  "the annotation has 2 <size> elements; one is expected"),
}


@pytest.mark.parametrize("name", sorted(VOC_CASES))
def test_voc_field_of_wrong_type_is_one_named_line(tmp_path, name):
    kwargs, reason = VOC_CASES[name]
    root = voc_root(tmp_path, **kwargs)
    with pytest.raises(DataError) as info:
        VOCDetection(root, "train")
    msg = str(info.value)
    assert "\n" not in msg
    assert msg == f"VOC annotation file {root / 'Annotations' / '000001.xml'}: {reason}" or (
        reason.endswith("out of range") and msg.startswith(f"VOC annotation file {root}") and reason in msg), msg


def test_voc_tags_in_a_namespace_are_read_and_another_root_is_named(tmp_path):
    """``<annotation xmlns="...">`` (some exporters) holds VOC's tags in a namespace: read
    as VOC (it said 'has no <size>'). A file whose root is not ``<annotation>`` (another
    tool's XML) is named as such."""
    root = voc_root(tmp_path / "ns")
    xml = root / "Annotations" / "000001.xml"
    xml.write_text(xml.read_text().replace("<annotation>", '<annotation xmlns="http://example.org/voc">'))
    plain = VOCDetection(voc_root(tmp_path / "plain"), "train")
    ds = VOCDetection(root, "train")
    assert ds.get_annotation(0)["boxes"].tolist() == plain.get_annotation(0)["boxes"].tolist() == [[1, 2, 20, 25]]
    xml.write_text("<annotations><size><width>40</width><height>30</height></size></annotations>")
    with pytest.raises(DataError) as info:
        VOCDetection(root, "train")
    assert str(info.value) == f"VOC annotation file {xml}: its root element is <annotations>, not VOC's <annotation>"


def test_voc_entity_expansion_is_bounded_and_external_entities_are_not_read(tmp_path):
    """A "billion laughs" file (nine levels of ten entities each) and an external
    entity naming a local file: each is one "not valid XML" line, quickly, and the
    file's content never reaches the data set."""
    lol = '<!ENTITY l0 "lol">' + "".join(f'<!ENTITY l{i} "{f"&l{i - 1};" * 10}">' for i in range(1, 10))
    secret = tmp_path / "secret.txt"
    secret.write_text("cat")
    for name, doctype, ref, words in [("laughs", lol, "&l9;", "amplification"),
                                      ("external", f'<!ENTITY x SYSTEM "{secret.as_uri()}">', "&x;", "undefined entity")]:
        root = voc_root(tmp_path / name, obj=box().replace("<name>cat</name>", f"<name>{ref}</name>"),
                        declaration=f"<!DOCTYPE annotation [{doctype}]>")
        with pytest.raises(DataError, match=rf"^VOC annotation file .*000001\.xml is not valid XML: .*{words}") as info:
            VOCDetection(root, "train")
        assert "\n" not in str(info.value)


def test_voc_flags_read_as_zero_or_one(tmp_path):
    """<difficult>1</difficult> is difficult, 0 or an empty element is not."""
    for k, (extra, difficult) in enumerate([("<difficult>1</difficult>", True), ("<difficult>0</difficult>", False),
                                            ("<difficult/>", False), ("<truncated>1</truncated>", False)]):
        ds = VOCDetection(voc_root(tmp_path / str(k), obj=box(extra=extra)), "train")
        assert ds.records[0].difficult.tolist() == [difficult]


def test_voc_unknown_encoding_and_a_directory_are_one_line(tmp_path):
    root = voc_root(tmp_path / "a", declaration='<?xml version="1.0" encoding="klingon"?>')
    with pytest.raises(DataError, match=r"^VOC annotation file .*000001\.xml is not valid XML: .*klingon"):
        VOCDetection(root, "train")
    root = voc_root(tmp_path / "b")
    xml = root / "Annotations" / "000001.xml"
    xml.unlink()
    xml.mkdir()
    with pytest.raises(DataError, match=r"^VOC annotation file .*000001\.xml is a folder, not a file$"):
        VOCDetection(root, "train")


# ---------------------------------------------------------------------------- the tools: the same one line

TOOL_CASES = {
    "iscrowd_string": (coco_text(annotation=with_field(ANNOTATION, "iscrowd", '"0"')),
                       'annotations[0].iscrowd: expected 0 or 1, got "0"'),
    "id_too_large": (coco_text(annotation=with_field(ANNOTATION, "id", str(2**70))),
                     f"annotations[0].id: expected an integer that fits int64, got {2**70}"),
    "width_infinity": (coco_text(image=with_field(IMAGE, "width", "Infinity")),
                       "images[0].width: expected a finite number, got Infinity"),
    "annotations_null": ('{"images": [], "categories": [], "annotations": null}',
                         "annotations: expected a list, got null"),
    "nested_deep": ('{"info": ' + "{\"a\": " * 100_000 + "1" + "}" * 100_000 + "}",
                    "nested too deep (more than about 1000 levels of lists and objects)"),
}


def assert_tools_give(tmp_path, capsys, expected: str, data: dict, split_source: list, eval_source: list):
    """tools/check_dataset.py (a config whose ``data`` section is ``data``), then
    tools/split_dataset.py and tools/eval.py --predictions (their sources ``split_source``
    and ``eval_source``) each stop with ``expected`` as their one line; the splitter
    writes nothing."""
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({"data": data}))
    assert load_tool("check_dataset").main(["--config", str(config), "--no-decode"]) == 1
    out = capsys.readouterr()
    assert "Traceback" not in out.out + out.err and expected in out.out, out.out

    assert load_tool("split_dataset").main([*split_source, "--out", str(tmp_path / "s"),
                                            "--fractions", "0.5", "0.5"]) == 1
    out = capsys.readouterr()
    assert out.err.strip().splitlines() == [f"error: {expected}"] and not (tmp_path / "s").exists()

    (tmp_path / "dets.json").write_text("[]")
    assert load_tool("eval").main(["--predictions", str(tmp_path / "dets.json"), *eval_source]) == 1
    out = capsys.readouterr()
    assert out.err.strip().splitlines() == [f"error: {expected}"], out.err


@pytest.mark.parametrize("name", sorted(TOOL_CASES))
def test_tools_give_the_same_one_line(tmp_path, capsys, name):
    text, reason = TOOL_CASES[name]
    img_dir, ann = write(tmp_path, text)
    assert_tools_give(tmp_path, capsys, f"annotation file {ann}: {reason}",
                      {"format": "coco", "train": {"root": str(img_dir), "ann_file": str(ann)}},
                      ["--annotations", str(ann)], ["--annotations", str(ann)])


def test_voc_tools_give_the_same_one_line(tmp_path, capsys):
    root = voc_root(tmp_path, obj=box(extra="<difficult>false</difficult>"))
    expected = (f"VOC annotation file {root / 'Annotations' / '000001.xml'}: "
                f"object[0].difficult: expected 0 or 1, got \"false\"")
    assert_tools_give(tmp_path, capsys, expected, {"format": "voc", "train": {"root": str(root), "split": "train"}},
                      ["--voc-root", str(root)], ["--voc-root", str(root), "--voc-split", "train"])


def test_ground_truth_to_score_against_needs_only_image_ids(tmp_path):
    """tools/eval.py --annotations: images need an ``id`` only (pycocotools scores without
    the file name or size); the other fields are still checked when present."""
    from detector.evaluation import load_ground_truth

    gt = tmp_path / "gt.json"
    gt.write_text(coco_text(image='{"id": 10}'))
    assert load_ground_truth(gt)["images"] == [{"id": 10}]
    gt.write_text(coco_text(image='{"id": 10, "width": true}'))
    with pytest.raises(DataError, match=rf"^annotation file {re.escape(str(gt))}: images\[0\]\.width: "
                                        r"expected a number or null, got true$"):
        load_ground_truth(gt)
