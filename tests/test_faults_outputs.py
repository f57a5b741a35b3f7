"""Output writing on a full disk or a bad path (issue 23, section 6): every tool writes
through ``detector.files.atomic_write``; a failure is one line naming the path and
leaves no temporary file and no partial output.

A full disk is a real one where this process may mount a tiny tmpfs (root on Linux),
and otherwise ``os.fsync`` failing with ENOSPC (what a full disk, a quota or a lost
network file system reports at the latest)."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from detector.files import OutputError, atomic_write, write_text
from conftest import load_tool
from cases import make_coco_case

ROOT = Path(__file__).resolve().parents[1]
TINY_CPU = ROOT / "configs" / "tiny_cpu.yaml"
SMALL = ["input.min_size_test=96", "input.max_size_test=128"]


def _mount_tmpfs(where: Path, options: str) -> bool:
    where.mkdir(parents=True, exist_ok=True)
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)],
                              capture_output=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0


@pytest.fixture(params=["tmpfs", "fsync"])
def full_disk(request, tmp_path, monkeypatch):
    """A folder on a full disk: a 64 KiB tmpfs filled up, or (``fsync``) any folder
    with ``os.fsync`` raising ENOSPC."""
    where = tmp_path / "full"
    if request.param == "fsync":
        where.mkdir()

        def no_space(fd):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(os, "fsync", no_space)
        yield where
        return
    if not _mount_tmpfs(where, "size=64k"):
        pytest.skip("cannot mount a tmpfs here")
    try:
        try:
            with open(where / "filler", "wb") as f:
                while True:
                    f.write(b"\0" * 4096)
                    f.flush()
        except OSError:  # full
            pass
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True, timeout=20)


def leftovers(folder: Path) -> list:
    return sorted(p.name for p in folder.rglob("*") if p.name != "filler")


def one_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    assert len(lines) >= 1 and "Traceback" not in text, text
    return lines[-1]


# ----------------------------------------------------------------- the helper itself


def test_atomic_write_on_a_full_disk_keeps_nothing_and_names_the_path(full_disk):
    path = full_disk / "out.json"
    with pytest.raises(OutputError) as e:
        write_text(path, "x" * 200_000)
    msg = str(e.value)
    assert "\n" not in msg and str(path) in msg and "no space left" in msg
    assert leftovers(full_disk) == []


def test_atomic_write_failure_keeps_the_previous_file(tmp_path):
    path = tmp_path / "metrics.json"
    path.write_text("old")

    def broken(f):
        f.write("half")
        raise OSError(errno.EIO, "Input/output error")

    with pytest.raises(OutputError, match="cannot write .*metrics.json: Input/output error"):
        atomic_write(path, broken, mode="w")
    assert path.read_text() == "old" and leftovers(tmp_path) == ["metrics.json"]


def test_atomic_write_to_a_folder_or_under_a_file_is_one_line(tmp_path):
    (tmp_path / "d").mkdir()
    with pytest.raises(OutputError, match="is a folder"):
        write_text(tmp_path / "d", "x")
    (tmp_path / "f").write_text("a file")
    with pytest.raises(OutputError, match=r"cannot write .*f/x\.json"):
        write_text(tmp_path / "f" / "x.json", "x")
    assert (tmp_path / "f").read_text() == "a file"


# ----------------------------------------------------------------- tools/eval.py


def test_eval_tool_on_a_full_disk_is_one_line_without_tmp(full_disk, tmp_path, capsys):
    gt, dets = make_coco_case()
    (tmp_path / "gt.json").write_text(json.dumps(gt))
    (tmp_path / "dets.json").write_text(json.dumps(dets))
    out = full_disk / "eval"
    rc = load_tool("eval").main(["--predictions", str(tmp_path / "dets.json"), "--annotations",
                                 str(tmp_path / "gt.json"), "--output-dir", str(out)])
    assert rc == 1
    msg = one_line(capsys.readouterr().err)
    assert msg.startswith("error: cannot write ") and str(out) in msg and "no space left" in msg
    assert not [p for p in leftovers(full_disk) if p.endswith(".tmp")]
    for name in leftovers(full_disk):  # what was written is complete: valid JSON / PNG
        if name.endswith(".json"):
            json.loads((out / name).read_text())


def test_eval_tool_output_dir_that_is_a_file(tmp_path, capsys):
    gt, dets = make_coco_case()
    (tmp_path / "gt.json").write_text(json.dumps(gt))
    (tmp_path / "dets.json").write_text(json.dumps(dets))
    (tmp_path / "taken").write_text("mine")
    rc = load_tool("eval").main(["--predictions", str(tmp_path / "dets.json"), "--annotations",
                                 str(tmp_path / "gt.json"), "--output-dir", str(tmp_path / "taken")])
    assert rc == 1
    msg = one_line(capsys.readouterr().err)
    assert str(tmp_path / "taken") in msg and "is a file" in msg
    assert (tmp_path / "taken").read_text() == "mine"


# ----------------------------------------------------------------- tools/export.py


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    from detector.config import load_config
    from detector.modeling import build_model

    torch.manual_seed(0)
    model = build_model(load_config(TINY_CPU, ["roi_heads.score_thresh=0.01", *SMALL]))
    path = tmp_path_factory.mktemp("w") / "w.pth"
    torch.save(model.state_dict(), path)
    return path


def export(weights, output, capsys):
    rc = load_tool("export").main(["--config", str(TINY_CPU), "--weights", str(weights), "--format", "torchscript",
                                   "--output", str(output), "--image-size", "96", "128", *SMALL])
    return rc, capsys.readouterr()


def test_export_on_a_full_disk_is_one_line_and_leaves_no_file(full_disk, weights, capsys):
    rc, out = export(weights, full_disk / "m.pt", capsys)
    assert rc == 1
    msg = one_line(out.err)
    assert str(full_disk / "m.pt") in msg and "no space left" in msg
    assert leftovers(full_disk) == []  # no 0-byte m.pt, no temporary file


def test_export_to_a_folder_is_a_usage_error_before_the_export(weights, tmp_path, capsys):
    (tmp_path / "m.pt").mkdir()
    with pytest.raises(SystemExit) as info:
        export(weights, tmp_path / "m.pt", capsys)
    err = capsys.readouterr().err
    assert info.value.code == 2, err
    assert err.strip().splitlines()[-1].endswith(f"argument --output: '{tmp_path / 'm.pt'}' is a folder: name the "
                                                 f"file to write (e.g. {tmp_path / 'm.pt' / 'result.json'})"), err
    assert leftovers(tmp_path) == ["m.pt"]


def test_an_output_that_is_an_input_is_refused_before_the_work(weights, tmp_path, capsys):
    """A file a tool writes that is one of its inputs, by any path (a link, ``..``):
    ``export.py --output`` its own --weights or --config, ``eval.py --output-dir`` holding
    the --predictions file it rewrites (re-scoring an evaluation into its folder), a
    ``--json`` that is the --config. Each was overwritten (the checkpoint lost); now one
    line, status 1, and every input as it was."""
    gt, dets = make_coco_case()
    run = tmp_path / "run"
    run.mkdir()
    (run / "gt.json").write_text(json.dumps(gt))
    (run / "detections.json").write_text(json.dumps(dets))
    config = run / "config.yaml"
    config.write_text(TINY_CPU.read_text())
    mine = run / "w.pth"
    mine.write_bytes(weights.read_bytes())
    (run / "link.pth").symlink_to(mine)
    before = {p.name: p.read_bytes() for p in run.iterdir()}
    cases = [
        ("export", ["--config", str(config), "--weights", str(mine), "--format", "torchscript", "--output",
                    str(run / ".." / "run" / "w.pth")], f"--output {run / '..' / 'run' / 'w.pth'} is the --weights file"),
        ("export", ["--config", str(config), "--weights", str(run / "link.pth"), "--format", "onnx", "--output",
                    str(mine)], f"--output {mine} is the --weights file {run / 'link.pth'}"),
        ("export", ["--config", str(config), "--weights", str(mine), "--format", "torchscript", "--output",
                    str(config)], f"--output {config} is the --config file"),
        ("eval", ["--predictions", str(run / "detections.json"), "--annotations", str(run / "gt.json"),
                  "--output-dir", str(run)], f"--output-dir's detections.json {run / 'detections.json'} is the "
                                              "--predictions file"),
        ("summary", ["--config", str(config), "--json", str(config)], f"--json {config} is the --config file"),
        ("benchmark", ["--config", str(config), "--task", "eval", "--gt", str(run / "gt.json"), "--results",
                       str(run / "detections.json"), "--json", str(run / "gt.json")], "is the --gt file"),
    ]
    for tool, argv, words in cases:
        assert load_tool(tool).main(argv) == 1, (tool, argv)
        msg = one_line(capsys.readouterr().err)
        assert msg.startswith("error: ") and words in msg and "writing it would destroy that input" in msg, msg
    assert {p.name: p.read_bytes() for p in run.iterdir()} == before


@pytest.mark.parametrize("tool,args", [
    ("export", ["--config", str(TINY_CPU), "--weights", "w.pth", "--format", "torchscript", "--output"]),
    ("summary", ["--config", str(TINY_CPU), "--json"]),
    ("benchmark", ["--config", str(TINY_CPU), "--task", "static-check", "--json"]),
])
def test_an_output_file_named_as_a_folder_is_a_usage_error(tool, args, tmp_path, capsys):
    """``--json out/`` (a folder that does not exist yet) wrote a file named ``out``; an
    empty name wrote nothing. Both are usage errors before any work."""
    for name, words in ((f"{tmp_path / 'new'}/", f"'{tmp_path / 'new'}/' ends with '/', so it names a folder: name "
                                                  f"the file to write (e.g. {tmp_path / 'new'}/result.json)"),
                        ("", "is empty: name the file to write")):
        with pytest.raises(SystemExit) as info:
            load_tool(tool).main([*args, name])
        err = capsys.readouterr().err
        assert info.value.code == 2 and err.strip().splitlines()[-1].endswith(f"{args[-1]}: {words}"), err
    assert list(tmp_path.iterdir()) == []


# ----------------------------------------------------------------- tools/benchmark.py --json


def test_benchmark_json_on_a_full_disk_is_one_line_and_leaves_no_file(full_disk, capsys):
    """``--json F`` is written through ``atomic_write``: on a full disk one line naming F,
    and no partial F (a plain write_text left one, and never fsynced)."""
    out = full_disk / "bench.json"
    rc = load_tool("benchmark").main(["--config", str(TINY_CPU), "--task", "eval", "--iters", "1", "--warmup", "0",
                                      "--eval-images", "4", "--eval-boxes", "2", "--json", str(out)])
    assert rc == 1
    msg = one_line(capsys.readouterr().err)
    assert msg.startswith(f"error: cannot write {out}: ") and "no space left" in msg
    assert leftovers(full_disk) == []


# ----------------------------------------------------------------- tools/infer.py


def images_in(folder: Path, names) -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for name in names:
        Image.fromarray(rng.integers(0, 255, (40, 50, 3), dtype=np.uint8)).save(folder / name)
    return {name: (folder / name).read_bytes() for name in names}


def infer(weights, inputs, out, capsys):
    rc = load_tool("infer").main(["--config", str(TINY_CPU), "--weights", str(weights), "--input", str(inputs),
                                  "--output-dir", str(out), *SMALL])
    return rc, one_line(capsys.readouterr().err) if rc else ""


def test_infer_output_dir_that_is_a_file(weights, tmp_path, capsys):
    images_in(tmp_path / "in", ["a.png"])
    (tmp_path / "out").write_text("mine")
    rc, msg = infer(weights, tmp_path / "in", tmp_path / "out", capsys)
    assert rc == 1 and str(tmp_path / "out") in msg and "is a file" in msg
    assert (tmp_path / "out").read_text() == "mine"


def test_infer_read_only_output_dir(weights, tmp_path, capsys):
    images_in(tmp_path / "in", ["a.png"])
    if not _mount_tmpfs(tmp_path / "ro", "size=64k,ro"):
        pytest.skip("cannot mount a read-only tmpfs here")
    try:
        rc, msg = infer(weights, tmp_path / "in", tmp_path / "ro" / "out", capsys)
        assert rc == 1 and str(tmp_path / "ro" / "out") in msg and msg.startswith("error: cannot create")
    finally:
        subprocess.run(["umount", "-l", str(tmp_path / "ro")], capture_output=True, timeout=20)


def test_infer_on_a_full_disk_leaves_no_partial_png(full_disk, weights, tmp_path, capsys):
    images_in(tmp_path / "in", ["a.png", "b.png"])
    rc, msg = infer(weights, tmp_path / "in", full_disk / "out", capsys)
    assert rc == 1 and "no space left" in msg and str(full_disk / "out") in msg
    for p in (full_disk / "out").glob("*"):
        assert not p.name.endswith(".tmp")
        with Image.open(p) as img:  # any PNG written is whole
            img.verify()


def test_sigterm_to_a_tool_keeps_its_finished_outputs(tmp_path):
    """``tools/infer.py`` over 200 images, sent SIGTERM once its first picture is out:
    exit status 143 and one line, no traceback; every picture in the folder is a whole
    PNG and no temporary file is left (what the user keeps: the pictures finished)."""
    from detector.config import load_config
    from detector.modeling import build_model

    torch.manual_seed(0)
    torch.save(build_model(load_config(TINY_CPU, SMALL)).state_dict(), tmp_path / "w.pth")
    inputs, out = tmp_path / "in", tmp_path / "out"
    inputs.mkdir()
    rng = np.random.default_rng(0)
    for i in range(200):
        Image.fromarray(rng.integers(0, 255, (96, 128, 3), dtype=np.uint8)).save(inputs / f"im{i:03d}.jpg")
    argv = [sys.executable, str(ROOT / "tools" / "infer.py"), "--config", str(TINY_CPU), "--weights",
            str(tmp_path / "w.pth"), "--input", str(inputs), "--output-dir", str(out), *SMALL]
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and not (out.is_dir() and any(out.glob("*.png"))) and proc.poll() is None:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 143, stderr[-2000:]
    assert "Traceback" not in stderr and stderr.strip().splitlines()[-1].startswith("error: stopped by SIGTERM")
    pngs = sorted(out.glob("*.png"))
    assert 1 <= len(pngs) < 200
    for png in pngs:
        with Image.open(png) as im:
            im.verify()
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]


# ----------------------------------------------------------------- checkpoints


def test_a_checkpoint_on_a_full_disk_says_so(full_disk, caplog):
    """torch's zip writer reports a full disk as '[enforce fail at inline_container.cc]
    ... unexpected pos ...': the line says 'no space left on the device', as the docs
    promise, and no partial file is left."""
    from detector.engine.checkpointing import Checkpointer, CheckpointWriteError

    state = {"model": {"w": torch.arange(2**18, dtype=torch.float32)}, "iteration": 1}  # 1 MiB
    ck = Checkpointer(full_disk, lambda: state)
    with pytest.raises(CheckpointWriteError) as e:
        ck.save(["last.pth"], 1)
    msg = str(e.value)
    assert "\n" not in msg and f"cannot write checkpoint {full_disk / 'checkpoints' / 'last.pth'} (no space left on " \
        "the device" in msg, msg
    assert "inline_container" not in msg and leftovers(full_disk) == ["checkpoints"]
