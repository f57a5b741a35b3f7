"""Work lost by the tools themselves (issue 23, section 3): a generator deletes only
what it wrote, run and data folders never contain one another, inference never writes
over its inputs or one output over another, an empty run folder key is refused, an
interrupted run exits non-zero, and the run folder's lock dies with its process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from detector.config import ConfigError
from detector.data.shapes import ensure_shapes, settings_tag
from detector.engine.run_folder import RunFolder, check_run_folder_apart_from_data
from conftest import TINY_CONFIG, load_tool, signal_train_run, tiny_config, tiny_overrides

ROOT = Path(__file__).resolve().parents[1]
TINY_CPU = ROOT / "configs" / "tiny_cpu.yaml"
SMALL = ["input.min_size_test=96", "input.max_size_test=128"]


# ----------------------------------------------------------------- the shapes generator


def _put_a_run_in(root: Path) -> dict:
    run = root / "run" / "checkpoints"
    run.mkdir(parents=True)
    (run / "last.pth").write_bytes(b"weights")
    (root / "notes.txt").write_text("mine")
    (root / "train" / "mine.jpg").write_bytes(b"a user's file in a generated folder")
    return {p: p.read_bytes() for p in (run / "last.pth", root / "notes.txt", root / "train" / "mine.jpg")}


@pytest.mark.parametrize("manifest", [True, False], ids=["manifest", "older_generator"])
def test_regenerating_shapes_deletes_only_what_it_wrote(tmp_path, manifest):
    root = tmp_path / "s"
    ensure_shapes(root, 4, 1, seed=0, min_side=64, max_side=80)
    if not manifest:  # a folder from a generator that wrote no list of its files
        (root / "shapes_files.txt").unlink()
    kept = _put_a_run_in(root)
    ensure_shapes(root, 3, 2, seed=0, min_side=64, max_side=80)
    for path, content in kept.items():
        assert path.read_bytes() == content
    assert len(json.loads((root / "train.json").read_text())["images"]) == 3
    tag = settings_tag(json.loads((root / "shapes_params.json").read_text()))
    assert sorted(p.name for p in (root / "train").iterdir()) == [f"{tag}_00000{i}.jpg" for i in (1, 2, 3)] + ["mine.jpg"]
    assert sorted(p.name for p in (root / "val").iterdir()) == [f"{tag}_00000{i}.jpg" for i in (1, 2)]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".s.tmp")]


# ----------------------------------------------------------------- run folder vs data folders


@pytest.mark.parametrize("where", ["run_in_data", "data_in_run", "same"])
def test_run_folder_and_data_folder_must_not_contain_each_other(tmp_path, where):
    data, run = {"run_in_data": (tmp_path / "d", tmp_path / "d" / "runs" / "x"),
                 "data_in_run": (tmp_path / "r" / "data", tmp_path / "r"),
                 "same": (tmp_path / "d", tmp_path / "d")}[where]
    with pytest.raises(ConfigError) as e:
        check_run_folder_apart_from_data(tiny_config(data, run))
    msg = str(e.value)
    assert "\n" not in msg and "train.output_dir" in msg and "data.train.root" in msg
    assert str(run) in msg and str(data) in msg
    check_run_folder_apart_from_data(tiny_config(tmp_path / "data", tmp_path / "run"))  # siblings are fine


def test_train_tool_refuses_a_run_folder_inside_the_data_root(tmp_path, capsys):
    data = tmp_path / "data"
    ensure_shapes(data, 8, 4, seed=0, min_side=64, max_side=96)
    rc = load_tool("train").main(["--config", str(TINY_CONFIG), *tiny_overrides(data, data / "run")])
    err = capsys.readouterr().err.strip()
    assert rc == 1 and "\n" not in err and "train.output_dir" in err and "data.train.root" in err
    assert not (data / "run").exists()


@pytest.mark.parametrize("value", ["train.output_dir=", "train.output_dir=' '"])
def test_empty_output_dir_is_refused(tmp_path, capsys, value, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rc = load_tool("train").main(["--config", str(TINY_CONFIG), *tiny_overrides(tmp_path / "data"), value])
    err = capsys.readouterr().err.strip()
    assert rc == 1 and err.startswith("error: config key 'train.output_dir' is empty"), err
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing written into the working directory


# ----------------------------------------------------------------- tools/infer.py


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    from detector.config import load_config
    from detector.modeling import build_model

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("w") / "w.pth"
    torch.save(build_model(load_config(TINY_CPU, SMALL)).state_dict(), path)
    return path


def images_in(folder: Path, names) -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for name in names:
        Image.fromarray(rng.integers(0, 255, (40, 50, 3), dtype=np.uint8)).save(folder / name)
    return {folder / name: (folder / name).read_bytes() for name in names}


def infer(weights, inputs, out, capsys):
    rc = load_tool("infer").main(["--config", str(TINY_CPU), "--weights", str(weights), "--input", str(inputs),
                                  "--output-dir", str(out), *SMALL])
    return rc, capsys.readouterr().err.strip()


@pytest.mark.parametrize("case", ["same_folder", "single_file_in_it"])
def test_infer_never_writes_over_its_inputs(weights, tmp_path, capsys, case):
    inputs = tmp_path / "in"
    before = images_in(inputs, ["a.png", "b.jpg"])
    rc, err = infer(weights, inputs if case == "same_folder" else inputs / "a.png", inputs, capsys)
    assert rc == 1 and "\n" not in err and "--output-dir" in err and str(inputs) in err
    assert {p: p.read_bytes() for p in before} == before
    assert sorted(p.name for p in inputs.iterdir()) == ["a.png", "b.jpg"]


@pytest.mark.parametrize("names", [["a.jpg", "a.png"], ["a.JPG", "A.png"]])
def test_infer_refuses_two_inputs_with_one_output_name(weights, tmp_path, capsys, names):
    images_in(tmp_path / "in", names)
    rc, err = infer(weights, tmp_path / "in", tmp_path / "out", capsys)
    assert rc == 1 and "\n" not in err and "would both be written as" in err
    assert all(name in err for name in names)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


# ----------------------------------------------------------------- an interrupted run


@pytest.mark.slow
def test_sigint_run_exits_130_without_stale_metrics(tmp_path):
    proc, stdout, _ = signal_train_run(tmp_path / "data", tmp_path / "run", signal.SIGINT, wait_s=180)
    assert proc.returncode == 128 + signal.SIGINT, stdout
    assert "interrupted by SIGINT" in stdout and "--resume" in stdout
    assert "val metrics" not in stdout and "Traceback" not in stdout


# ----------------------------------------------------------------- the run folder's lock


LOCK_THEN_DIE = textwrap.dedent("""
    import os, signal, sys, time
    import torch
    from detector.engine.run_folder import RunFolder

    folder = RunFolder.open(sys.argv[1])
    loader = torch.utils.data.DataLoader(list(range(64)), batch_size=4, num_workers=2,
                                         persistent_workers=True, multiprocessing_context="fork")
    it = iter(loader)
    next(it)  # the workers run (forked while the lock is held)
    print(" ".join(str(w.pid) for w in it._workers), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
""")


def test_lock_dies_with_the_process_not_with_its_loader_workers(tmp_path):
    out = tmp_path / "run"
    log = tmp_path / "log.txt"
    with open(log, "w") as f:  # a file, not a pipe: the orphaned workers hold a copy of it
        proc = subprocess.Popen([sys.executable, "-c", LOCK_THEN_DIE, str(out)], cwd=ROOT, stdout=f, stderr=f)
        assert proc.wait(timeout=120) == -signal.SIGKILL, log.read_text()
    workers = [int(p) for p in log.read_text().split()[:2]]
    try:
        alive = [pid for pid in workers if os.path.exists(f"/proc/{pid}") and
                 Path(f"/proc/{pid}/status").read_text().find("State:\tZ") < 0]
        with RunFolder.open(out, resume=True) as folder:  # at once: not "busy"
            assert folder.resume_from is None
        assert alive, "the loader workers ended too soon to show anything"
    finally:
        for pid in workers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_overwrite_refuses_to_delete_the_weights_it_starts_from(tmp_path, capsys):
    """``--overwrite --weights <run>/checkpoints/last.pth`` deleted the checkpoint, then
    failed to find it: the user lost it. Refused before anything is deleted; the same
    file outside the folder trains."""
    train = load_tool("train").main
    run = tmp_path / "run"
    args = ["--config", str(TINY_CONFIG), *tiny_overrides(tmp_path / "data", None, "solver.max_iter=1")]
    assert train([*args, "--output-dir", str(run)]) == 0
    capsys.readouterr()
    last = run / "checkpoints" / "last.pth"
    before = last.read_bytes()
    assert train([*args, "--output-dir", str(run), "--overwrite", "--weights", str(last)]) == 1
    assert capsys.readouterr().err.strip() == (
        f"error: --overwrite would delete {last}, the weights this run starts from (model.weights), with the old "
        f"run's files in {run}: copy it out of the folder first, or train into another --output-dir")
    assert last.read_bytes() == before and (run / "metrics.jsonl").exists()
    assert train([*args, "--output-dir", str(tmp_path / "other"), "--overwrite", "--weights", str(last)]) == 0


def test_overwrite_deletes_nothing_when_the_new_run_is_refused(tmp_path, capsys):
    """``--overwrite`` with a typo in a class name deleted the old run's checkpoints, then
    refused the config. The old run is deleted only once the new one is built; a run
    refused by its checks leaves every file of the old one."""
    train = load_tool("train").main
    run = tmp_path / "run"
    args = ["--config", str(TINY_CONFIG), *tiny_overrides(tmp_path / "data", None, "solver.max_iter=1"),
            "--output-dir", str(run)]
    assert train(args) == 0
    capsys.readouterr()
    kept = lambda: {p.relative_to(run): p.read_bytes() for p in run.rglob("*")  # noqa: E731
                    if p.is_file() and p.name not in (".lock", "log.txt")}
    before = kept()
    assert train([*args, "--overwrite", "data.class_names=[circel]"]) == 1
    assert "'circel' is not a category name" in capsys.readouterr().err
    assert kept() == before and (run / "checkpoints" / "last.pth").is_file()
    assert "'circel' is not a category name" in (run / "log.txt").read_text()  # the log is this attempt's
    assert train([*args, "--overwrite", "solver.max_iter=2"]) == 0  # a good run replaces it
    assert torch.load(run / "checkpoints" / "last.pth", weights_only=False)["iteration"] == 2
