"""Every shell command of README.md and docs/*.md is checked (issue 24, item 1).

The commands are read from the markdown (indented and fenced code blocks), so a new one
cannot escape: each must match a rule below, either RUN (executed as written, after the
README's ``source .venv/bin/activate``, with only size overrides, offline; the slow test)
or NOT_RUN with the reason. Every command is also checked dry, fast: its arguments are
parsed by the tool's own parser (torchrun's for torchrun), the config it names is loaded
with its overrides (unknown keys and wrong types fail), ``make`` targets exist, and the
versions a command installs are the ones CI tests.

A ``$ command`` line followed by output lines (a transcript) is run and its output
compared with the text shown.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import io
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import pytest
import torch
from torch.distributed.run import get_args_parser as torchrun_parser
from torchvision.models.detection import FasterRCNN_ResNet50_FPN_Weights, fasterrcnn_resnet50_fpn

from conftest import load_tool
from detector.config import load_config

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PROGRAMS = ("python", "python3", "torchrun", "make", "tensorboard", "pip", "srun", "for", "source", ".venv/bin/")
# Shell variables the commands use, and a value to check them with.
SHELL_VARS = {"HEAD": "127.0.0.1", "n": "0", "SLURM_NNODES": "2", "SLURM_JOB_ID": "1",
              "SLURM_JOB_NODELIST": "node1", "R50": "", "R": "../shared/data/real/coco2017_16",
              "OUT": "/tmp/out"}  # OUT: the folder a lent GPU machine returns (docs/performance.md)
# Tokens of a usage synopsis that stand for the user's own value.
PLACEHOLDERS = {"C", "W", "O", "F", "K", "...", "CKPT", "OUT", "H", "N", "TASK", "dets.json", "instances.json",
                "instances_val2017.json", "gt.json", "photo.jpg_or_folder", "configs/my_data.yaml"}


@dataclass(frozen=True)
class DocCommand:
    where: str  # file:line
    text: str   # one command line: continuations joined, comments removed

    def __str__(self) -> str:
        return f"{self.where}: {self.text}"


def _starts_command(text: str) -> bool:
    text = re.sub(r"^\$ ", "", text)
    text = re.sub(r"^([A-Z_]+=\S*\s+)+", "", text)  # VAR=value prefixes
    return text.startswith(PROGRAMS) and not text.startswith("python3 -c")


def _strip_comment(line: str) -> str:
    return re.sub(r"\s+#\s.*$", "", line).rstrip()


def doc_commands(path: Path) -> List[DocCommand]:
    """The shell commands of one markdown file: lines of fenced blocks (no language, bash,
    sh, console) and of indented blocks that start with a known program."""
    lines = path.read_text().splitlines()
    out: List[DocCommand] = []
    fence: Optional[str] = None
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.lstrip().startswith("```"):
            fence = None if fence is not None else line.strip()[3:]
            i += 1
            continue
        in_block = fence in ("", "bash", "sh", "shell", "console") if fence is not None else line.startswith("    ")
        text = _strip_comment(line.strip())
        if not (in_block and _starts_command(text)):
            i += 1
            continue
        start = i
        parts = [text]
        while parts[-1].endswith("\\") or (parts[0].startswith("for ") and not parts[-1].startswith("done")):
            parts[-1] = parts[-1].rstrip("\\").rstrip()
            i += 1
            parts.append(_strip_comment(lines[i].strip()))
        out.append(DocCommand(f"{path.relative_to(ROOT)}:{start + 1}", " ".join(p for p in parts if p)))
        i += 1
    return out


ALL = [c for path in DOCS for c in doc_commands(path)]

# Commands run by test_commands_run_as_written (in this order: make demo first, then the
# commands that use its run folder). Each: pattern -> (replacements, appended overrides),
# sizes only.
DEMO_SIZES = ("data.shapes.num_train=8 data.shapes.num_val=4 solver.max_iter=2 solver.warmup_iters=1 "
              "solver.steps=[1] train.log_period=1")
SMALL_TEST = ["input.min_size_test=128", "input.max_size_test=160"]
RUN: List[Tuple[str, Dict[str, str], List[str]]] = [
    (r"^make demo$", {}, []),
    (r"^python tools/eval\.py +--config runs/demo/config\.yaml --weights runs/demo/checkpoints/best\.pth --output-dir",
     {}, []),
    (r"^python tools/infer\.py --config runs/demo/config\.yaml --weights runs/demo/", {}, []),
    (r"^python tools/export\.py --config runs/demo/config\.yaml --weights runs/demo/", {}, []),
    (r"^tensorboard --logdir runs/$", {"--logdir runs/": "--version"}, []),  # a server: its start is checked
    (r"^python tools/make_shapes\.py ", {"--train 600 --val 100": "--train 3 --val 2"}, []),
    (r"^python tools/summary\.py --config configs/\S+ model\.num_classes=80( |$)", {}, SMALL_TEST),
    (r"^python tools/browse_dataset\.py --config configs/tiny_cpu\.yaml ", {},
     ["data.shapes.num_train=8", "data.shapes.num_val=4", "input.lsj.size=128"]),
    (r"^python tools/train\.py --config configs/finetune_torchvision_coco\.yaml",
     {"model.num_classes=K ...": "model.num_classes=3"},
     [*DEMO_SIZES.split(), "data.train.root=runs/shapes_data", "data.val.root=runs/shapes_data",
      "input.min_size_train=[128]", "input.max_size_train=160", *SMALL_TEST, "data.num_workers=0"]),
]
# Commands not run here, and why. Each is still checked dry (test_commands_parse).
NOT_RUN: List[Tuple[str, str]] = [
    (r"^make (test|test-fast)$", "the test suite itself (CI: .ci/run)"),
    (r"^python tools/eval\.py --config runs/demo/config\.yaml --weights runs/demo/checkpoints/best\.pth$",
     "the README's evaluation of the demo without its --output-dir: run as the README writes it"),
    (r"^make setup$|^python3 -m venv |pip install |pip download ", "installs from the network"),
    (r"^source \.venv/bin/activate$", "the shell's environment: the tests run with the venv's python"),
    (r"^\$ ", "a transcript: run by test_transcripts_match"),
    (r"--nproc_per_node=8|--gpus|--nnodes=\$SLURM|^srun ", "needs 8 GPUs, several nodes or SLURM"),
    (r"^for n in 0 1; do torchrun --nnodes=2 ",
     "two agents on one machine: run by tests/test_resume_elastic.py::test_two_nodes_train_to_the_end"),
    (r"^torchrun --nproc_per_node=2 tools/train\.py .*train\.dist_backend=gloo", "needs a GPU (tests/test_gpu_dist.py)"),
    (r"/data/VOCdevkit|/data/mine", "the user's data: run on real data by tests/test_own_data.py (realdata)"),
    (r"^python tools/eval\.py --predictions \.\./shared/data/real/coco_eval_val2014_100/",
     "the project's real data folder (absent in a clone): run by "
     "tests/test_error_analysis.py::test_analysis_on_the_real_coco_results_file (realdata)"),
    (r"tools/benchmark\.py|detector\.benchmark\.|benchmarks[./]|^python tests/cases\.py ",
     "a measurement of minutes (docs/performance.md); tested by tests/test_benchmark*.py"),
    (r"^make gpu-check$|^python tools/gpu_check\.py|python3 tools/gpu_check\.py", "needs a CUDA GPU; without one, its one line, its plan "
     "(--list) and its budget are tested by tests/test_gpu_check.py"),
    (r"faster_rcnn_r50_fpn_1x_coco\.yaml --resume|configs/faster_rcnn_r50_fpn_1x_coco\.yaml$",
     "a COCO training run (the COCO download)"),
    (r"(^| )(C|W|O|K|\.\.\.)( |$)|runs/x/|dets\.json|instances\.json|my_data\.yaml|photo\.jpg|VOCdevkit/",
     "a usage synopsis: placeholders for the user's files"),
]


def run_rule(cmd: DocCommand) -> Optional[Tuple[Dict[str, str], List[str]]]:
    return next(((rep, extra) for pat, rep, extra in RUN if re.search(pat, cmd.text)), None)


def not_run_reason(cmd: DocCommand) -> Optional[str]:
    return next((why for pat, why in NOT_RUN if re.search(pat, cmd.text)), None)


# ----------------------------------------------------------------------------- dry checks
def _substitute(text: str) -> str:
    """Shell variables and substitutions replaced by check values; a synopsis' optional
    ``[...]`` groups removed and ``a|b`` choices reduced to the first."""
    text = re.sub(r"\$\([^)]*\)", "node1", text)

    def var(m: re.Match) -> str:
        assert m.group(1) in SHELL_VARS, f"add shell variable ${m.group(1)} to SHELL_VARS"
        return SHELL_VARS[m.group(1)]

    text = re.sub(r"\$\{?([A-Za-z_]\w*)\}?", var, text)
    while True:
        shorter = re.sub(r"\s\[(--|key|CKPT)[^\[\]]*\]", "", text)
        if shorter == text:
            break
        text = shorter
    return re.sub(r"(?<=[\s=])(\w+)(\|\w+)+", r"\1", text)


def _argv(text: str) -> List[str]:
    """The argv of one command: the for-loop's body, without VAR=value prefixes and srun."""
    text = re.sub(r"^for \w+ in [^;]*; do (.*?) &? ?done.*$", r"\1", _substitute(text))
    argv = shlex.split(text.rstrip("& "))
    while argv and re.match(r"^[A-Z_]+=", argv[0]):
        argv.pop(0)
    if argv and argv[0] == "srun":
        argv.pop(0)
        while argv and argv[0].startswith("-"):
            argv.pop(0)
    return argv


@functools.lru_cache(maxsize=None)
def _help(program: Tuple[str, ...]) -> subprocess.CompletedProcess:
    """``program --help``, run once per program (a fresh interpreter costs seconds)."""
    return _run([*program, "--help"], ROOT, {"PYTHONPATH": str(ROOT)})


@functools.lru_cache(maxsize=None)
def _tool_help(name: str) -> str:
    """``tools/<name>.py --help`` from its own parser, in this process (a fresh
    interpreter costs 6 s of imports on a small machine; several docs synopses per tool)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as info:
        load_tool(name).parse_args(["--help"])
    assert info.value.code == 0, f"tools/{name}.py --help exited {info.value.code}"
    return out.getvalue()


@functools.lru_cache(maxsize=None)
def _module_help(module: str) -> str:
    """``python -m benchmarks.X --help`` from the module's own ``main(argv)``, in this
    process (as :func:`_tool_help`)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as info:
        importlib.import_module(module).main(["--help"])
    assert info.value.code == 0, f"python -m {module} --help exited {info.value.code}"
    return out.getvalue()


def _check_flags_in_help(program: List[str], argv: List[str], where: str) -> None:
    script = Path(program[-1])
    if script.parent == ROOT / "tools" and hasattr(load_tool(script.stem), "parse_args"):
        text = _tool_help(script.stem)
    elif program[-2:-1] == ["-m"] and program[-1].startswith("benchmarks."):
        text = _module_help(program[-1])
    else:
        proc = _help(tuple(program))
        assert proc.returncode == 0, f"{where}: {program} --help failed: {proc.stderr[-2000:]}"
        text = proc.stdout
    for flag in [a.split("=")[0] for a in argv if a.startswith("--")]:
        assert flag in text, f"{where}: {program[-1]} --help does not know {flag}"


def _parse_tool(argv: List[str], where: str) -> None:
    """``tools/X.py args``: the tool's parser accepts them; the config loads with them."""
    script = Path(argv[0])
    assert (ROOT / script).is_file(), f"{where}: no such script {script}"
    if script.parts[0] != "tools" or PLACEHOLDERS & set(argv):  # a generator, or a synopsis
        _check_flags_in_help([sys.executable, str(ROOT / script)], argv, where)
        return
    tool = load_tool(script.stem)
    if hasattr(tool, "parse_args"):
        try:
            args = tool.parse_args(argv[1:])
        except SystemExit as e:
            pytest.fail(f"{where}: {script} refuses its arguments {argv[1:]} (exit {e.code})")
        config = getattr(args, "config", None)
        overrides = list(getattr(args, "overrides", None) or [])
    else:  # a tool whose parser is built inside main: its --help names every option
        _check_flags_in_help([sys.executable, str(ROOT / script)], argv, where)
        config = argv[argv.index("--config") + 1] if "--config" in argv else None
        overrides = [a for a in argv[1:] if "=" in a and not a.startswith("-")]
    if config and (ROOT / config).is_file() and not PLACEHOLDERS & set(argv):
        load_config(ROOT / config, overrides)


def check_dry(cmd: DocCommand) -> None:
    argv = _argv(cmd.text)
    prog = argv[0]
    if prog in ("python", "python3") and argv[1] == "-m":
        if argv[2] != "venv":  # pip's flags are its subcommand's
            module = argv[2:4] if argv[2] == "pip" and len(argv) > 3 else argv[2:3]
            _check_flags_in_help([sys.executable, "-m", *module], argv, cmd.where)
    elif prog == "python":
        _parse_tool(argv[1:], cmd.where)
    elif prog == "torchrun":
        args = torchrun_parser().parse_args(argv[1:])
        assert not (args.node_rank and args.rdzv_backend != "static"), \
            f"{cmd}: --node-rank is only used by the static rendezvous (torchrun warns)"
        _parse_tool([args.training_script, *args.training_script_args], cmd.where)
    elif prog == "make":
        for target in argv[1:]:
            assert re.search(rf"^{re.escape(target)}:", (ROOT / "Makefile").read_text(), re.M), \
                f"{cmd}: no make target {target}"
    elif "pip" in prog and "install" in argv:
        pins = dict(re.findall(r"^(TORCH|TORCHVISION)\s*\?=\s*(\S+)", (ROOT / "Makefile").read_text(), re.M))
        for name, version in re.findall(r"(torch|torchvision)==(\S+)", cmd.text):
            assert version == pins[name.upper()], f"{cmd}: {name}=={version}, the Makefile pins {pins[name.upper()]}"
        for extra in re.findall(r"\.\[([\w,]+)\]", cmd.text):
            for name in extra.split(","):
                assert f"\n{name} = [" in (ROOT / "pyproject.toml").read_text(), f"{cmd}: no extra {name!r}"
    elif prog == "tensorboard":
        assert (Path(sys.executable).parent / "tensorboard").is_file(), f"{cmd}: tensorboard not in the venv"
    elif prog == "source":  # the venv, or the offline GPU machine's environment (../shared/gpu/README.md)
        assert argv[1] in (".venv/bin/activate", ".shared/gpu/env.sh"), cmd


@pytest.mark.parametrize("cmd", ALL, ids=str)
def test_every_command_is_run_or_has_a_reason(cmd):
    rule, reason = run_rule(cmd), not_run_reason(cmd)
    assert rule or reason, (f"{cmd}\nis neither run nor excused: add it to RUN (with size overrides) or NOT_RUN "
                            "(with the reason) in tests/test_docs_commands.py")


def test_every_rule_matches_a_command():
    texts = [c.text for c in ALL]
    for pat in [p for p, _, _ in RUN] + [p for p, _ in NOT_RUN]:
        assert any(re.search(pat, t) for t in texts), f"rule {pat!r} matches no command of the docs"


@pytest.mark.parametrize("cmd", [c for c in ALL if not c.text.startswith("$ ")], ids=str)
def test_commands_parse(cmd):
    check_dry(cmd)


def test_readme_activates_the_venv_before_its_commands():
    """After `make demo`, the README's next commands (python, tensorboard) are the venv's."""
    readme = [c for c in ALL if c.where.startswith("README.md")]
    first_python = next(i for i, c in enumerate(readme) if c.text.startswith(("python ", "tensorboard")))
    assert any(c.text == "source .venv/bin/activate" for c in readme[:first_python]), readme[:first_python]


# ----------------------------------------------------------------------------- running them
def _run(argv: List[str], cwd: Path, env: Optional[dict] = None, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "NO_ALBUMENTATIONS_UPDATE": "1", **(env or {})}
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    return proc


def _transcripts() -> List[Tuple[str, str, List[str]]]:
    """(where, command, expected output lines) of each ``$ command`` followed by output."""
    out = []
    for path in DOCS:
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            if line.startswith("    $ "):
                shown = []
                for nxt in lines[i + 1:]:
                    if not nxt.startswith("    ") or nxt.startswith("    $ "):
                        break
                    shown.append(nxt[4:])
                out.append((f"{path.relative_to(ROOT)}:{i + 1}", line[6:], shown))
    return out


@pytest.mark.parametrize("where, command, shown", _transcripts(), ids=lambda x: x if isinstance(x, str) else "")
def test_transcripts_match(where, command, shown, tmp_path):
    argv = _argv(command)
    assert argv[0] == "python", where
    proc = _run([sys.executable, *argv[1:]], ROOT, {"PYTHONPATH": str(ROOT)}, timeout=300)
    assert (proc.stdout + proc.stderr).strip().splitlines() == shown, f"{where}: the docs show another output"


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory) -> Path:
    """A working folder like a fresh clone's: configs/ and tools/ of this checkout, runs/ its own."""
    box = tmp_path_factory.mktemp("docs_sandbox")
    for name in ("configs", "tools", "detector", "Makefile", "pyproject.toml"):
        (box / name).symlink_to(ROOT / name)
    return box


def _stand_in_coco_weights(torch_home: Path) -> None:
    """torchvision's COCO Faster R-CNN file, randomly initialised, where the download would
    put it (nothing is downloaded; torchvision checks the hash of downloads only)."""
    url = FasterRCNN_ResNet50_FPN_Weights.COCO_V1.url
    target = torch_home / "hub" / "checkpoints" / url.rsplit("/", 1)[1]
    target.parent.mkdir(parents=True, exist_ok=True)
    torch.save(fasterrcnn_resnet50_fpn(weights=None, weights_backbone=None).state_dict(), target)


@pytest.mark.slow
def test_commands_run_as_written(sandbox, tmp_path):
    venv = Path(sys.executable).parent.parent
    bin_dir = Path(sys.executable).parent
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "TORCH_HOME": str(tmp_path / "torch_home"),
           "https_proxy": "http://127.0.0.1:9", "HTTPS_PROXY": "http://127.0.0.1:9"}  # offline
    _stand_in_coco_weights(tmp_path / "torch_home")
    make = [shutil.which("make") or "make", "-o", str(venv / ".installed"), f"VENV={venv}", f"ARGS={DEMO_SIZES}"]
    ran = set()
    for pat, rep, extra in RUN:
        for cmd in [c for c in ALL if re.search(pat, c.text)]:
            if cmd.text in ran:
                continue
            ran.add(cmd.text)
            text = cmd.text
            for old, new in rep.items():
                text = text.replace(old, new)
            argv = _argv(text) + extra
            argv = make + argv[1:] if argv[0] == "make" else argv
            proc = _run(argv, sandbox, env)
            output = proc.stdout + proc.stderr
            assert proc.returncode == 0 and "Traceback" not in output, f"{cmd}\n{output[-3000:]}"
            if cmd.text == "make demo":
                assert (sandbox / "runs/demo/checkpoints/best.pth").is_file()
                assert output.count("COCO bbox (IoU") == 1, output[-3000:]  # the final metrics, printed once
                assert output.count("AR100") == 1 and "val metrics" not in output, output[-3000:]
                long = [line for line in output.splitlines() if len(line) > 120 and " tools/train.py " not in line]
                assert not long, long  # (make echoes its command line)
                again = _run(argv, sandbox, env)  # a second `make demo` re-evaluates the finished run
                text = again.stdout + again.stderr
                assert again.returncode == 0 and "resumed from" in text, text[-3000:]
                assert text.count("COCO bbox (IoU") == 1 and "finished at iteration 2" in text, text[-3000:]
