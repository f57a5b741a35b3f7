"""detector/messages.py: the one line a library's exception contributes to a message."""

import pytest
import torch

from detector.messages import first_line, typed_first_line


@pytest.mark.parametrize("text,expected", [
    ("file not found", "file not found"),
    ("  bad value\n  full_key: model.x\n", "bad value"),
    ("\n\n  the reason\nmore", "the reason"),  # leading blank lines (omegaconf, ONNX Runtime)
    ("", "RuntimeError"),
    ("  \n ", "RuntimeError"),
])
def test_first_line(text, expected):
    assert first_line(RuntimeError(text)) == expected


def test_typed_first_line():
    assert typed_first_line(ValueError("x2 <= x1\ntrace")) == "ValueError: x2 <= x1"
    assert typed_first_line(KeyError()) == "KeyError"
    assert typed_first_line(OSError("")) == "OSError"


# detector/cli.py: the one way every tool turns an error into one line and an exit status.

import logging  # noqa: E402

from detector.cli import run_tool  # noqa: E402
from detector.config import ConfigError  # noqa: E402
from detector.distributed import LaunchError  # noqa: E402
from detector.engine.checkpointing import CheckpointError  # noqa: E402
from detector.messages import DetectorError  # noqa: E402
from detector.modeling.weights import WeightsError  # noqa: E402


def _raise(exc):
    def body():
        raise exc
    return body


def test_library_errors_share_one_base_and_keep_their_builtin_one():
    assert issubclass(ConfigError, DetectorError) and issubclass(ConfigError, ValueError)
    assert issubclass(WeightsError, DetectorError) and issubclass(WeightsError, ValueError)
    assert issubclass(CheckpointError, DetectorError) and issubclass(CheckpointError, RuntimeError)


@pytest.mark.parametrize("exc,line", [
    (ConfigError("model.num_clases: unknown key; did you mean model.num_classes?"),
     "error: model.num_clases: unknown key; did you mean model.num_classes?"),
    (CheckpointError("runs/x/checkpoints/last.pth: truncated\nmore detail"), "error: runs/x/checkpoints/last.pth: truncated"),
    (FileNotFoundError(2, "No such file or directory", "cfg.yaml"), "error: [Errno 2] No such file or directory: 'cfg.yaml'"),
    (PermissionError(13, "Permission denied", "/out"), "error: [Errno 13] Permission denied: '/out'"),
    (ValueError("bad value"), "error: bad value"),
    (ImportError("eval.backend=faster needs the 'faster-coco-eval' package"),
     "error: eval.backend=faster needs the 'faster-coco-eval' package"),
])
def test_run_tool_expected_errors_one_line_status_1(exc, line, capsys, caplog):
    with caplog.at_level(logging.DEBUG, logger="detector"):
        assert run_tool(_raise(exc)) == 1
    captured = capsys.readouterr()
    assert captured.err == line + "\n" and captured.out == ""
    assert caplog.records[-1].exc_info[1] is exc  # the traceback: to log.txt (DEBUG), not the console


def test_run_tool_status_and_interrupt(capsys):
    assert run_tool(lambda: 0) == 0 and run_tool(lambda: 1) == 1
    assert run_tool(_raise(KeyboardInterrupt()), interrupted="stopped; resume") == 130
    assert capsys.readouterr().err == "error: stopped; resume\n"
    assert run_tool(_raise(LaunchError("reported by rank 0", report=False))) == 1
    assert capsys.readouterr().err == ""  # another rank prints the line


def test_run_tool_lets_bugs_through():
    with pytest.raises(KeyError):
        run_tool(_raise(KeyError("boxes")))
    with pytest.raises(RuntimeError):
        run_tool(_raise(RuntimeError("CUDA error: an illegal memory access")))


def test_running_out_of_memory_is_one_line(capsys):
    # A real failed allocation on the CPU (2**62 bytes: on any machine), and torch's GPU
    # out-of-memory error as the CUDA caching allocator raises it.
    advice = "use smaller batches or images (solver.images_per_gpu, eval.images_per_gpu, the input.* sizes)"
    assert run_tool(lambda: torch.empty(2**62, dtype=torch.uint8)) == 1
    assert capsys.readouterr().err == f"error: out of memory: the CPU could not allocate 4294967296.0 GiB; {advice}\n"
    gpu = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.11 "
                                 "GiB of which 1.06 GiB is free.\nIf reserved but unallocated memory is large ...")
    assert run_tool(_raise(gpu)) == 1
    assert capsys.readouterr().err == ("error: out of memory: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a "
                                       f"total capacity of 79.11 GiB of which 1.06 GiB is free; {advice}\n")
    # numpy's MemoryError (tools/make_shapes.py --min-side 100000 was its traceback), a real one.
    import numpy as np

    assert run_tool(lambda: np.empty(2**62, dtype=np.uint8)) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: out of memory: Unable to allocate 4.00 EiB") and err.endswith(f"; {advice}\n"), err


def test_run_tool_sigterm_keeps_finished_files_and_leaves_no_partial_one(tmp_path, capsys):
    """SIGTERM while a tool writes its second file: status 143, one line, the first file
    whole, the second neither present nor left as a temporary file, the handler restored."""
    import os
    import signal

    from detector.files import atomic_write, write_text

    def body():
        write_text(tmp_path / "first.json", '{"done": true}')

        def writer(f):
            f.write("half of it")
            os.kill(os.getpid(), signal.SIGTERM)
            f.write(" and the rest")  # not reached: the handler raised

        atomic_write(tmp_path / "second.json", writer, mode="w")
        return 0

    before = signal.getsignal(signal.SIGTERM)
    assert run_tool(body) == 143
    assert signal.getsignal(signal.SIGTERM) is before
    err = capsys.readouterr().err
    assert err.startswith("error: stopped by SIGTERM") and err.count("\n") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["first.json"]
    assert (tmp_path / "first.json").read_text() == '{"done": true}'


def test_run_tool_sigterm_while_it_reports_an_error_changes_nothing(capsys):
    """A SIGTERM that arrives once ``body`` has ended (here: while its error is being
    printed, as torchrun's SIGTERM can reach a rank reporting a lost peer) neither raises
    nor replaces the line: the tool ends with its own status."""
    import os
    import signal

    class SignalledWhenPrinted(ValueError):
        def __str__(self):
            os.kill(os.getpid(), signal.SIGTERM)
            return "bad value"

    assert run_tool(_raise(SignalledWhenPrinted())) == 1
    assert capsys.readouterr().err == "error: bad value\n"


@pytest.mark.parametrize("env", [{"WORLD_SIZE": "2"}, {"SLURM_PROCID": "1", "SLURM_NTASKS": "4"}])
def test_run_tool_stops_on_sigterm_in_one_of_several_ranks_too(env, monkeypatch, capsys):
    """Under a launcher of several ranks SIGTERM raises ``Terminated`` as in one process
    (train and eval turn it into the line about a lost peer where one ended): with the
    default action, torchrun's SIGTERM ended a survivor before it printed that line."""
    import os
    import signal

    for key, value in env.items():
        monkeypatch.setenv(key, value)
    before = signal.getsignal(signal.SIGTERM)

    def body() -> int:
        os.kill(os.getpid(), signal.SIGTERM)
        return 0

    assert run_tool(body) == 143
    assert capsys.readouterr().err.startswith("error: stopped by SIGTERM; ")
    assert signal.getsignal(signal.SIGTERM) is before


# argv that each tool's parser answers (exit status): --help, and usage errors.
PARSED_BEFORE_TORCH = {
    "train": [(["--help"], 0), ([], 2), (["--config"], 2)],
    "summary": [(["--help"], 0), (["--config", "c.yaml", "--image-size", "0", "5"], 2)],
    "canvas_sizes": [(["--help"], 0), (["--config", "c.yaml", "--max-canvases", "0"], 2)],
}


@pytest.mark.parametrize("tool", sorted(PARSED_BEFORE_TORCH))
def test_a_tool_answers_help_and_usage_errors_before_importing_torch(tool):
    """``tools/<tool>.py --help`` and its usage errors come from the parser alone: torch
    and the library's commands are imported once the arguments are parsed (6-10 s on a
    small machine). One fresh interpreter parses every argv in turn."""
    import json
    import subprocess
    import sys

    from conftest import ROOT

    cases = PARSED_BEFORE_TORCH[tool]
    probe = (f"import io, json, sys, contextlib; sys.path.insert(0, 'tools'); import {tool}\n"
             "out = []\n"
             "for argv in json.loads(sys.argv[1]):\n"
             "    try:\n"
             "        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):\n"
             f"            {tool}.parse_args(argv)\n"
             "        out.append(None)\n"
             "    except SystemExit as e:\n"
             "        out.append(e.code)\n"
             "print(json.dumps([out, 'torch' in sys.modules]))")
    proc = subprocess.run([sys.executable, "-c", probe, json.dumps([argv for argv, _ in cases])], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    statuses, torch_imported = json.loads(proc.stdout.strip().splitlines()[-1])
    assert statuses == [status for _, status in cases] and not torch_imported, proc.stdout[-2000:]


@pytest.mark.parametrize("tool", ["summary", "train"])
def test_ctrl_c_while_a_tool_imports_is_one_line(tmp_path, tool):
    """Ctrl-C in the seconds a tool imports torch and detector was a KeyboardInterrupt
    traceback through the imports: now the tool's one line and status 130. (train.py
    imports them after parsing its arguments, still before its work.)"""
    import signal
    import subprocess
    import sys
    import time

    from conftest import ROOT

    # SIGTERM in that time ended the process without a word (-15), where a SIGTERM once the
    # tool works is `error: stopped by SIGTERM ...` and 143.
    for sig, status, line in ((signal.SIGINT, 130, "error: interrupted"),
                              (signal.SIGTERM, 143, "error: stopped by SIGTERM while starting; nothing was written")):
        # As a terminal starts it: a test run started in the background (`make test &`)
        # passes on an ignored SIGINT, which Python and the tool rightly leave ignored.
        extra = ["--output-dir", str(tmp_path / "run")] if tool == "train" else []
        proc = subprocess.Popen([sys.executable, str(ROOT / "tools" / f"{tool}.py"), "--config", "configs/tiny_cpu.yaml",
                                 *extra],
                                cwd=ROOT, stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        time.sleep(0.5)  # _bootstrap has run (first import); torch is still importing
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == status and err.strip() == line, (proc.returncode, err[-2000:])


@pytest.mark.parametrize("env", [
    {}, {"WORLD_SIZE": "1"}, {"WORLD_SIZE": "2"}, {"WORLD_SIZE": " 8 "}, {"WORLD_SIZE": "x"},
    {"SLURM_NTASKS": "4"}, {"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}, {"SLURM_PROCID": "3", "SLURM_NTASKS": "4"},
    {"WORLD_SIZE": "1", "SLURM_PROCID": "1", "SLURM_NTASKS": "2"}, {"WORLD_SIZE": "", "SLURM_PROCID": "1", "SLURM_NTASKS": "2"},
])
def test_bootstrap_knows_one_of_several_ranks(env):
    """tools/_bootstrap.py (before any import of the project) reads the world size as
    ``detector.distributed`` does, under torchrun (``WORLD_SIZE``) and under srun."""
    import importlib.util

    from conftest import ROOT

    spec = importlib.util.spec_from_file_location("bootstrap_rule", ROOT / "tools" / "_bootstrap.py")
    bootstrap = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bootstrap)  # not run as a program: it sets no handler
    expected = env.get("WORLD_SIZE", "").strip() not in ("", "1", "x") or (
        not env.get("WORLD_SIZE") and int(env.get("SLURM_NTASKS", "1")) > 1 and "SLURM_PROCID" in env)
    assert bootstrap.one_of_several_ranks(env) == expected


def test_sigterm_while_a_rank_of_srun_imports_keeps_its_default(tmp_path):
    """Under srun (SLURM_PROCID, SLURM_NTASKS > 1) as under torchrun, SIGTERM during the
    imports keeps its default: the launcher's SIGTERM to survivors prints nothing."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from conftest import ROOT

    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")}
    env.update(SLURM_PROCID="1", SLURM_NTASKS="2")
    proc = subprocess.Popen([sys.executable, str(ROOT / "tools" / "summary.py"), "--config", "configs/tiny_cpu.yaml"],
                            cwd=ROOT, stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    time.sleep(0.5)  # _bootstrap has run; torch is still importing
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGTERM and err == "", (proc.returncode, err[-2000:])
