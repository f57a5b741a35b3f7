"""The generated shapes set: determinism, content constraints, generation on first use."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from PIL import Image

from detector.config import load_config
from detector.data import build_dataset
from detector.data.check import check_dataset
from detector.data.shapes import CLASS_NAMES, MIN_OBJECT_SIDE, ensure_shapes, generate_shapes, settings_tag
from conftest import load_tool

main = load_tool("make_shapes").main


def _files(root):
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_same_seed_same_bytes_other_seed_differs(tmp_path):
    a = generate_shapes(tmp_path / "a", 5, 2, seed=3, min_side=64, max_side=96)
    b = generate_shapes(tmp_path / "b", 5, 2, seed=3, min_side=64, max_side=96)
    c = generate_shapes(tmp_path / "c", 5, 2, seed=4, min_side=64, max_side=96)
    fa, fb, fc = _files(a), _files(b), _files(c)
    assert (a / "train.json").read_bytes() == (b / "train.json").read_bytes()
    assert fa == fb  # images too
    assert (a / "train.json").read_bytes() != (c / "train.json").read_bytes()
    assert (a / "val.json").read_bytes() != (c / "val.json").read_bytes()
    first = sorted(name for name in fa if name.startswith("train/"))[0]
    other = sorted(name for name in fc if name.startswith("train/"))[0]
    assert first.endswith("_000001.jpg") and other.endswith("_000001.jpg") and first != other  # the tags differ
    assert fa[first] != fc[other]


def test_content_constraints(tmp_path):
    root = generate_shapes(tmp_path / "s", 30, 0, seed=0, min_side=96, max_side=160)
    data = json.loads((root / "train.json").read_text())
    assert [c["name"] for c in data["categories"]] == list(CLASS_NAMES)
    per_image = {im["id"]: [] for im in data["images"]}
    for a in data["annotations"]:
        per_image[a["image_id"]].append(a)
    sizes = set()
    for im in data["images"]:
        w, h = im["width"], im["height"]
        assert 96 <= w <= 160 and 96 <= h <= 160
        sizes.add((w, h))
        assert Image.open(root / "train" / im["file_name"]).size == (w, h)
        anns = per_image[im["id"]]
        assert 1 <= len(anns) <= 6
        for a in anns:
            x, y, bw, bh = a["bbox"]
            assert x >= 0 and y >= 0 and x + bw <= w and y + bh <= h
            assert max(bw, bh) >= max(MIN_OBJECT_SIDE, 0.12 * min(w, h)) - 0.02
            assert min(bw, bh) >= 0.7 * MIN_OBJECT_SIDE - 0.02
            assert a["area"] > 0 and a["iscrowd"] == 0
    assert len(sizes) > 20  # sides and aspect ratios vary
    assert {a["category_id"] for a in data["annotations"]} == {1, 2, 3}
    counts = [len(v) for v in per_image.values()]
    assert min(counts) < max(counts)


def test_colour_varies_within_a_class_and_objects_stand_out(tmp_path):
    root = generate_shapes(tmp_path / "s", 20, 0, seed=1, min_side=96, max_side=128)
    data = json.loads((root / "train.json").read_text())
    images = {im["id"]: np.asarray(Image.open(root / "train" / im["file_name"]), dtype=np.float32)
              for im in data["images"]}
    centre_colours = {1: [], 2: [], 3: []}
    for a in data["annotations"]:
        x, y, w, h = a["bbox"]
        img = images[a["image_id"]]
        cx, cy = int(x + w / 2), int(y + h / 2)
        centre_colours[a["category_id"]].append(img[cy, cx])
    for cls, colours in centre_colours.items():
        colours = np.stack(colours)
        assert colours.std(axis=0).max() > 30, f"class {cls} has nearly one colour"


def test_generated_on_first_use_from_config(tmp_path):
    root = tmp_path / "shapes"
    cfg = load_config(None, ["data.format=shapes", f"data.train.root={root}", f"data.val.root={root}",
                             "data.shapes.num_train=4", "data.shapes.num_val=2", "data.shapes.min_side=64",
                             "data.shapes.max_side=80", "input.min_size_test=64", "input.max_size_test=100"])
    assert not root.exists()
    ds = build_dataset(cfg, "val", is_train=False)
    assert (root / "train.json").is_file() and len(ds) == 2
    assert ds.class_names == list(CLASS_NAMES)
    assert ds.label_to_category_id == {1: 1, 2: 2, 3: 3}
    image, target = ds[0]
    assert min(image.shape[1:]) == 64
    # Same settings: the folder is reused as it is.
    stamp = (root / "train.json").stat().st_mtime_ns
    build_dataset(cfg, "train", is_train=True)
    assert (root / "train.json").stat().st_mtime_ns == stamp


def test_stale_folder_is_regenerated_and_foreign_folder_left_alone(tmp_path, caplog):
    root = tmp_path / "s"
    ensure_shapes(root, 3, 1, seed=0, min_side=64, max_side=80)
    with caplog.at_level("WARNING", logger="detector.data.shapes"):
        ensure_shapes(root, 4, 1, seed=0, min_side=64, max_side=80)
    assert "regenerating the shapes data set" in caplog.text and "num_train: 3 -> 4" in caplog.text
    assert len(json.loads((root / "train.json").read_text())["images"]) == 4
    # A folder from an older generator (no params file) is regenerated too.
    (root / "shapes_params.json").unlink()
    ensure_shapes(root, 4, 1, seed=0, min_side=64, max_side=80)
    assert (root / "shapes_params.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")) == ["s"]  # no leftovers
    # A folder this generator did not write is used as it is.
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "train.json").write_text(json.dumps({"images": [], "annotations": [], "categories": []}))
    ensure_shapes(foreign, 4, 1)
    assert sorted(p.name for p in foreign.iterdir()) == ["train.json"]


def test_a_reader_of_a_regenerated_folder_stops_instead_of_pairing_new_images_with_old_boxes(tmp_path):
    """Two runs with other data.shapes settings on one folder: the second regenerates it
    while the first reads it. The first's next image is a file that is gone (named), not
    a new image under the boxes it read at start."""
    from detector.data import CocoDetection, DataError

    root = tmp_path / "s"
    ensure_shapes(root, 3, 1, seed=0, min_side=64, max_side=80)
    reader = CocoDetection(root / "train", root / "train.json")
    reader[0]
    ensure_shapes(root, 3, 1, seed=1, min_side=64, max_side=80)  # another run, other settings
    with pytest.raises((DataError, OSError), match=r"train/[0-9a-f]{8}_000002\.jpg"):
        reader[1]
    fresh = CocoDetection(root / "train", root / "train.json")
    assert len(fresh) == 3 and fresh[1][0].shape[0] == 3


def test_cli(tmp_path, capsys):
    assert main(["--out", str(tmp_path / "o"), "--train", "2", "--val", "1", "--seed", "5",
                 "--min-side", "64", "--max-side", "70"]) == 0
    assert len(json.loads((tmp_path / "o" / "val.json").read_text())["images"]) == 1
    assert "wrote 2 train and 1 val images" in capsys.readouterr().out


def test_make_shapes_never_writes_over_someone_elses_annotations(tmp_path, capsys):
    """--out a folder of one's own COCO data (a train.json the generator did not write):
    it was replaced by the shapes set without a word. Now refused, the file unchanged.
    A folder it wrote: kept with the same settings, regenerated with others (its old
    images removed, other files kept)."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "train.json").write_text('{"images": [], "annotations": [], "categories": [], "mine": 1}')
    assert main(["--out", str(mine), "--train", "2", "--val", "1"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == (f"error: --out {mine}: {mine / 'train.json'} is not a file this generator wrote; the shapes set "
                   "would replace it: choose a new or empty folder"), err
    assert json.loads((mine / "train.json").read_text())["mine"] == 1 and sorted(os.listdir(mine)) == ["train.json"]

    out = tmp_path / "o"
    args = ["--out", str(out), "--train", "2", "--val", "1", "--min-side", "64", "--max-side", "70"]
    assert main(args) == 0 and "wrote 2 train and 1 val images" in capsys.readouterr().out
    (out / "notes.txt").write_text("mine")
    before = _files(out)
    assert main(args) == 0 and "holds the shapes set of these settings already" in capsys.readouterr().out
    assert _files(out) == before
    assert main([*args, "--seed", "9"]) == 0
    tag = settings_tag(json.loads((out / "shapes_params.json").read_text()))
    assert sorted(p.name for p in (out / "train").iterdir()) == [f"{tag}_000001.jpg", f"{tag}_000002.jpg"]
    assert (out / "notes.txt").read_text() == "mine"


def test_an_existing_empty_folder_is_generated_into(tmp_path):
    """data.train.root made beforehand (mkdir), empty or with other files only: it was
    'used as it is', and training stopped at 'annotation file not found'."""
    for name, extra in (("empty", None), ("other_files", "readme.txt")):
        root = tmp_path / name
        root.mkdir()
        if extra:
            (root / extra).write_text("mine")
        ensure_shapes(root, 3, 1, seed=0, min_side=64, max_side=80)
        assert len(json.loads((root / "train.json").read_text())["images"]) == 3
        assert not extra or (root / extra).read_text() == "mine"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".") and "tmp" in p.name]


def test_bad_sides(tmp_path):
    with pytest.raises(ValueError, match=r"min_side <= max_side, got min_side=100, max_side=50"):
        generate_shapes(tmp_path, 1, 1, min_side=100, max_side=50)


def _ensure(root):
    ensure_shapes(root, 3, 1, seed=2, min_side=64, max_side=72)


def test_concurrent_first_use(tmp_path):
    import multiprocessing as mp

    root = tmp_path / "s"
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_ensure, args=(root,)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    assert len(json.loads((root / "train.json").read_text())["images"]) == 3
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".s.lock")) == ["s"]


def test_shapes_format_does_not_read_coco_ann_file(tmp_path):
    """A format reads only its own keys: a COCO ``ann_file`` inherited from a base config
    (configs/finetune_torchvision_coco.yaml extends a COCO recipe) is not read for shapes."""
    root = tmp_path / "shapes"
    missing = "data/coco/annotations/instances_train2017.json"
    cfg = load_config(None, ["data.format=shapes", f"data.train.root={root}", f"data.val.root={root}",
                             f"data.train.ann_file={missing}", f"data.val.ann_file={missing}",
                             "data.shapes.num_train=3", "data.shapes.num_val=2"])
    assert len(build_dataset(cfg, "train", is_train=False)) == 3
    assert len(build_dataset(cfg, "val", is_train=False)) == 2
    report = check_dataset(cfg, "train", decode=False)
    assert report.ok and report.num_images == 3


@pytest.mark.parametrize("args, words", [(["--train", "-1"], "--train must be in 1..1000000, got -1"),
                                         (["--seed", "-1"], "--seed must be in 0..9223372036854775807, got -1"),
                                         (["--min-side", "100000", "--max-side", "100000"],
                                          "--min-side must be in 8..8192, got 100000"),
                                         (["--min-side", "50", "--max-side", "10"], "--max-side must be in 50..8192")])
def test_make_shapes_arguments_have_the_config_bounds(tmp_path, capsys, args, words):
    """As data.shapes.* in a config: --train -1 wrote an empty train.json and said it wrote
    -1 images; a side of 100000 was numpy's out-of-memory traceback; --seed -1 numpy's
    'expected non-negative integer'."""
    with pytest.raises(SystemExit) as info:
        main(["--out", str(tmp_path / "s"), *args])
    assert info.value.code == 2 and words in capsys.readouterr().err.strip().splitlines()[-1]
    assert not (tmp_path / "s").exists()


def test_make_shapes_out_that_is_a_file_is_one_line(tmp_path, capsys):
    taken = tmp_path / "taken"
    taken.write_text("x")
    assert main(["--out", str(taken), "--train", "1", "--val", "1"]) == 1
    assert capsys.readouterr().err.strip() == f"error: --out {taken} is a file, not a folder"  # was: [Errno 17]
    assert taken.read_text() == "x"
