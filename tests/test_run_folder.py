"""The run folder: the lock, refusals of used folders, --resume on an empty folder,
--overwrite, stale temporary files."""

from __future__ import annotations

import logging

import pytest

from detector.engine.checkpointing import save_checkpoint
from detector.engine.run_folder import RunFolder, RunFolderError


def test_second_open_of_a_busy_folder_is_refused(tmp_path):
    out = tmp_path / "run"
    with RunFolder.open(out) as first:
        assert first.resume_from is None
        with pytest.raises(RunFolderError) as e:
            RunFolder.open(out, resume=True)
        msg = str(e.value)
        assert "\n" not in msg and "busy" in msg and str(out) in msg and "pid" in msg
    with RunFolder.open(out, resume=True):  # released by close()
        pass


def test_fresh_start_into_a_used_folder_is_refused_with_the_choices(tmp_path):
    out = tmp_path / "run"
    for name in ("iter_0000100.pth", "iter_0000200.pth", "last.pth", "best.pth"):
        save_checkpoint(out / "checkpoints" / name, {"iteration": 200})
    with pytest.raises(RunFolderError) as e:
        RunFolder.open(out)
    msg = str(e.value)
    assert "\n" not in msg and str(out) in msg and "already holds checkpoints" in msg
    assert "best.pth, iter_0000100.pth, iter_0000200.pth and 1 more" in msg
    assert "--resume" in msg and "--output-dir" in msg and "--overwrite" in msg
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [
        "best.pth", "iter_0000100.pth", "iter_0000200.pth", "last.pth"]  # nothing touched
    with RunFolder.open(out, resume=True) as folder:
        assert folder.resume_from == out / "checkpoints" / "last.pth"


def test_overwrite_clears_the_old_run(tmp_path):
    out = tmp_path / "run"
    save_checkpoint(out / "checkpoints" / "last.pth", {"iteration": 5})
    (out / ".lock").write_text("")  # a run of this project used the folder
    (out / "metrics.jsonl").write_text('{"iteration": 5}\n')
    (out / "tb").mkdir()
    (out / "tb" / "events.out.tfevents.1.old").write_bytes(b"old")
    (out / "eval" / "iter_0000005").mkdir(parents=True)
    (out / "config.yaml").write_text("model: {}\n")
    with RunFolder.open(out, overwrite=True) as folder:
        assert folder.resume_from is None
        assert (out / "checkpoints" / "last.pth").is_file()  # nothing deleted before the new run is built
        folder.clear_previous_run()
        assert sorted(p.name for p in out.iterdir()) == [".lock", "config.yaml"]
    with pytest.raises(RunFolderError, match="--resume and --overwrite exclude each other"):
        RunFolder.open(out, resume=True, overwrite=True)


def test_resume_on_an_empty_folder_starts_fresh_and_says_so(tmp_path, caplog):
    out = tmp_path / "run"
    out.mkdir()
    (out / ".lock").write_text("")
    (out / "metrics.jsonl").write_text('{"iteration": 3}\n')  # a run killed before its first checkpoint
    with caplog.at_level(logging.INFO, logger="detector.engine"):
        with RunFolder.open(out, resume=True) as folder:
            assert folder.resume_from is None
            folder.clear_previous_run()
            assert not (out / "metrics.jsonl").exists()  # its records would mix with the new run's
    assert "no checkpoint to continue" in caplog.text and "starting a fresh run" in caplog.text
    with pytest.raises(RunFolderError, match=r"^--resume: checkpoint not found: .*nope\.pth$"):
        RunFolder.open(out, resume=str(tmp_path / "nope.pth"))


def test_stale_temporary_files_are_removed(tmp_path, caplog):
    out = tmp_path / "run"
    save_checkpoint(out / "checkpoints" / "last.pth", {"iteration": 1})
    stale = [out / "checkpoints" / ".last.pth.1234.tmp", out / "checkpoints" / ".iter_0000002.pth.99.tmp",
             out / "metrics.jsonl.tmp"]
    for p in stale:
        p.write_bytes(b"x" * 1000)
    with caplog.at_level(logging.INFO, logger="detector.engine"):
        with RunFolder.open(out, resume=True):
            pass
    assert not any(p.exists() for p in stale) and (out / "checkpoints" / "last.pth").is_file()
    assert "removed 3 stale temporary files" in caplog.text


def test_unusable_output_dir_is_one_line(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(RunFolderError) as e:
        RunFolder.open(blocker / "run")
    assert "\n" not in str(e.value) and f"train.output_dir={blocker / 'run'}" in str(e.value)


def test_a_folder_no_run_used_keeps_the_users_files(tmp_path):
    """A fresh start into a folder that holds eval/ or log.txt of the user's own (no
    .lock: no run of this project used it) deleted them with the old run's records."""
    out = tmp_path / "project"
    (out / "eval").mkdir(parents=True)
    (out / "eval" / "notes.py").write_text("mine")
    (out / "log.txt").write_text("mine")
    with pytest.raises(RunFolderError) as e:
        RunFolder.open(out)
    assert str(e.value) == (f"train.output_dir {out} holds eval, but no run of this project used it (it has "
                            "no .lock): a run would replace them; choose another --output-dir (a new or empty folder)")
    assert sorted(p.name for p in out.iterdir()) == ["eval", "log.txt"]  # not even a .lock left
    assert (out / "eval" / "notes.py").read_text() == "mine"
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "data.csv").write_text("x")  # names a run never writes: fine
    (tmp_path / "other" / "log.txt").write_text("mine\n")  # a log is appended to, not replaced
    with RunFolder.open(tmp_path / "other") as folder:
        folder.clear_previous_run()
    assert (tmp_path / "other" / "data.csv").read_text() == "x"
    assert (tmp_path / "other" / "log.txt").read_text() == "mine\n"


def test_resume_from_another_folder_into_a_folder_with_its_own_run_is_refused(tmp_path):
    """--resume <another run's checkpoint> into a folder holding checkpoints replaced that
    folder's run (its last.pth, its metrics) without a word."""
    mine, other = tmp_path / "mine", tmp_path / "other"
    for run in (mine, other):
        save_checkpoint(run / "checkpoints" / "last.pth", {"iteration": 4})
        (run / ".lock").write_text("")
    with pytest.raises(RunFolderError) as e:
        RunFolder.open(mine, resume=str(other / "checkpoints" / "last.pth"))
    assert f"run folder {mine} holds checkpoints of its own (last.pth)" in str(e.value)
    assert f"--resume {mine / 'checkpoints' / 'last.pth'}" in str(e.value)
    with RunFolder.open(tmp_path / "new", resume=str(other / "checkpoints" / "last.pth")) as folder:
        assert folder.resume_from == other / "checkpoints" / "last.pth"  # a new folder: fine
    with RunFolder.open(mine, resume=str(mine / "checkpoints" / "last.pth")) as folder:
        assert folder.resume_from == mine / "checkpoints" / "last.pth"  # its own checkpoint: fine
