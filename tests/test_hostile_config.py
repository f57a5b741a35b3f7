"""Hostile config files and command lines: each is one ``error:`` line naming the file
or key, from ``tools/train.py`` run in-process, before any work starts (issue 23, part 4).

One mechanism per class:
- the YAML reader (``detector.config.yaml_reader.StrictLoader``) bounds nesting and the
  size with aliases expanded, and refuses a key given twice;
- ``base:`` must be one file name;
- every integer key is bounded in the schema (int64 unless tighter: the seed's 32 bits,
  image sizes up to ``MAX_IMAGE_SIDE``), and ``train.device`` must exist here;
- ``detector.engine.memory.check_batch_memory`` refuses a batch that cannot fit;
- overrides may follow ``--resume CKPT``.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from conftest import TINY_CONFIG, load_tool, tiny_overrides
from detector.config import ConfigError, config_from_dict, config_to_dict, load_config, save_config
from detector.config.schema import MAX_IMAGE_SIDE
from detector.engine.memory import GIB, batch_bytes, check_batch_memory

# A billion-laughs bomb for YAML: 9 levels of 9 aliases each, about 9**9 strings expanded.
ALIAS_BOMB = "a: &a [x,x,x,x,x,x,x,x,x]\n" + "".join(
    f"{c}: &{c} [{', '.join(['*' + p] * 9)}]\n" for p, c in zip("abcdefgh", "bcdefghi"))


@pytest.fixture(scope="module")
def train_tool():
    return load_tool("train")


def run_train(train_tool, capsys, config: Path, *overrides: str, output_dir: Path) -> str:
    """``tools/train.py --config config overrides``: asserts exit status 1 and one
    ``error:`` line on stderr; returns that line."""
    argv = ["--config", str(config), "--output-dir", str(output_dir), *overrides]
    status = train_tool.main(argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert status == 1, err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    return lines[0]


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


# --------------------------------------------------------------------------- YAML files


@pytest.mark.parametrize("base", ["[a.yaml, b.yaml]", "3", "{file: a.yaml}", "true"])
def test_base_that_is_not_a_file_name(train_tool, capsys, tmp_path, base):
    cfg = write(tmp_path / "c.yaml", f"base: {base}\nsolver: {{lr: 0.1}}\n")
    line = run_train(train_tool, capsys, cfg, output_dir=tmp_path / "run")
    assert str(cfg) in line and "'base:' names one config file" in line


@pytest.mark.parametrize("base", ['""', "'  '"])
def test_an_empty_base_is_refused_not_the_defaults(tmp_path, base):
    """base: "" read as no base: the schema's defaults (R50, COCO, 90000 iterations)."""
    cfg = write(tmp_path / "c.yaml", f"base: {base}\nsolver: {{lr: 0.1}}\n")
    with pytest.raises(ConfigError, match=f"^{cfg}: 'base:' is empty: name a config file, or leave the key out$"):
        load_config(cfg)


@pytest.mark.parametrize("text", ["", "\n\n", "# solver: {lr: 0.1}\n# model: {num_classes: 3}\n", "~\n"],
                         ids=["empty", "blank", "comments_only", "null"])
def test_config_file_without_settings_is_refused(train_tool, capsys, tmp_path, text):
    """An empty file is more likely one that failed to save than a wish for every default
    (the R50-FPN COCO recipe's); ``{}`` still means every default."""
    cfg = write(tmp_path / "empty.yaml", text)
    line = run_train(train_tool, capsys, cfg, output_dir=tmp_path / "run")
    assert str(cfg) in line and "holds no settings" in line and "write {}" in line
    assert load_config(write(tmp_path / "defaults.yaml", "{}\n")) == load_config(None)


@pytest.mark.parametrize("encoding", ["utf-8-sig", "utf-16", "utf-16-le", "utf-32"])
def test_config_file_in_any_unicode_encoding_reads_as_utf8(tmp_path, encoding):
    """YAML text may be UTF-8 (a Windows editor adds a byte-order mark), UTF-16 or UTF-32;
    each reads as its UTF-8 twin (the base chain and a non-ASCII value included)."""
    text = f"base: {TINY_CONFIG}\nsolver:\n  max_iter: 7\ndata:\n  class_names: [katze, hund, \u732b]\n"
    plain = write(tmp_path / "plain.yaml", text)
    other = tmp_path / f"{encoding}.yaml"
    other.write_bytes(text.encode(encoding))
    assert load_config(other) == load_config(plain)
    assert load_config(other).data.class_names == ["katze", "hund", "\u732b"]


def test_a_leading_tilde_in_a_path_key_is_the_home_folder(tmp_path, monkeypatch):
    """``~`` in a YAML file, or after ``key=`` on a command line, reaches no shell: the path
    keys expand it (the data paths, the run folder, the record cache, the weights); other
    keys and a ``~`` inside a path are left as they are."""
    monkeypatch.setenv("HOME", str(tmp_path / "me"))
    cfg = load_config(write(tmp_path / "c.yaml", "data:\n  train: {root: ~/coco/train2017, ann_file: ~/coco/a.json}\n"
                            "  cache_dir: ~/cache\ntrain:\n  output_dir: ~/runs/x\n"),
                      ["data.val.root=~/coco/val2017", "model.weights=~/w.pth", "data.val.ann_file=a~/b.json",
                       "data.val.split=~/not/a/path"])
    home = tmp_path / "me"
    assert (cfg.data.train.root, cfg.data.train.ann_file, cfg.data.val.root) == (
        f"{home}/coco/train2017", f"{home}/coco/a.json", f"{home}/coco/val2017")
    assert (cfg.data.cache_dir, cfg.train.output_dir, cfg.model.weights) == (f"{home}/cache", f"{home}/runs/x",
                                                                            f"{home}/w.pth")
    assert cfg.data.val.ann_file == "a~/b.json" and cfg.data.val.split == "~/not/a/path"


# Every path option of every tool, in the "--option=~/..." form that no shell expands.
TOOL_PATH_OPTIONS = {
    "train": ["--config", "--output-dir", "--resume", "--weights"],
    "eval": ["--predictions", "--annotations", "--output-dir", "--image-dir"],
    "infer": ["--config", "--weights", "--input", "--output-dir"],
    "export": ["--config", "--weights", "--output", "--image"],
    "check_dataset": ["--config"],
    "browse_dataset": ["--config", "--output-dir"],
    "summary": ["--config", "--json"],
    "split_dataset": ["--annotations", "--out"],
    "make_shapes": ["--out"],
    "benchmark": ["--config", "--gt", "--results", "--records-file", "--json"],
}
EXTRA_ARGS = {"split_dataset": ["--fractions", "0.8", "0.2"], "export": ["--format", "onnx"], "benchmark": ["--task", "eval"]}


@pytest.mark.parametrize("tool", sorted(TOOL_PATH_OPTIONS))
def test_a_leading_tilde_in_a_tool_path_option_is_the_home_folder(tool, tmp_path, monkeypatch):
    """``--output-dir=~/runs`` reaches the tool as written (a shell expands ``~`` only at
    the start of a word): every path option expands it, as the config's path keys do."""
    monkeypatch.setenv("HOME", str(tmp_path / "me"))
    (tmp_path / "me" / "image-dir").mkdir(parents=True)  # eval checks --image-dir is a folder
    options = TOOL_PATH_OPTIONS[tool]
    argv = [f"{opt}=~/{opt.strip('-')}" for opt in options] + EXTRA_ARGS.get(tool, [])
    args = load_tool(tool).parse_args(argv)
    for opt in options:
        dest = opt.strip("-").replace("-", "_")
        value = getattr(args, "json_out" if (tool, dest) == ("benchmark", "json") else dest)
        assert value == f"{tmp_path}/me/{opt.strip('-')}", (tool, opt)


def test_config_file_that_is_not_text_is_one_line(train_tool, capsys, tmp_path):
    cfg = tmp_path / "model.yaml"
    cfg.write_bytes(bytes(range(128, 256)) * 4)  # e.g. a weights file given as --config
    line = run_train(train_tool, capsys, cfg, output_dir=tmp_path / "run")
    assert line == f"error: {cfg} is not valid utf-8 text (invalid start byte at byte 0); a config is YAML text"


@pytest.mark.parametrize("text", [
    "solver: " + "[" * 5000 + "]" * 5000 + "\n",
    "solver:\n" + "".join("  " * i + f"k{i}:\n" for i in range(1, 5000)),
    "a0: &a0 [1]\n" + "".join(f"a{i}: &a{i} [*a{i - 1}]\n" for i in range(1, 2000)),
], ids=["flow", "block", "alias_chain"])
def test_deep_nesting_is_refused(train_tool, capsys, tmp_path, text):
    cfg = write(tmp_path / "deep.yaml", text)
    line = run_train(train_tool, capsys, cfg, output_dir=tmp_path / "run")
    assert str(cfg) in line and "levels deep" in line


def test_alias_bomb_is_refused_at_once(train_tool, capsys, tmp_path):
    assert len(ALIAS_BOMB) <= 468
    cfg = write(tmp_path / "bomb.yaml", ALIAS_BOMB)
    t0 = time.perf_counter()
    line = run_train(train_tool, capsys, cfg, output_dir=tmp_path / "run")
    assert time.perf_counter() - t0 < 5
    assert str(cfg) in line and "aliases" in line


def test_a_huge_config_without_aliases_is_not_called_an_alias_bomb(tmp_path):
    names = ", ".join(f"c{i}" for i in range(100_001))
    cfg = write(tmp_path / "big.yaml", f"data: {{class_names: [{names}]}}\n")
    with pytest.raises(ConfigError) as e:
        load_config(cfg)
    assert "holds more than 100000 values" in str(e.value) and "alias" not in str(e.value)


def test_self_referencing_alias_is_refused(tmp_path):
    cfg = write(tmp_path / "loop.yaml", "solver: &s {steps: *s}\n")
    with pytest.raises(ConfigError, match="alias contains itself"):
        load_config(cfg)


def test_small_anchors_and_aliases_still_work(tmp_path):
    text = f"base: {TINY_CONFIG}\ninput: {{min_size_test: &size 72, max_size_test: *size}}\n"
    cfg = write(tmp_path / "ok.yaml", text)
    assert load_config(cfg).input.max_size_test == 72


@pytest.mark.parametrize("text,key,lines", [
    ("solver:\n  lr: 0.1\n  lr: 0.2\n", "lr", "lines 3 and 4"),
    ("solver: {lr: 0.1}\nsolver: {max_iter: 3}\n", "solver", "lines 2 and 3"),
])
def test_duplicate_key_is_refused(train_tool, capsys, tmp_path, text, key, lines):
    cfg = write(tmp_path / "dup.yaml", f"base: {TINY_CONFIG}\n{text}")
    line = run_train(train_tool, capsys, cfg, output_dir=tmp_path / "run")
    assert str(cfg) in line and f"key '{key}' is given twice ({lines})" in line


def test_duplicate_key_in_a_base_file_names_that_file(tmp_path):
    base = write(tmp_path / "base.yaml", "train:\n  seed: 1\n  seed: 2\n")
    cfg = write(tmp_path / "c.yaml", "base: base.yaml\n")
    with pytest.raises(ConfigError, match=f"^{base}: key 'seed' is given twice"):
        load_config(cfg)


def test_override_value_bomb_is_refused():
    with pytest.raises(ConfigError, match="override 'solver.steps=.*levels deep"):
        load_config(TINY_CONFIG, ["solver.steps=" + "[" * 3000 + "]" * 3000])


# --------------------------------------------------------------------------- keys and ranges


@pytest.mark.parametrize("override,expected", [
    (f"solver.max_iter={2**63}", "config key 'solver.max_iter' must be in 0..9223372036854775807 (0: from solver.max_epochs), got 9223372036854775808"),
    (f"train.seed={2**70}", f"config key 'train.seed' must be in 0..4294967295, got {2**70}"),
    ("train.seed=-1", "config key 'train.seed' must be in 0..4294967295, got -1"),
    (f"train.eval_period={-2**64}", "config key 'train.eval_period' must be in -9223372036854775808..9223372036854775807"),
    (f"solver.steps=[10,{2**64}]", "config key 'solver.steps[1]' is 18446744073709551616, which does not fit in a "
                                   "64-bit integer"),
    (f"data.shapes.num_train={2**63}", "config key 'data.shapes.num_train' must be in"),
    ("input.min_size_train=[100000]", f"config key 'input.min_size_train' needs at least one size, each in "
                                      f"1..{MAX_IMAGE_SIDE} (pixels), got [100000]"),
    ("input.max_size_train=20000", f"config key 'input.max_size_train' must be in 1..{MAX_IMAGE_SIDE}, got 20000"),
    ("input.min_size_test=0", f"config key 'input.min_size_test' must be in 1..{MAX_IMAGE_SIDE}, got 0"),
])
def test_integer_keys_are_bounded(train_tool, capsys, tmp_path, override, expected):
    line = run_train(train_tool, capsys, TINY_CONFIG, override, output_dir=tmp_path / "run")
    assert expected in line


@pytest.mark.parametrize("device", ["tpu", "cuda:7", "xla", "banana:0"])
def test_device_this_machine_lacks(train_tool, capsys, tmp_path, device):
    if device.startswith("cuda") and torch.cuda.device_count() > 7:
        pytest.skip("this machine has a cuda:7")
    line = run_train(train_tool, capsys, TINY_CONFIG, f"train.device={device}", output_dir=tmp_path / "run")
    assert f"config key 'train.device' is '{device}'" in line and "this machine has cpu" in line


# --------------------------------------------------------------------------- memory of one batch


def test_batch_that_cannot_fit_is_refused_before_work(train_tool, capsys, tmp_path):
    overrides = ["solver.images_per_gpu=64", f"input.min_size_train=[{MAX_IMAGE_SIDE}]",
                 f"input.max_size_train={MAX_IMAGE_SIDE}"]
    t0 = time.perf_counter()
    line = run_train(train_tool, capsys, TINY_CONFIG, *tiny_overrides(tmp_path / "data", None, *overrides),
                     output_dir=tmp_path / "run")
    assert time.perf_counter() - t0 < 20
    assert "one training batch needs at least" in line
    for key in ("solver.images_per_gpu=64", "input.min_size_train", "input.max_size_train", "model.backbone"):
        assert key in line
    assert not (tmp_path / "data").exists()  # refused before the data set was made


def test_batch_memory_estimate(tmp_path):
    cfg = load_config(TINY_CONFIG, ["input.min_size_train=[800]", "input.max_size_train=1333",
                                    "model.backbone=resnet50", "solver.images_per_gpu=2"])
    assert batch_bytes(cfg) == 2 * 800 * 1333 * 600
    check_batch_memory(cfg, torch.device("cpu"), free=4 * GIB)  # fits
    with pytest.raises(ConfigError, match=r"needs at least 2\.4 GiB .* x 2 ranks\) but cpu has 2\.0 GiB free"):
        check_batch_memory(cfg, torch.device("cpu"), ranks_on_device=2, free=2 * GIB)
    # the shorter side is capped by the longer side's limit
    small = load_config(TINY_CONFIG, ["input.min_size_train=[100]", "input.max_size_train=100"])
    assert batch_bytes(small) == small.solver.images_per_gpu * 100 * 100 * 250


@pytest.mark.parametrize("overrides,key,cap", [
    (["input.min_size_test=800", "input.max_size_test=600"], "input.min_size_test", "input.max_size_test=600"),
    (["input.min_size_train=[480,800]", "input.max_size_train=640"], "input.min_size_train", "input.max_size_train=640"),
    (["eval.tta.sizes=[64,128]", "input.max_size_test=96"], "eval.tta.sizes", "input.max_size_test=96"),
])
def test_a_shorter_side_above_its_cap_is_refused(overrides, key, cap):
    """A size above the longer side's cap has no effect (the cap sets every image's scale):
    a swapped min/max pair tested at another size than the user set, and a multi-scale list
    silently trained at fewer scales."""
    with pytest.raises(ConfigError) as e:
        load_config(TINY_CONFIG, overrides)
    msg = str(e.value)
    assert msg.startswith(f"config key '{key}' has shorter-side sizes above {cap}") and "\n" not in msg, msg
    # large-scale jitter does not read min_size_train; sizes at the cap are accepted
    load_config(TINY_CONFIG, ["input.min_size_train=[480,800]", "input.max_size_train=640", "input.lsj.enabled=true"])
    load_config(TINY_CONFIG, ["input.min_size_test=96", "input.max_size_test=96"])


# --------------------------------------------------------------------------- command line


@pytest.mark.parametrize("argv,resume,overrides", [
    (["--resume", "ck.pth", "solver.lr=0.1"], "ck.pth", ["solver.lr=0.1"]),
    (["a.b=1", "--resume", "ck.pth", "solver.lr=0.1", "--overwrite", "c.d=2"], "ck.pth",
     ["a.b=1", "solver.lr=0.1", "c.d=2"]),
    (["--resume", "solver.lr=0.1", "x.y=2"], True, ["solver.lr=0.1", "x.y=2"]),
    (["--resume"], True, []),
])
def test_overrides_after_resume_are_accepted(train_tool, argv, resume, overrides):
    args = train_tool.parse_args(["--config", "c.yaml", *argv])
    assert args.resume == resume and args.overrides == overrides


# Each tool that takes key=value overrides, with its required options and one more
# option that the overrides go around: (tool, argv before, option, its parsed attribute
# and value).
TOOLS_WITH_OVERRIDES = [
    ("eval", ["--config", "c.yaml", "--weights", "w.pth"], ["--output-dir", "o"], ("output_dir", "o")),
    ("infer", ["--config", "c.yaml", "--weights", "w.pth", "--input", "i.jpg"], ["--output-dir", "o"],
     ("output_dir", "o")),
    ("export", ["--config", "c.yaml", "--weights", "w.pth", "--format", "onnx"], ["--output", "m.onnx"],
     ("output", "m.onnx")),
    ("summary", ["--config", "c.yaml"], ["--image-size", "64", "96"], ("image_size", [64, 96])),
    ("check_dataset", ["--config", "c.yaml"], ["--split", "val"], ("split", "val")),
    ("browse_dataset", ["--config", "c.yaml", "--output-dir", "o"], ["--num", "3"], ("num", 3)),
    ("benchmark", ["--config", "c.yaml", "--task", "train"], ["--iters", "2"], ("iters", 2)),
    ("canvas_sizes", ["--config", "c.yaml"], ["--max-canvases", "2"], ("max_canvases", 2)),
    ("train", ["--config", "c.yaml"], ["--output-dir", "o"], ("output_dir", "o")),
]


@pytest.mark.parametrize("tool,required,option,parsed", TOOLS_WITH_OVERRIDES, ids=[t[0] for t in TOOLS_WITH_OVERRIDES])
def test_every_tool_takes_overrides_before_between_and_after_its_options(tool, required, option, parsed):
    """``tools/X.py --config C a=1 --opt v b=2``: both overrides, in order (was: ``error:
    unrecognized arguments: b=2`` from every tool but train.py)."""
    parse_args = load_tool(tool).parse_args
    for argv in ([*required, "solver.lr=0.1", *option, "solver.lr=0.2"],
                 ["solver.lr=0.1", *required, *option, "solver.lr=0.2"],
                 [*required, *option, "solver.lr=0.1", "solver.lr=0.2"]):
        args = parse_args(argv)
        assert args.overrides == ["solver.lr=0.1", "solver.lr=0.2"], argv
        assert getattr(args, parsed[0]) == parsed[1], argv


@pytest.mark.parametrize("overrides,expected", [
    (["solver.steps=[80,60]"], "config key 'solver.steps' takes values in order (each at least the one before), got [80, 60] (60 after 80)"),
    (["solver.max_iter=0", "solver.max_epochs=12", "solver.steps_epochs=[8,11,9]"],
     "config key 'solver.steps_epochs' takes values in order (each at least the one before), got [8, 11, 9] (9 after 11)"),
])
def test_lr_steps_out_of_order_are_refused_not_sorted(overrides, expected):
    """[80, 60] is likelier a typo than a schedule (it was sorted silently)."""
    with pytest.raises(ConfigError) as err:
        load_config(TINY_CONFIG, overrides)
    assert str(err.value) == expected
    assert load_config(TINY_CONFIG, ["solver.steps=[60,60,80]"]).solver.steps == [60, 60, 80]  # repeats: gamma twice, as torch's MultiStepLR


@pytest.mark.parametrize("overrides,words", [
    (["roi_heads.bg_iou_lo=0.6", "roi_heads.bg_iou_hi=0.2"], "'roi_heads.bg_iou_lo' (0.6) < 'roi_heads.bg_iou_hi' (0.2)"),
    (["roi_heads.bg_iou_hi=0"], "'roi_heads.bg_iou_lo' (0) < 'roi_heads.bg_iou_hi' (0)"),
    (["roi_heads.bg_iou_hi=0.7"], "'roi_heads.bg_iou_hi' (0.7) <= 'roi_heads.fg_iou_thresh' (0.5) must hold"),
    (["rpn.bg_iou_thresh=0"], "'rpn.bg_iou_thresh' must be in (0, rpn.fg_iou_thresh=0.7], got 0"),
    (["rpn.fg_iou_thresh=0.2", "rpn.bg_iou_thresh=0.6"], "'rpn.bg_iou_thresh' must be in (0, rpn.fg_iou_thresh=0.2], got 0.6"),
])
def test_matcher_thresholds_keep_a_background_range(overrides, words):
    """Thresholds that leave no background (an empty or inverted range) trained on
    positives only (roi/fg_fraction 1.0, rpn/num_neg_anchors 0), exit 0."""
    with pytest.raises(ConfigError) as e:
        load_config(TINY_CONFIG, overrides)
    assert words in str(e.value), str(e.value)


@pytest.mark.parametrize("overrides,words", [
    (["eval.tta.flip=true"], "config key 'eval.tta.flip' needs eval.tta.sizes (e.g. [64]"),
    (["roi_heads.score_thresh=1"], "config key 'roi_heads.score_thresh' must be"),
])
def test_test_time_settings_that_do_nothing_are_refused(overrides, words):
    """eval.tta.flip alone was dropped (TTA needs sizes); roi_heads.score_thresh=1 kept no
    detection (scores are below 1): both evaluated to the plain or empty result, exit 0."""
    with pytest.raises(ConfigError) as e:
        load_config(TINY_CONFIG, overrides)
    assert words in str(e.value), str(e.value)
    assert load_config(TINY_CONFIG, ["eval.tta.flip=true", "eval.tta.sizes=[64]"]).eval.tta.flip


def test_override_after_resume_checkpoint_reaches_the_config(train_tool, capsys, tmp_path):
    """The override after ``--resume CKPT`` is applied: an out-of-range value in that place
    is refused by the config check (before it would have been an argparse usage error)."""
    line = run_train(train_tool, capsys, TINY_CONFIG, "--resume", str(tmp_path / "ck.pth"), "solver.lr=-1",
                     output_dir=tmp_path / "run")
    assert "config key 'solver.lr' must be > 0, got -1" in line


SHAPE_CASES = {  # override -> the message after "config key ..."
    "input.min_size_train=64": "'input.min_size_train' takes a list of integers, got 64 (as a list: [64])",
    "data.class_names=circle": "'data.class_names' takes a list of strings, got 'circle' (as a list: ['circle'])",
    "data.class_names=[[a, b]]": "'data.class_names' takes a list of strings, got [['a', 'b']]",
    "data.class_names=null": "'data.class_names' takes a list of strings, got null (empty: [])",
    "solver.steps=100": "'solver.steps' takes a list of integers, got 100 (as a list: [100])",
    # YAML 1.1 booleans where names belong: OmegaConf made them the string 'True'.
    "data.class_names=[yes, no, maybe]": "'data.class_names' takes a list of strings, got [True, False, 'maybe'] "
                                         "(YAML reads unquoted yes, no, on, off, true and false as booleans: quote "
                                         "them, e.g. 'no')",
    "solver.lr=[0.1]": "'solver.lr' takes a number, got [0.1]",
    "solver.momentum={a: 1}": "'solver.momentum' takes a number, got {'a': 1}",
    "model.canvas_sizes=[160, 160]": "'model.canvas_sizes' takes a list of lists of integers, got [160, 160] "
                                     "(as a list: [[160, 160]])",
    "model.anchors.sizes=[32, 64]": "'model.anchors.sizes' takes a list of lists of numbers, got [32, 64] "
                                   "(as a list: [[32, 64]])",
}


@pytest.mark.parametrize("override", sorted(SHAPE_CASES))
def test_a_value_of_the_wrong_shape_names_the_key_and_what_it_takes(override, tmp_path):
    """A single value where the schema has a list, a list where it has a single value, a
    list inside a list of strings: one line naming the key, what it takes and what it got,
    from an override and from a file alike (was: OmegaConf's 'AnyNode is not a
    ListConfig, TupleConfig, list, or tuple', sometimes under the key '?', or a
    TypeError traceback for a list of lists of names)."""
    with pytest.raises(ConfigError) as info:
        load_config(TINY_CONFIG, [override])
    assert str(info.value) == f"override '{override}': config key {SHAPE_CASES[override]}"
    key, _, value = override.partition("=")
    *parents, leaf = key.split(".")
    text = "".join(f"{'  ' * i}{p}:\n" for i, p in enumerate(parents)) + f"{'  ' * len(parents)}{leaf}: {value}\n"
    path = write(tmp_path / "c.yaml", text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value) == f"{path}: config key {SHAPE_CASES[override]}"


def test_interpolation_is_resolved_named_when_it_fails_and_escaped_when_literal(tmp_path, monkeypatch):
    """Values are OmegaConf's: ``${oc.env:VAR}`` and ``${other.key}`` resolve; one that
    cannot is one line naming the key (it named none); a literal ``${`` is written
    ``\\${`` and stays literal through config.yaml and a checkpoint's stored config (it
    was interpolated again when read back)."""
    monkeypatch.setenv("DETECTOR_DATA", str(tmp_path / "data"))
    cfg = load_config(TINY_CONFIG, ["data.train.root=${oc.env:DETECTOR_DATA}/train", "solver.lr=${solver.momentum}"])
    assert (cfg.data.train.root, cfg.solver.lr) == (f"{tmp_path}/data/train", cfg.solver.momentum)
    with pytest.raises(ConfigError) as info:
        load_config(TINY_CONFIG, ["data.val.root=${oc.env:DETECTOR_NO_SUCH_VARIABLE}"])
    assert str(info.value).startswith("config key 'data.val.root': ") and "DETECTOR_NO_SUCH_VARIABLE" in str(info.value)
    assert str(info.value).endswith("(a literal '${' is written '\\${')")
    literal = load_config(TINY_CONFIG, [r"data.train.root=/data/\${x}/train"])
    assert literal.data.train.root == "/data/${x}/train"
    save_config(literal, tmp_path / "config.yaml")
    assert load_config(tmp_path / "config.yaml").data.train.root == "/data/${x}/train"
    assert config_from_dict(config_to_dict(literal)).data.train.root == "/data/${x}/train"


def test_an_unquoted_date_is_a_string(tmp_path):
    """No key takes a date: ``output_dir: 2024-01-01`` (a run folder named by its day)
    stays the text written (it was 'Value 'date' is not a supported primitive type')."""
    path = write(tmp_path / "c.yaml", "train:\n  output_dir: 2024-01-01\n")
    assert load_config(path).train.output_dir == "2024-01-01"
    assert load_config(TINY_CONFIG, ["train.output_dir=runs/2024-01-01 10:00:00"]).train.output_dir == \
        "runs/2024-01-01 10:00:00"
