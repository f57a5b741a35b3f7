"""tools/benchmark.py and the benchmarks package: JSON fields, sane values, the
torchvision counterpart's configuration, the scoring comparison, bad arguments."""

from __future__ import annotations

import json
import logging
import math
import mmap
from types import SimpleNamespace

import pytest
import torch
import yaml

from detector.config import load_config
from benchmarks import gpu_check, run_benchmark, static_accuracy
from benchmarks.profiling import DENSE_OPS, host_summary, kernel_summary, profile_train_step
from benchmarks.memory import peak_memory_bytes, reset_peak_memory
from benchmarks.tasks import _skipped, benchmark_eval
from benchmarks.run import format_summary
from detector.engine.step import StepResult
from benchmarks.timing import Runner, run_interleaved, summarize_times
from benchmarks.torchvision_ref import build_torchvision_model
from conftest import TINY_CONFIG, load_tool, tiny_overrides

from conftest import ROOT  # noqa: E402
# configs/tiny_cpu.yaml on purpose: the CPU example config in the benchmark tool's usage
# (tools/benchmark.py --task data), timed as a user runs it.
TINY = ROOT / "configs" / "tiny_cpu.yaml"


RUN_FIELDS = (
    "iters", "median_s", "mean_s", "std_s", "min_s", "max_s", "iqr_s",
    "images_per_iter", "images_per_s", "peak_memory_bytes", "memory_kind", "times_s",
)


def _check_run(run: dict, iters: int) -> None:
    for key in RUN_FIELDS:
        assert key in run, f"missing field {key}"
    assert run["iters"] == iters and len(run["times_s"]) == iters
    assert 0 < run["min_s"] <= run["median_s"] <= run["max_s"] < 600
    assert run["std_s"] >= 0 and run["iqr_s"] >= 0
    assert run["images_per_iter"] >= 1
    # a step's rate is its median's; a loader's is its mean's (its workers deliver in bursts)
    rate_time = run["mean_s"] if run.get("images_per_s_from") == "mean" else run["median_s"]
    assert math.isclose(run["images_per_s"], run["images_per_iter"] / rate_time, rel_tol=1e-9)
    assert run["memory_kind"] == "cpu_peak_rss"
    # A process running torch holds tens of MiB at least, and this test far less than 16 GiB.
    assert 20 * 2**20 < run["peak_memory_bytes"] < 16 * 2**30


def shapes_data(tmp_path, num_train: int = 4, num_val: int = 2) -> list:
    """Overrides pointing the tiny config at a small generated shapes set under ``tmp_path``."""
    return [f"data.train.root={tmp_path / 'shapes'}", f"data.val.root={tmp_path / 'shapes'}",
            f"data.shapes.num_train={num_train}", f"data.shapes.num_val={num_val}"]


def benchmark_json(tmp_path, *args: str) -> dict:
    """``tools/benchmark.py --config <tiny> ARGS`` on the shapes set ``shapes_data`` makes
    (callers add its overrides), with ``--json``: asserts exit status 0, returns the JSON."""
    out = tmp_path / "bench.json"
    rc = load_tool("benchmark").main(["--config", str(TINY), *args, "--json", str(out)])
    assert rc == 0
    return json.loads(out.read_text())


@pytest.fixture
def restore_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def test_train_json_tiny_config(tmp_path, restore_threads, caplog):
    # One thread: the test checks the output, not the speed, and stays quick on a busy machine.
    caplog.set_level(logging.INFO, logger="detector.engine.optim")
    result = benchmark_json(
        tmp_path, "--task", "train", "--iters", "2", "--warmup", "1", "--num-batches", "2",
        "--threads", "1", "--compare-torchvision", "train.device=cpu", *shapes_data(tmp_path, 12, 4),
    )
    for key in ("task", "config", "machine", "device", "iters", "warmup", "runs", "ratio", "options", "wall_s"):
        assert key in result, f"missing field {key}"
    assert result["task"] == "train" and result["iters"] == 2 and result["device"] == "cpu"
    assert result["machine"]["cpu_count"] >= 1 and result["machine"]["torch"] == torch.__version__
    assert set(result["runs"]) == {"ours", "torchvision", "ours_loader"}
    for run in result["runs"].values():
        _check_run(run, 2)
    cfg = load_config(TINY)
    assert result["runs"]["ours"]["images_per_iter"] == cfg.solver.images_per_gpu
    assert result["ratio"] > 0 and math.isfinite(result["ratio"])
    expected = result["runs"]["ours"]["images_per_s"] / result["runs"]["torchvision"]["images_per_s"]
    assert math.isclose(result["ratio"], expected, rel_tol=1e-9)
    assert result["runs"]["ours_loader"]["data_wait_median_s"] >= 0
    assert result["machine"]["torch_threads"] == 1
    assert result["ours_step"] == "detector.engine.step.TrainStep"
    assert result["ours_nonfinite_steps"] == 0
    assert 0 < result["runs"]["ours"]["cpu_median_s"] < 600
    # Three training steps were built (ours, torchvision's, ours fed by the loader): the
    # optimizer's line is logged once.
    lines = [r.getMessage() for r in caplog.records if r.name == "detector.engine.optim"]
    assert len([m for m in lines if m.startswith("optimizer ")]) == 1, lines


def test_summarize_times_matches_numpy():
    times = [0.5, 0.1, 0.3, 0.2, 0.4]
    s = summarize_times(times, images_per_iter=2)
    assert s["median_s"] == 0.3 and s["min_s"] == 0.1 and s["max_s"] == 0.5
    assert math.isclose(s["images_per_s"], 2 / 0.3)
    assert math.isclose(s["std_s"], torch.tensor(times, dtype=torch.float64).std().item())
    assert math.isclose(s["iqr_s"], 0.4 - 0.2)
    with pytest.raises(ValueError, match="no timed iterations"):
        summarize_times([], 1)


def test_peak_rss_sees_an_allocation():
    dev = torch.device("cpu")
    reset_peak_memory(dev)
    base = peak_memory_bytes(dev)
    # 64 MiB of fresh anonymous pages, each touched (a tensor could reuse memory that
    # earlier tests freed but the allocator kept resident).
    x = mmap.mmap(-1, 64 * 2**20)
    for offset in range(0, len(x), 4096):
        x[offset] = 1
    assert peak_memory_bytes(dev) >= base + 50 * 2**20
    x.close()


def test_torchvision_counterpart_matches_config():
    cfg = load_config(TINY, ["train.device=cpu"]) if TINY.exists() else load_config(None, ["model.backbone=resnet18"])
    tv = build_torchvision_model(cfg)
    assert tv.rpn.anchor_generator.sizes == tuple(tuple(float(s) for s in lv) for lv in cfg.model.anchors.sizes)
    assert tv.rpn._pre_nms_top_n["training"] == cfg.rpn.pre_nms_topk_train
    assert tv.rpn._post_nms_top_n["testing"] == cfg.rpn.post_nms_topk_test
    assert tv.rpn.nms_thresh == cfg.rpn.nms_thresh
    assert tv.rpn.fg_bg_sampler.batch_size_per_image == cfg.rpn.batch_size_per_image
    assert tv.roi_heads.fg_bg_sampler.batch_size_per_image == cfg.roi_heads.batch_size_per_image
    assert tv.roi_heads.fg_bg_sampler.positive_fraction == cfg.roi_heads.positive_fraction
    assert tv.roi_heads.box_coder.weights == tuple(cfg.roi_heads.box_coder_weights)
    assert tv.roi_heads.box_predictor.cls_score.out_features == cfg.model.num_classes + 1
    assert tv.roi_heads.box_head.fc7.out_features == cfg.roi_heads.representation_size
    assert tv.backbone.out_channels == cfg.model.fpn_channels
    # freeze_at=k freezes the stem (k >= 1) and layer1..layer{k-1}, like torchvision's
    # trainable_layers = 5 - k.
    stage_index = {"conv1": 1, "bn1": 1, "layer1": 2, "layer2": 3, "layer3": 4, "layer4": 5}
    for name, p in tv.backbone.body.named_parameters():
        frozen = stage_index[name.split(".")[0]] <= cfg.model.freeze_at
        assert p.requires_grad != frozen, name
    # No resizing: an image comes out of the transform at its own size (padded to /32).
    tv.eval()
    images, _ = tv.transform([torch.rand(3, 100, 130)])
    assert images.image_sizes == [(100, 130)] and images.tensors.shape[-2:] == (128, 160)


def test_eval_scoring_matches_pycocotools():
    cfg = load_config(None)
    result = benchmark_eval(cfg, iters=1, warmup=0, num_images=20, boxes_per_image=10)
    assert {"pycocotools_direct", "ours_pycocotools", "ours_all_metrics"} <= set(result["runs"])
    assert result["max_abs_diff_vs_pycocotools"]["ours_pycocotools"] == 0
    for name, diff in result["max_abs_diff_vs_pycocotools"].items():
        assert diff < 1e-9, name
    for run in result["runs"].values():
        assert run["images_per_iter"] == 20 and run["median_s"] > 0


def test_bad_arguments_have_clear_messages():
    cfg = load_config(None)
    with pytest.raises(ValueError, match="--task must be one of"):
        run_benchmark(cfg, "fly")
    with pytest.raises(ValueError, match="--iters must be >= 1"):
        run_benchmark(cfg, "train", iters=0)
    with pytest.raises(ValueError, match="--compare-torchvision applies to --task train or infer"):
        run_benchmark(cfg, "eval", compare_torchvision=True)


@pytest.mark.parametrize("config, extra, words", [
    (TINY, ["model.num_clases=3"], ["model.num_clases", "did you mean"]),  # unknown key
    (TINY.parent / "no_such_config.yaml", [], ["no_such_config.yaml"]),  # missing config file
])
def test_tool_bad_input_is_one_line(capsys, config, extra, words):
    tool = load_tool("benchmark")
    rc = tool.main(["--config", str(config), "--task", "train", "--iters", "1", "--warmup", "0", "--no-loader", *extra])
    err = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in err if line.startswith("error: ")]
    assert rc == 1 and len(errors) == 1 and "Traceback" not in "\n".join(err), err
    for word in words:
        assert word in errors[0], errors[0]


def test_op_counts_do_not_depend_on_the_thread_count(tiny_cfg, restore_threads):
    """The profile counts on one intra-op thread, whatever the caller's setting: the
    count with 2 threads equals the count with 1, and the caller's setting comes back."""
    cfg = tiny_cfg("train.device=cpu", "solver.images_per_gpu=2")
    counts = []
    for threads in (2, 1):
        torch.set_num_threads(threads)
        prof = profile_train_step(cfg, warmup=1, row_limit=1000)
        counts.append(prof["counts"])
    assert counts[0] == counts[1]
    assert torch.get_num_threads() == 1  # restored to the caller's setting
    # dense_share: the convolution and linear kernels' share of the step's self time.
    dense = sum(op["self_share"] for op in prof["top_ops"] if op["name"] in DENSE_OPS)
    assert any(op["name"] == "aten::mkldnn_convolution" for op in prof["top_ops"])
    assert 0.0 < prof["dense_share"] < 1.0
    assert prof["dense_share"] == pytest.approx(dense, abs=2e-3)  # every row: the same sum, rounded


def test_data_task_json(tmp_path):
    result = benchmark_json(tmp_path, "--task", "data", "--iters", "3", "--warmup", "1", *shapes_data(tmp_path, 12, 4))
    _check_run(result["runs"]["loader"], 3)
    assert result["runs"]["loader"]["images_per_iter"] == load_config(TINY).solver.images_per_gpu
    # the rate is all images over all time (its median batch is often one already waiting)
    loader = result["runs"]["loader"]
    assert loader["images_per_s_from"] == "mean"
    assert math.isclose(loader["images_per_s"], 3 * loader["images_per_iter"] / sum(loader["times_s"]), rel_tol=1e-3)
    records = result["records"]
    if "skipped" not in records:  # Linux: a forked worker read every record of the 12 images
        assert records["images"] == 12 and records["boxes"] > 0
        # 12 records: the figure is noise-sized (tests/test_records.py holds the bound on 20k)
        assert all(records["worker_walk"][k]["growth_mib"] >= -64 for k in ("store", "list"))
        assert set(records["worker_walk"]) == {"store", "list"}
    # make gpu-check's table reads this JSON (its loader run sets the rate beside the step's)
    loader = result["runs"]["loader"]
    assert gpu_check.figures({"result": result}) == (
        f"loader {loader['images_per_s']:.1f} img/s ({load_config(TINY).data.num_workers} workers)")


@pytest.mark.slow  # ~40 s: fresh interpreters for the parse, 2 ranks and 3 sharing modes (a measurement tool)
def test_data_task_records_file(tmp_path):
    """``--records-file``: the records case on a COCO file (the shapes' train.json), parsed
    in a fresh interpreter and read by 2 ranks x 1 worker; ``--node-ranks 1``: the three
    sharing modes on one rank (two ranks sharing one parse: test_record_cache.py)."""
    overrides = shapes_data(tmp_path, 12, 4)
    ann_file = tmp_path / "shapes" / "train.json"
    result = benchmark_json(tmp_path, "--task", "data", "--iters", "1", "--warmup", "0", "--records-file",
                            str(ann_file), "--node-ranks", "1", "data.num_workers=1", *overrides)
    records = result["records"]
    if "skipped" in records:
        pytest.skip(records["skipped"])
    coco = json.loads(ann_file.read_text())
    assert records["parse"]["images"] == records["images"] == len(coco["images"])
    assert records["parse"]["boxes"] == records["boxes"] == len(coco["annotations"])
    assert records["parse"]["peak_rss_mib"] >= records["parse"]["rss_after_mib"] > 0
    tree = records["rank_tree"]
    assert (tree["ranks"], tree["workers_per_rank"]) == (2, 1)
    assert sum(r["boxes"] for r in tree["per_rank"]) == len(coco["annotations"])  # each rank read its shard
    assert all(r["processes"] == 2 and r["workers_pss_mib"] > 0 for r in tree["per_rank"])
    # --node-ranks: each rank parsing, then one parse shared through one record file.
    sharing = records["sharing"]
    assert set(sharing["runs"]) == {"parse", "shared", "shared_warm"} and len(sharing["record_files"]) == 1
    for mode, run in sharing["runs"].items():
        assert sum(r["boxes"] for r in run["per_rank"]) == len(coco["annotations"]), mode
        assert all(r["records_mapped"] == (mode != "parse") for r in run["per_rank"]), mode
        assert run["seconds_to_records"] > 0 and run["total_pss_mib"] > 0 and len(run["loadavg_start"]) == 3


def test_count_ops_json(tmp_path, restore_threads):
    result = benchmark_json(
        tmp_path, "--task", "train", "--iters", "1", "--warmup", "1", "--num-batches", "2",
        "--no-loader", "--count-ops", "--threads", "1", "train.device=cpu", *shapes_data(tmp_path),
        "solver.images_per_gpu=2",
    )
    for key in ("ops_per_step", "host_syncs_per_step", "nonzero_per_step"):
        assert set(result[key]) == {"ours", "torchvision"}, key
        assert all(isinstance(v, int) and v >= 0 for v in result[key].values()), key
    # A detector's training step dispatches thousands of aten ops; both steps read at
    # least one scalar back (ours: the non-finite flags; torchvision's loop: the loss).
    assert all(v > 500 for v in result["ops_per_step"].values())
    assert all(v >= 1 for v in result["host_syncs_per_step"].values())
    assert "profile" not in result  # --count-ops alone keeps the JSON small
    infer = benchmark_json(tmp_path, "--task", "infer", "--iters", "1", "--warmup", "1", "--num-batches", "2",
                           "--count-ops", "--threads", "1", "train.device=cpu", *shapes_data(tmp_path))
    assert set(infer["ops_per_step"]) == {"ours", "torchvision"} and "inference batch" in infer["ops_counted"]
    assert all(500 < v < min(result["ops_per_step"].values()) for v in infer["ops_per_step"].values())  # no backward
    with pytest.raises(ValueError, match="--count-ops applies to --task train or infer, not 'data'"):
        run_benchmark(load_config(None), "data", count_ops=True)


def test_infer_profile_json(tmp_path, restore_threads, capsys):
    """--profile also profiles one inference batch, for both models, with the share of
    the step in convolution and linear kernels (and the bound it puts on the ratio)."""
    result = benchmark_json(
        tmp_path, "--task", "infer", "--iters", "1", "--warmup", "1", "--num-batches", "2",
        "--compare-torchvision", "--profile", "--threads", "1", "train.device=cpu", *shapes_data(tmp_path),
        "eval.images_per_gpu=2",
    )
    assert set(result["profile"]) == {"ours", "torchvision"}
    for prof in result["profile"].values():
        names = [op["name"] for op in prof["top_ops"]]
        assert "aten::mkldnn_convolution" in names or "aten::_slow_conv2d_forward" in names
        assert not any("backward" in n for n in names)  # inference: no backward pass
        assert 0.0 < prof["dense_share"] < 1.0
    assert "one inference batch" in capsys.readouterr().out
    with pytest.raises(ValueError, match="--profile applies to --task train or infer"):
        run_benchmark(load_config(None), "data", profile=True)


def test_kernel_summary_counts_device_records_only():
    """The device's busy time sums the CUDA records (kernels, copies) by name; host
    records, which a real CPU profile has only of, count for nothing."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        torch.ones(8) @ torch.ones(8)
    assert kernel_summary(prof.events()) == {"gpu_busy_ms": 0.0, "top_kernels": []}

    def record(name, us, device=torch.autograd.DeviceType.CUDA):
        return SimpleNamespace(name=name, device_type=device, time_range=SimpleNamespace(elapsed_us=lambda: us))

    events = [record("gemm", 3000.0), record("nms", 500.0), record("gemm", 1000.0), record("aten::mm", 9000.0,
                                                                                           torch.autograd.DeviceType.CPU)]
    summary = kernel_summary(events, row_limit=1)
    assert summary == {"gpu_busy_ms": 4.5, "top_kernels": [{"name": "gemm", "ms": 4.0, "calls": 2, "share": 0.8889}]}


def test_host_summary_ranks_operators_by_host_time_and_calls():
    """The host's side of a profile: self CPU time summed over every operator, the
    largest first, and the most called; checked on a real CPU profile of a small loop."""
    x = torch.randn(64, 64)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            x = torch.relu(x @ x) / 64.0
        torch.sigmoid(x)
    events = prof.key_averages()
    summary = host_summary(events, row_limit=3)
    assert summary["host_ms"] == pytest.approx(sum(e.self_cpu_time_total for e in events) / 1000.0, abs=1e-3)
    times = [op["ms"] for op in summary["top_host_ops"]]
    assert len(times) == 3 and times == sorted(times, reverse=True) and times[0] > 0
    assert len(summary["most_called"]) == 3
    most = host_summary(events, row_limit=100)["most_called"]
    counts = [op["calls"] for op in most]
    assert counts == sorted(counts, reverse=True)
    calls = {op["name"]: op["calls"] for op in most}
    assert calls["aten::mm"] == 5 and calls["aten::sigmoid"] == 1


def test_static_accuracy_trains_both_steps_per_seed(tmp_path):
    data = tmp_path / "data"
    report = static_accuracy.main(["--config", str(TINY_CONFIG), "--seeds", "0", "--out", str(tmp_path / "out"),
                                   *tiny_overrides(data), "solver.max_iter=2", "model.canvas_sizes=[[96,96]]"])
    assert [(r["arm"], r["seed"]) for r in report["runs"]] == [("eager", 0), ("static", 0)]
    saved = json.loads((tmp_path / "out" / "static_accuracy.json").read_text())
    assert saved["summary"]["static_minus_eager"] == pytest.approx(
        report["runs"][1]["AP"] - report["runs"][0]["AP"])
    for arm, static in (("eager", False), ("static", True)):
        cfg = yaml.safe_load((tmp_path / "out" / f"{arm}_0" / "config.yaml").read_text())
        assert cfg["train"]["static_step"] is static and cfg["train"]["seed"] == 0
        assert (tmp_path / "out" / f"{arm}_0" / "checkpoints" / "last.pth").is_file()


@pytest.mark.parametrize("args", [["--eval-images", "0"], ["--eval-boxes", "-1"]])
def test_an_empty_generated_eval_case_is_a_usage_error(args, capsys):
    """--eval-images 0 was an IndexError inside pycocotools; --eval-boxes -1 numpy's
    'lam < 0', naming no option."""
    with pytest.raises(SystemExit) as info:
        load_tool("benchmark").parse_args(["--config", str(TINY), "--task", "eval", *args])
    assert info.value.code == 2 and f"{args[0]} must be >= 1, got {args[1]}" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["0", "-2"])
def test_no_cached_batches_is_a_usage_error(value, capsys):
    """--num-batches 0 said 'the data loader gave no batches (is the split empty?)'."""
    with pytest.raises(SystemExit) as info:
        load_tool("benchmark").parse_args(["--config", str(TINY), "--task", "train", "--num-batches", value])
    assert info.value.code == 2 and f"--num-batches must be >= 1, got {value}" in capsys.readouterr().err


def test_a_runner_that_stops_leaves_the_rotation_and_says_why():
    """torchvision's reference loop stops at a non-finite loss (the first float16 run on
    a GPU): its runner leaves, ours is still timed, and the summary names the reason."""
    calls = {"ours": 0, "torchvision": 0, "early": 0}

    def fn(name, fail_at):
        def run(i):
            calls[name] += 1
            if calls[name] == fail_at:
                raise FloatingPointError("torchvision's training loss is nan")
            return 2
        return run

    cpu = torch.device("cpu")
    ours, tv, early = Runner("ours", fn("ours", 0), cpu), Runner("torchvision", fn("torchvision", 4), cpu), \
        Runner("early", fn("early", 1), cpu)
    run_interleaved([ours, tv, early], iters=5, warmup=2, stop_on=(FloatingPointError,))
    assert calls == {"ours": 7, "torchvision": 4, "early": 1}
    assert ours.summary()["iters"] == 5 and "stopped" not in ours.summary()
    assert tv.summary()["iters"] == 1 and tv.stopped == "FloatingPointError at timed iteration 3: torchvision's training loss is nan"
    assert early.summary() == {"iters": 0, "stopped": "FloatingPointError at warm-up iteration 0: torchvision's training loss is nan"}
    with pytest.raises(FloatingPointError):
        run_interleaved([Runner("t", fn("torchvision", 5), cpu)], iters=2, warmup=0)  # not asked: raised
    result = {"task": "train", "device": "cpu", "iters": 5, "warmup": 2,
              "runs": {"ours": ours.summary(), "torchvision": tv.summary(), "early": early.summary()}}
    text = format_summary(result)
    assert "torchvision          stopped after 1 timed iterations: FloatingPointError" in text
    assert "early                stopped after 0 timed iterations" in text and text.count("median") == 2


def test_skipped_steps_are_counted_from_either_step_kind():
    """The eager step says it on the host (``nonfinite``), the CUDA-graph step on the
    device (``nonfinite_flag``, which defaults to ``skip_flag``; summed there and read
    once); torchvision's step returns a float."""
    def result(nonfinite: bool, skip_flag=None) -> StepResult:
        return StepResult(torch.zeros(1), ("total_loss",), torch.zeros(()), nonfinite, nonfinite, False,
                          skip_flag=skip_flag)

    assert _skipped(result(True)) == 1
    assert _skipped(result(False)) == 0
    total = 0 + _skipped(result(False, torch.tensor(1.0)))
    assert isinstance(total, torch.Tensor) and int(total + _skipped(0.5)) == 1


def test_runner_counts_the_reserve_its_calls_grow(monkeypatch):
    """The allocator's reserve grown during a runner's own calls, warm-up included (where
    a CUDA graph's pool is reserved at capture); a reserve that shrinks counts as 0. Off
    CUDA there is no reserve: nothing counted, nothing reported."""
    from benchmarks import timing

    reserve = {"bytes": 0}
    monkeypatch.setattr(timing, "reserved_bytes", lambda device: reserve["bytes"])
    grows = iter([2**30, 0, 2**20, -2**29, 0])

    def fn(i):
        reserve["bytes"] += next(grows)
        return 2

    runner = Runner("ours", fn, torch.device("cpu"))
    run_interleaved([runner], iters=3, warmup=2)
    assert runner.reserved_growth_bytes == 2**30 + 2**20
    monkeypatch.undo()
    plain = Runner("ours", lambda i: 2, torch.device("cpu"))
    plain.run(0)
    assert plain.reserved_growth_bytes == 0 and "reserved_growth_mib" not in plain.summary()
