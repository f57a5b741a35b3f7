"""Training checkpoints: atomic writes, weights_only loading, RNG states, pruning."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from detector.engine.checkpointing import (
    CheckpointError,
    find_resume_checkpoint,
    get_rng_state,
    load_checkpoint,
    numbered_checkpoint_name,
    prune_checkpoints,
    save_checkpoint,
    set_rng_state,
)

from conftest import ROOT  # noqa: E402


def test_save_is_loadable_with_weights_only_and_leaves_no_temp(tmp_path):
    state = {"model": {"w": torch.arange(6.0).reshape(2, 3)}, "iteration": 7, "config": {"a": [1, 2], "b": None},
             "rng": get_rng_state()}
    path = save_checkpoint(tmp_path / "checkpoints" / "last.pth", state)
    loaded = torch.load(path, weights_only=True)
    assert torch.equal(loaded["model"]["w"], state["model"]["w"]) and loaded["iteration"] == 7
    assert loaded["config"] == {"a": [1, 2], "b": None}
    assert sorted(p.name for p in path.parent.iterdir()) == ["last.pth"]


def test_rng_state_round_trip(tmp_path):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    state = get_rng_state()
    save_checkpoint(tmp_path / "r.pth", {"rng": state})
    first = (random.random(), np.random.rand(3).tolist(), torch.rand(3).tolist())
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    set_rng_state(load_checkpoint(tmp_path / "r.pth")["rng"])
    assert (random.random(), np.random.rand(3).tolist(), torch.rand(3).tolist()) == first


def test_writer_killed_mid_save_leaves_previous_file(tmp_path):
    """A child process saves last.pth once, then is SIGKILLed half-way through writing
    the next one: the first last.pth must still load, intact."""
    script = textwrap.dedent(f"""
        import os, signal, torch
        import detector.engine.checkpointing as ck
        path = {str(tmp_path / 'last.pth')!r}
        ck.save_checkpoint(path, {{"model": {{"w": torch.ones(1000)}}, "iteration": 1}})
        real_save = torch.save
        def dying_save(obj, f, *a, **k):
            f.write(b"PK\\x03\\x04 half a zip file")   # start writing, then die
            f.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        torch.save = dying_save
        ck.save_checkpoint(path, {{"model": {{"w": torch.zeros(1000)}}, "iteration": 2}})
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr
    state = load_checkpoint(tmp_path / "last.pth")
    assert state["iteration"] == 1 and torch.equal(state["model"]["w"], torch.ones(1000))
    # The stray temporary file does not stop the next save.
    save_checkpoint(tmp_path / "last.pth", {"iteration": 3})
    assert load_checkpoint(tmp_path / "last.pth")["iteration"] == 3


def test_failed_save_removes_temp_and_keeps_previous(tmp_path, monkeypatch):
    save_checkpoint(tmp_path / "last.pth", {"iteration": 1})

    def failing_save(obj, f, *a, **k):
        f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", failing_save)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(tmp_path / "last.pth", {"iteration": 2})
    monkeypatch.undo()
    assert [p.name for p in tmp_path.iterdir()] == ["last.pth"]
    assert load_checkpoint(tmp_path / "last.pth")["iteration"] == 1


def test_unsafe_or_broken_files_give_one_line_errors(tmp_path):
    import pickle

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    (tmp_path / "evil.pth").write_bytes(pickle.dumps({"x": Evil()}, protocol=2))
    with pytest.raises(CheckpointError) as e:
        load_checkpoint(tmp_path / "evil.pth")
    assert str(tmp_path / "evil.pth") in str(e.value) and "\n" not in str(e.value)
    (tmp_path / "cut.pth").write_bytes(b"PK\x03\x04garbage")
    with pytest.raises(CheckpointError, match="cannot load checkpoint .*cut.pth"):
        load_checkpoint(tmp_path / "cut.pth")
    with pytest.raises(CheckpointError, match="checkpoint not found: .*nope.pth"):
        load_checkpoint(tmp_path / "nope.pth")


def test_prune_and_find(tmp_path):
    d = tmp_path / "checkpoints"
    assert find_resume_checkpoint(tmp_path) is None
    for it in (100, 200, 300, 400):
        save_checkpoint(d / numbered_checkpoint_name(it), {"iteration": it})
    assert find_resume_checkpoint(tmp_path).name == "iter_0000400.pth"
    save_checkpoint(d / "best.pth", {"iteration": 200})
    save_checkpoint(d / "last.pth", {"iteration": 400})
    removed = prune_checkpoints(d, keep_last=2)
    assert sorted(p.name for p in removed) == ["iter_0000100.pth", "iter_0000200.pth"]
    assert sorted(p.name for p in d.iterdir()) == ["best.pth", "iter_0000300.pth", "iter_0000400.pth", "last.pth"]
    assert find_resume_checkpoint(tmp_path).name == "last.pth"
    assert prune_checkpoints(d, keep_last=0) == []
