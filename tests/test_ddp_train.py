"""DDP on the CPU: ``torchrun --nproc_per_node=2`` (gloo) trains the tiny model.

Checks: parameters identical on both ranks afterwards, the logged loss is the mean of
the ranks' losses, only rank 0 wrote files, and the ranks saw disjoint images.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Dict, Tuple

import pytest
import torch

from detector.engine.log import read_jsonl
from conftest import TINY_CONFIG, tiny_overrides

from conftest import ROOT  # noqa: E402

WORKER = textwrap.dedent("""
    import json, os, sys
    import torch
    from detector.config import load_config
    from detector.distributed import init_distributed
    from detector.engine.log import setup_logging
    from detector.engine.trainer import build_trainer

    side, out, eager_static, *overrides = sys.argv[1:]
    info = init_distributed("cpu")
    # Rank 1 is told another output folder: it must stay absent (rank 0 writes all files).
    out_rank = out if info.rank == 0 else out + "_rank1"
    cfg = load_config({config!r}, overrides + [f"train.output_dir={{out_rank}}"])
    setup_logging(cfg.train.output_dir, info.rank)
    trainer = build_trainer(cfg, dist_info=info, eager_static=eager_static == "eager_static")
    assert isinstance(trainer.model, torch.nn.parallel.DistributedDataParallel)
    model = trainer.model_without_ddp
    seen = []
    forward = model.forward

    def recording_forward(images, targets=None):
        out = forward(images, targets)
        if model.training:
            seen.append({{"ids": [int(t["image_id"]) for t in targets],
                          "total": float(sum(v.detach().float() for v in out.values()))}})
        return out

    model.forward = recording_forward
    result = trainer.train()
    trainer.close()
    # Parameters (BatchNorm running statistics are per rank until DDP's next broadcast).
    params = {{k: p.detach() for k, p in trainer.model_without_ddp.named_parameters()}}
    torch.save(params, os.path.join(side, f"params_{{info.rank}}.pt"))
    with open(os.path.join(side, f"seen_{{info.rank}}.json"), "w") as f:
        json.dump(seen, f)
    torch.distributed.destroy_process_group()
""").format(config=str(TINY_CONFIG))


def run_two_ranks(tmp_path: Path, *extra: str, eager_static: bool = False) -> Tuple[Path, Path]:
    """The worker under ``torchrun --nproc_per_node=2`` (gloo) for 3 iterations on 8
    generated images; returns (the side folder of each rank's parameters and seen
    batches, the run folder)."""
    data = tmp_path / "shapes"
    out = tmp_path / "run"
    side = tmp_path / "side"
    side.mkdir()
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    overrides = tiny_overrides(
        data, None, "solver.reference_batch_size=4", "solver.max_iter=3", "solver.warmup_iters=1",
        "solver.steps=[100]", "train.checkpoint_period=2", "train.deterministic=false", *extra,
    )
    # Generate the data once, before the ranks start.
    from detector.data.shapes import ensure_shapes

    ensure_shapes(data, 8, 4, 0, 64, 96)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(script), str(side), str(out), "eager_static" if eager_static else "-", *overrides]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return side, out


def rank_params(side: Path) -> Tuple[Dict[str, torch.Tensor], Dict[str, torch.Tensor]]:
    p0 = torch.load(side / "params_0.pt", weights_only=True)
    p1 = torch.load(side / "params_1.pt", weights_only=True)
    assert p0.keys() == p1.keys() and len(p0) > 50
    return p0, p1


@pytest.mark.dist
@pytest.mark.slow
def test_torchrun_two_cpu_ranks(tmp_path):
    side, out = run_two_ranks(tmp_path)
    p0, p1 = rank_params(side)
    assert all(torch.equal(p0[k], p1[k]) for k in p0)

    seen0 = json.loads((side / "seen_0.json").read_text())
    seen1 = json.loads((side / "seen_1.json").read_text())
    assert len(seen0) == len(seen1) == 3
    # Epoch 0 (2 batches per rank: 8 images / 2 ranks / 2 per batch): disjoint shards.
    ids0 = {i for s in seen0[:2] for i in s["ids"]}
    ids1 = {i for s in seen1[:2] for i in s["ids"]}
    assert ids0 and ids1 and not ids0 & ids1
    assert all(not set(a["ids"]) & set(b["ids"]) for a, b in zip(seen0, seen1))

    records = [r for r in read_jsonl(out / "metrics.jsonl") if r["type"] == "train"]
    assert [r["iteration"] for r in records] == [1, 2, 3]
    for r, a, b in zip(records, seen0, seen1):
        assert r["total_loss"] == pytest.approx((a["total"] + b["total"]) / 2, rel=1e-5, abs=1e-6)
    # The ranks' losses differ, so the mean is not just rank 0's value.
    assert any(abs(a["total"] - b["total"]) > 1e-3 for a, b in zip(seen0, seen1))

    # Only rank 0 wrote files: rank 1's output folder was never created.
    assert not Path(str(out) + "_rank1").exists()
    # data.cache_dir=auto: rank 0 parsed the training set once and rank 1 mapped its record file.
    assert len(list((out / "cache").glob("train-*.records"))) == 1
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["iter_0000002.pth", "iter_0000003.pth", "last.pth"]
    state = torch.load(out / "checkpoints" / "last.pth", weights_only=True)
    assert state["world_size"] == 2 and len(state["rng"]["per_rank"]) == 2
    assert all(torch.equal(state["model"][k], p0[k]) for k in p0)


@pytest.mark.dist
@pytest.mark.slow
def test_torchrun_two_cpu_ranks_static_step(tmp_path):
    """``train.static_step`` (run eagerly: the trainer's ``eager_static``) under torchrun:
    the step averages the gradients itself, so the ranks, which train on different
    images, end with the same parameters, and these moved from the start."""
    side, out = run_two_ranks(tmp_path, "train.static_step=true", "model.canvas_sizes=[[96,96]]",
                              "data.max_gt_per_image=6", eager_static=True)
    p0, p1 = rank_params(side)
    assert all(torch.equal(p0[k], p1[k]) for k in p0)
    records = [r for r in read_jsonl(out / "metrics.jsonl") if r["type"] == "train"]
    assert [r["iteration"] for r in records] == [1, 2, 3] and all(r["total_loss"] > 0 for r in records)
    first = torch.load(out / "checkpoints" / "iter_0000002.pth", weights_only=True)["model"]
    assert any(not torch.equal(first[k], p0[k]) for k in p0)  # iteration 3 changed them


@pytest.mark.dist
def test_torchrun_two_cpu_ranks_on_two_joined_sets(tmp_path):
    """``data.train_extra`` under torchrun: the 8 images as two COCO files of 4 are one
    training set, which the sampler splits between the ranks (epoch 0, without
    aspect-ratio groups: disjoint shards covering all 8); each file's records are parsed
    once and shared (one record file each); the ranks end with the same parameters."""
    from detector.data.shapes import ensure_shapes

    data = ensure_shapes(tmp_path / "shapes", 8, 4, 0, 64, 96)
    coco = json.loads((data / "train.json").read_text())
    for name, images in (("a", coco["images"][:4]), ("b", coco["images"][4:])):
        ids = {im["id"] for im in images}
        part = {**coco, "images": images, "annotations": [x for x in coco["annotations"] if x["image_id"] in ids]}
        (tmp_path / f"{name}.json").write_text(json.dumps(part))
    side, out = run_two_ranks(
        tmp_path, "data.format=coco", f"data.train.root={data / 'train'}", f"data.train.ann_file={tmp_path / 'a.json'}",
        f"data.train_extra=[{{root: '{data / 'train'}', ann_file: '{tmp_path / 'b.json'}'}}]",
        f"data.val.root={data / 'val'}", f"data.val.ann_file={data / 'val.json'}", "data.aspect_ratio_grouping=false")
    p0, p1 = rank_params(side)
    assert all(torch.equal(p0[k], p1[k]) for k in p0)
    seen = [json.loads((side / f"seen_{rank}.json").read_text()) for rank in (0, 1)]
    shards = [{i for s in rank_seen[:2] for i in s["ids"]} for rank_seen in seen]
    assert not shards[0] & shards[1] and shards[0] | shards[1] == {im["id"] for im in coco["images"]}
    assert sorted(p.name.split("-")[0] for p in (out / "cache").glob("*.records")) == ["a", "b"]


@pytest.mark.dist
def test_ranks_with_different_training_sets_stop_with_one_line(tmp_path):
    """Node-local copies that differ: each rank read its own set (its own epoch schedule,
    then a wait until the timeout). Every rank stops before any work, naming the rank."""
    from detector.data.shapes import ensure_shapes

    for rank, count in ((0, 8), (1, 12)):
        ensure_shapes(tmp_path / f"data{rank}", count, 2, rank, 64, 96)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    root = str(tmp_path / "data${oc.env:LOCAL_RANK}")  # COCO files: the shapes keys would regenerate the sets
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "tools" / "train.py"), "--config", str(TINY_CONFIG), "--output-dir", str(tmp_path / "run"),
           "data.format=coco", f"data.train.root={root}/train", f"data.train.ann_file={root}/train.json",
           f"data.val.root={root}/val", f"data.val.ann_file={root}/val.json", "solver.max_iter=2",
           "train.dist_timeout_s=60"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode != 0 and errors, proc.stderr[-3000:]
    assert errors[0].startswith("error: data.train: rank 1 reads another training set than rank 0 (12 images"), errors
    assert not (tmp_path / "run" / "checkpoints").exists()
