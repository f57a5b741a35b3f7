"""The record cache (detector/data/record_file.py, record_cache.py, ``data.cache_dir``):
a record file gives back exactly the parsed records, anything that changes the records
makes another file, a damaged file is never read, and in a distributed run local rank 0
parses alone while every rank maps the same read-only pages."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from detector.data import CocoDetection, DataError
from detector.data.build import cache_in, record_cache
from detector.data.record_cache import RecordCache, cache_key, cache_path
from detector.data.record_file import RecordFileError, read_record_file
from detector.data.records import ALL_FIELDS
from conftest import ROOT

SMAPS = Path("/proc/self/smaps")


def _coco(path: Path, variant: int = 0) -> Path:
    """A small COCO file with what the parser treats specially: a crowd box, a box to
    clip, a degenerate box (skipped), an image without boxes, a non-ASCII file name,
    category ids with gaps. ``variant`` moves one box (another file content)."""
    cats = [{"id": 1, "name": "cat"}, {"id": 3, "name": "dog"}, {"id": 7, "name": "bird"}]
    images = [{"id": i, "file_name": name, "width": 64, "height": 48}
              for i, name in ((1, "a.jpg"), (5, "caf\u00e9/b.jpg"), (9, "c.jpg"), (12, "d.jpg"))]
    anns = [
        {"id": 1, "image_id": 1, "category_id": 1, "bbox": [1 + variant, 2, 10, 12], "area": 100.0, "iscrowd": 0},
        {"id": 2, "image_id": 1, "category_id": 3, "bbox": [5, 5, 80, 10], "area": 0, "iscrowd": 0},  # clipped
        {"id": 3, "image_id": 5, "category_id": 7, "bbox": [0, 0, 20, 20], "area": 400.0, "iscrowd": 1},  # crowd
        {"id": 4, "image_id": 5, "category_id": 3, "bbox": [3, 3, 0, 5], "area": 1.0, "iscrowd": 0},  # skipped
        {"id": 5, "image_id": 12, "category_id": 7, "bbox": [10, 10, 5, 5], "area": 25.0, "iscrowd": 0},
    ]
    path.write_text(json.dumps({"images": images, "annotations": anns, "categories": cats}))
    return path


def _assert_same_dataset(got: CocoDetection, want: CocoDetection) -> None:
    for name in ALL_FIELDS:
        a, b = got.records.arrays[name], want.records.arrays[name]
        assert a.dtype == b.dtype and a.shape == b.shape, name
        np.testing.assert_array_equal(a, b, err_msg=name)
    assert [got.records.path(i) for i in range(len(got))] == [want.records.path(i) for i in range(len(want))]
    assert got.class_names == want.class_names
    assert got.label_to_category_id == want.label_to_category_id
    assert got.skipped == want.skipped
    assert got.num_images_before_filter == want.num_images_before_filter


def _mapped(array: np.ndarray) -> bool:
    while isinstance(array, np.ndarray):
        array = array.base
    return isinstance(array, memoryview)


def _records_files(folder: Path) -> list:
    return sorted(folder.glob("*.records"))


@pytest.mark.parametrize("options", [
    {},
    {"filter_empty": True},
    {"class_names": ["bird", "cat"], "filter_empty": True, "use_difficult": True},
    {"label_space": "category_id"},
])
def test_round_trip_gives_the_parsed_records_exactly(tmp_path, options):
    ann = _coco(tmp_path / "instances.json")
    cache = RecordCache(tmp_path / "cache")
    parsed = CocoDetection(tmp_path / "images", ann, **options)
    first = CocoDetection(tmp_path / "images", ann, cache=cache, **options)  # parses and writes
    second = CocoDetection(tmp_path / "images", ann, cache=cache, **options)  # reads the file
    assert len(_records_files(tmp_path / "cache")) == 1
    for ds in (first, second):
        _assert_same_dataset(ds, parsed)
        assert _mapped(ds.records.arrays["boxes"])
        for i in range(len(parsed)):
            a, b = ds.get_annotation(i), parsed.get_annotation(i)
            assert a.keys() == b.keys() and all(
                (a[k] == b[k]).all() if hasattr(a[k], "shape") else a[k] == b[k] for k in a)
    if "class_names" not in options:  # the special cases were all there
        assert parsed.skipped["degenerate"] == 1 and parsed.skipped["clipped"] == 1
    if not options.get("filter_empty"):
        assert second.records.path(1).endswith("caf\u00e9/b.jpg") and len(second) == 4


def test_a_set_empty_after_filtering_is_the_same_error_from_the_file(tmp_path):
    """Zero images and zero boxes round-trip; the data set's error is the same each time."""
    ann = tmp_path / "crowd.json"
    ann.write_text(json.dumps({"images": [{"id": 1, "file_name": "a.jpg", "width": 10, "height": 10}],
                               "annotations": [{"id": 1, "image_id": 1, "category_id": 1, "bbox": [0, 0, 5, 5],
                                                "iscrowd": 1}], "categories": [{"id": 1, "name": "x"}]}))
    messages = []
    for cache in (None, RecordCache(tmp_path / "cache"), RecordCache(tmp_path / "cache")):
        with pytest.raises(DataError, match="empty after filtering") as info:
            CocoDetection(tmp_path, ann, filter_empty=True, cache=cache)
        messages.append(str(info.value))
    assert messages[0] == messages[1] == messages[2] and "1 images before" in messages[0]
    (path,) = _records_files(tmp_path / "cache")
    store, meta = read_record_file(path)
    assert len(store) == 0 and store.num_boxes == 0 and meta["images_before_filter"] == 1


def test_every_input_of_the_records_changes_the_file(tmp_path):
    ann = _coco(tmp_path / "instances.json")
    base = {"dataset": "CocoDetection", "image_dir": "images", "class_names": None, "label_space": "contiguous",
            "filter_empty": False, "use_difficult": False}
    key = cache_key(ann, base)
    paths = {cache_path(tmp_path, ann, key)}
    for name, value in (("image_dir", "other"), ("class_names", ["cat"]), ("label_space", "category_id"),
                        ("filter_empty", True), ("use_difficult", True), ("dataset", "VOCDetection")):
        paths.add(cache_path(tmp_path, ann, cache_key(ann, {**base, name: value})))
    st = os.stat(ann)
    os.utime(ann, ns=(st.st_atime_ns, st.st_mtime_ns + 1))  # the modification time alone
    paths.add(cache_path(tmp_path, ann, cache_key(ann, base)))
    _coco(ann, variant=1)  # other content, same size
    paths.add(cache_path(tmp_path, ann, cache_key(ann, base)))
    ann.write_text(ann.read_text() + " ")  # another size
    paths.add(cache_path(tmp_path, ann, cache_key(ann, base)))
    assert len(paths) == 10


def test_a_changed_annotation_file_is_parsed_again(tmp_path):
    ann = _coco(tmp_path / "instances.json")
    cache = RecordCache(tmp_path / "cache")
    before = CocoDetection(tmp_path, ann, cache=cache)
    _coco(ann, variant=3)  # the first box moves by 3 px; the file keeps its size
    after = CocoDetection(tmp_path, ann, cache=cache)
    assert after.records.arrays["boxes"][0, 0] == before.records.arrays["boxes"][0, 0] + 3
    _assert_same_dataset(after, CocoDetection(tmp_path, ann))
    assert len(_records_files(tmp_path / "cache")) == 2


def test_options_change_the_records_read_back(tmp_path):
    ann = _coco(tmp_path / "instances.json")
    cache = RecordCache(tmp_path / "cache")
    for options in ({}, {"filter_empty": True}, {"class_names": ["dog"]}, {"label_space": "category_id"}):
        _assert_same_dataset(CocoDetection(tmp_path, ann, cache=cache, **options), CocoDetection(tmp_path, ann, **options))
    assert len(_records_files(tmp_path / "cache")) == 4


def _damage(path: Path, how: str) -> None:
    raw = bytearray(path.read_bytes())
    if how == "truncated":
        raw = raw[:-1]
    elif how == "appended":
        raw += b"\0"
    elif how == "data byte":
        raw[-3] ^= 0x01
    elif how == "header byte":
        raw[40] ^= 0x01
    elif how == "magic":
        raw[:8] = b"NOTMINE!"
    elif how == "empty":
        raw = bytearray()
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("how", ["truncated", "appended", "data byte", "header byte", "magic", "empty"])
def test_a_damaged_record_file_is_refused_and_rebuilt(tmp_path, caplog, how):
    ann = _coco(tmp_path / "instances.json")
    cache = RecordCache(tmp_path / "cache")
    CocoDetection(tmp_path, ann, cache=cache)
    (path,) = _records_files(tmp_path / "cache")
    _damage(path, how)
    with pytest.raises(RecordFileError) as info:
        read_record_file(path)
    message = str(info.value)
    assert str(path) in message and "\n" not in message
    with caplog.at_level(logging.WARNING, logger="detector.data.record_cache"):
        rebuilt = CocoDetection(tmp_path, ann, cache=cache)
    assert any(str(path) in r.getMessage() for r in caplog.records)
    _assert_same_dataset(rebuilt, CocoDetection(tmp_path, ann))
    read_record_file(path)  # rewritten whole


def test_a_record_file_of_other_input_at_the_path_is_not_read(tmp_path):
    """A file whose name matches but whose key does not (a hash collision, a copied
    file) is parsed again, not read."""
    ann = _coco(tmp_path / "instances.json")
    cache = RecordCache(tmp_path / "cache")
    CocoDetection(tmp_path, ann, cache=cache, class_names=["cat"])
    (other,) = _records_files(tmp_path / "cache")
    key = cache_key(ann, {"dataset": "CocoDetection", "image_dir": str(tmp_path), "class_names": None,
                          "label_space": "contiguous", "filter_empty": False, "use_difficult": False})
    target = cache_path(tmp_path / "cache", ann, key)
    target.write_bytes(other.read_bytes())
    with pytest.raises(RecordFileError, match="key differs"):
        read_record_file(target, key)
    _assert_same_dataset(CocoDetection(tmp_path, ann, cache=cache), CocoDetection(tmp_path, ann))


def test_an_unwritable_cache_folder_warns_and_parses(tmp_path, caplog):
    ann = _coco(tmp_path / "instances.json")
    (tmp_path / "taken").write_text("a file where the folder should be")
    with caplog.at_level(logging.WARNING, logger="detector.data.record_cache"):
        ds = CocoDetection(tmp_path, ann, cache=RecordCache(tmp_path / "taken"))
    assert any("taken" in r.getMessage() and "not shared" in r.getMessage() for r in caplog.records)
    _assert_same_dataset(ds, CocoDetection(tmp_path, ann))


def test_cache_dir_key(tiny_cfg, tmp_path):
    assert tiny_cfg().data.cache_dir == "auto"
    assert record_cache(tiny_cfg()) is None  # auto, one process
    assert record_cache(tiny_cfg("data.cache_dir=")) is None
    assert record_cache(tiny_cfg(f"data.cache_dir={tmp_path / 'c'}")) == RecordCache(tmp_path / "c")


def test_a_tool_with_an_output_folder_keeps_the_auto_cache_there(tiny_cfg, tmp_path, monkeypatch):
    """tools/eval.py --output-dir under torchrun: ``auto`` shares the records under that
    folder, not under the config's train.output_dir (a run folder, or a folder of its name
    made under the working folder). One process: still none; a folder the user set: kept."""
    import detector.data.build as build

    assert cache_in(tiny_cfg(), tmp_path / "eval") == tiny_cfg()  # one process
    monkeypatch.setattr(build, "get_world_size", lambda: 2)
    assert record_cache(cache_in(tiny_cfg(), tmp_path / "eval")) == RecordCache(tmp_path / "eval" / "cache")
    mine = tiny_cfg(f"data.cache_dir={tmp_path / 'mine'}")
    assert record_cache(cache_in(mine, tmp_path / "eval")) == RecordCache(tmp_path / "mine")
    assert record_cache(cache_in(tiny_cfg("data.cache_dir="), tmp_path / "eval")) is None


@pytest.mark.skipif(not SMAPS.exists() or not hasattr(os, "fork"), reason="needs /proc/self/smaps and fork")
def test_mapped_records_are_read_only_and_shared_with_a_forked_worker(tmp_path):
    ann = _coco(tmp_path / "instances.json")
    CocoDetection(tmp_path, ann, cache=RecordCache(tmp_path / "cache"))
    (path,) = _records_files(tmp_path / "cache")
    store, _ = read_record_file(path)  # checks the checksums: every page read here
    for array in store.arrays.values():
        assert not array.flags.writeable
        with pytest.raises(ValueError):
            array.flags.writeable = True
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # a loader worker: reads every record, tries to write one
        code = 1
        try:
            total = sum(float(a.sum()) for a in store.arrays.values())
            try:
                store.arrays["boxes"][0, 0] = 1.0
                wrote = True
            except ValueError:
                wrote = False
            fields = {"Private_Dirty": 0, "Shared_Clean": 0}
            inside = False
            for line in SMAPS.read_text().splitlines():
                head = line.split()
                if head and "-" in head[0] and len(head) >= 5:  # a mapping's first line
                    inside = line.endswith(str(path))
                elif inside and head and head[0].rstrip(":") in fields:
                    fields[head[0].rstrip(":")] += int(head[1])
            os.write(write_fd, json.dumps({"wrote": wrote, "total": total, **fields}).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write_fd)
    with os.fdopen(read_fd) as pipe:
        out = json.loads(pipe.read())
    os.waitpid(pid, 0)
    assert out["wrote"] is False
    assert out["total"] == pytest.approx(sum(float(a.sum()) for a in store.arrays.values()))
    assert out["Private_Dirty"] == 0 and out["Shared_Clean"] > 0, out


# ------------------------------------------------------------------------ two ranks
WORKER = textwrap.dedent("""
    import hashlib, json, os, sys
    from pathlib import Path
    from detector.data import coco
    from detector.data.files import DataError
    from detector.data.record_cache import RecordCache
    import torch.distributed
    from detector.distributed import cleanup, init_distributed

    ann, bad, cache_dir, side = sys.argv[1:]
    info = init_distributed("cpu", timeout_s=120)
    calls = []
    parse = coco._coco_parsed

    def counting(*args, **kwargs):
        calls.append(args[0])
        return parse(*args, **kwargs)

    coco._coco_parsed = counting
    ds = coco.CocoDetection(Path(ann).parent, ann, filter_empty=True, cache=RecordCache(Path(cache_dir)))
    arrays = ds.records.arrays
    base = arrays["boxes"]
    while hasattr(base, "base") and base.base is not None:
        base = base.base
    out = {"calls": len(calls), "class_names": ds.class_names,
           "digest": {k: hashlib.sha256(a.tobytes()).hexdigest() + str(a.dtype) + str(a.shape) for k, a in arrays.items()},
           "paths": [ds.records.path(i) for i in range(len(ds))], "mapped": isinstance(base, memoryview)}
    try:
        coco.CocoDetection(Path(bad).parent, bad, cache=RecordCache(Path(cache_dir)))
        out["bad"] = None
    except DataError as exc:
        out["bad"] = str(exc)
    out["calls_after_bad"] = len(calls)
    Path(side, f"rank{info.rank}.json").write_text(json.dumps(out))
    # Leave together: a rank exiting while the other still holds the gloo pair can end
    # in std::terminate at interpreter exit.
    torch.distributed.barrier()
    cleanup()
""")


@pytest.mark.dist
def test_two_ranks_parse_once_and_share_the_records(tmp_path):
    ann = _coco(tmp_path / "instances.json")
    bad = tmp_path / "bad" / "instances.json"
    bad.parent.mkdir()
    bad.write_text('{"images": [{"id": 1, "file_name": "a.jpg", "width": 64, "height": 48}], '
                   '"annotations": [{"id": 1, "image_id": 2, "category_id": 1, "bbox": [0, 0, 1, 1]}], '
                   '"categories": [{"id": 1, "name": "cat"}]}')
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), NO_ALBUMENTATIONS_UPDATE="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script),
           str(ann), str(bad), str(tmp_path / "cache"), str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["calls"] == 1 and r1["calls"] == 0  # local rank 0 parsed; rank 1 mapped its file
    assert r0["digest"] == r1["digest"] and r0["paths"] == r1["paths"] and r0["class_names"] == r1["class_names"]
    assert r0["mapped"] and r1["mapped"]
    want = CocoDetection(tmp_path, ann, filter_empty=True)
    assert r0["paths"] == [want.records.path(i) for i in range(len(want))]
    # A bad file: local rank 0's error is every rank's, and rank 1 still parses nothing.
    assert r0["bad"] and r0["bad"] == r1["bad"] and str(bad) in r0["bad"] and "image_id 2" in r0["bad"]
    assert r0["calls_after_bad"] == 2 and r1["calls_after_bad"] == 0
    assert len(_records_files(tmp_path / "cache")) == 1
