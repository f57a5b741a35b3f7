"""Loaders: reproducible batches with workers, equal length across ranks, resume, bus-error advice."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys

import pytest
import torch

from conftest import ROOT
from detector.config import load_config
from detector.data import build_dataset, build_test_loader, build_train_loader
from benchmarks.records_memory import worker_gc_growth
from detector.data.loader import DetectionDataLoader, collate_list


@pytest.fixture(scope="module")
def shapes_cfg(tmp_path_factory):
    root = tmp_path_factory.mktemp("shapes") / "set"
    return lambda *extra: load_config(None, [
        "data.format=shapes", f"data.train.root={root}", f"data.val.root={root}",
        "data.shapes.num_train=14", "data.shapes.num_val=5", "data.shapes.min_side=48", "data.shapes.max_side=96",
        "input.min_size_train=[48,64,80]", "input.max_size_train=128", "input.min_size_test=64",
        "input.max_size_test=128", "input.hflip_prob=0.5", "solver.images_per_gpu=2", "train.seed=123",
        "train.device=cpu", *extra])


def _epoch(loader, epoch):
    loader.batch_sampler.set_epoch(epoch)
    return [(imgs, tgts) for imgs, tgts in loader]


def _assert_same_batches(a, b):
    assert len(a) == len(b)
    for (ia, ta), (ib, tb) in zip(a, b):
        assert len(ia) == len(ib)
        for x, y in zip(ia, ib):
            assert torch.equal(x, y)
        for x, y in zip(ta, tb):
            assert x.keys() == y.keys()
            for k in x:
                assert (torch.equal(x[k], y[k]) if torch.is_tensor(x[k]) else x[k] == y[k])


def test_two_loaders_with_two_workers_give_identical_batches(shapes_cfg):
    cfg = shapes_cfg("data.num_workers=2", "data.persistent_workers=true")
    runs = []
    for _ in range(2):
        ds = build_dataset(cfg, "train", is_train=True)
        loader = build_train_loader(cfg, ds, rank=0, world_size=1)
        runs.append([_epoch(loader, 0), _epoch(loader, 1)])
    _assert_same_batches(runs[0][0], runs[1][0])
    _assert_same_batches(runs[0][1], runs[1][1])
    # Augmentation really is random: sizes vary across images.
    sizes = {min(img.shape[1:]) for imgs, _ in runs[0][0] + runs[0][1] for img in imgs}
    assert len(sizes) > 1
    # The epochs differ (order and augmentation).
    first = [t["image_id"] for _, tgts in runs[0][0] for t in tgts]
    second = [t["image_id"] for _, tgts in runs[0][1] for t in tgts]
    assert first != second


def test_batch_format(shapes_cfg):
    cfg = shapes_cfg("data.num_workers=0")
    loader = build_train_loader(cfg, build_dataset(cfg, "train", True))
    images, targets = next(iter(loader))
    assert isinstance(images, list) and isinstance(targets, list) and len(images) == 2
    for img, t in zip(images, targets):
        assert img.dtype == torch.uint8 and img.ndim == 3 and img.shape[0] == 3
        assert t["boxes"].dtype == torch.float32 and t["boxes"].shape[1] == 4
        assert t["labels"].dtype == torch.int64 and ((t["labels"] >= 1) & (t["labels"] <= 3)).all()
        assert t["scale"].shape == (2,) and t["orig_size"].dtype == torch.int64
        h, w = img.shape[1:]
        assert (t["boxes"][:, 2] <= w + 1e-4).all() and (t["boxes"][:, 3] <= h + 1e-4).all()
    assert not loader.pin_memory  # CPU


def test_same_length_on_every_rank_and_resume(shapes_cfg):
    cfg = shapes_cfg("data.num_workers=0")
    ds = build_dataset(cfg, "train", True)
    lens = [len(build_train_loader(cfg, ds, rank=r, world_size=3)) for r in range(3)]
    assert len(set(lens)) == 1 and lens[0] == (len(ds) + 2) // 3 // 2
    loader = build_train_loader(cfg, ds)
    full = [[t["image_id"] for t in tgts] for _, tgts in _epoch(loader, 2)]
    loader.batch_sampler.set_epoch(2)
    loader.batch_sampler.set_start(3)
    rest = [[t["image_id"] for t in tgts] for _, tgts in loader]
    assert rest == full[3:]


def test_test_loader_shards(shapes_cfg):
    cfg = shapes_cfg("data.num_workers=0", "eval.images_per_gpu=2")
    ds = build_dataset(cfg, "val", False)
    ids = []
    for rank in range(2):
        loader = build_test_loader(cfg, ds, rank=rank, world_size=2)
        ids += [t["image_id"] for _, tgts in loader for t in tgts]
    assert ids == ds.image_ids  # every image once, in order


class _SigbusDataset(torch.utils.data.Dataset):
    """Kills the worker process that loads item 0 with SIGBUS, as an exhausted /dev/shm does."""

    def __len__(self):
        return 4

    def __getitem__(self, idx):
        os.kill(os.getpid(), signal.SIGBUS)
        return torch.zeros(1), {}


def test_bus_error_message_gives_advice():
    from detector.data.loader import DetectionDataLoader

    loader = DetectionDataLoader(_SigbusDataset(), batch_size=2, num_workers=1, collate_fn=collate_list)
    with pytest.raises(RuntimeError, match=r"bus error.*shared memory.*fewer workers.*--shm-size"):
        next(iter(loader))


def test_packed_batch_round_trip():
    from detector.data.loader import PackedBatch

    images = [torch.randint(0, 255, (3, 5, 7), dtype=torch.uint8), torch.randint(0, 255, (3, 4, 2), dtype=torch.uint8)]
    targets = [
        {"boxes": torch.rand(3, 4), "labels": torch.tensor([1, 2, 3]), "image_id": 7,
         "orig_size": torch.tensor([10, 14]), "scale": torch.tensor([0.5, 0.5]), "note": "x"},
        {"boxes": torch.zeros(0, 4), "labels": torch.zeros(0, dtype=torch.int64), "image_id": 9,
         "orig_size": torch.tensor([4, 2]), "scale": torch.tensor([1.0, 1.0])},
    ]
    out_images, out_targets = PackedBatch(images, targets).unpack()
    _assert_same_batches([(images, targets)], [(out_images, out_targets)])
    assert out_targets[0]["note"] == "x" and out_targets[1]["boxes"].shape == (0, 4)


def test_worker_batches_arrive_as_plain_lists(shapes_cfg):
    cfg = shapes_cfg("data.num_workers=1", "data.persistent_workers=false")
    ds = build_dataset(cfg, "train", True)
    loader = build_train_loader(cfg, ds)
    loader.batch_sampler.set_epoch(0)
    with_worker = list(loader)
    plain = list(build_train_loader(cfg, ds, num_workers=0))
    assert isinstance(with_worker[0][0], list) and isinstance(with_worker[0][1][0], dict)
    _assert_same_batches(with_worker, plain)


def _samples_by_image(batches):
    """{image_id: (image, target)} of one epoch in which no image repeats."""
    out = {t["image_id"]: (img, t) for imgs, tgts in batches for img, t in zip(imgs, tgts)}
    assert len(out) == sum(len(imgs) for imgs, _ in batches)
    return out


def test_augmentation_is_a_function_of_seed_epoch_and_sample(shapes_cfg):
    """The same (seed, epoch, sample) gives the same augmented sample with 0 or 2 workers
    (persistent, over two epochs), on rank 0 of 1 or the owning rank of 2, and after a
    restart mid-epoch; another epoch draws anew."""
    cfg = shapes_cfg("data.aspect_ratio_grouping=false", "input.min_size_train=[40,56,72,88]")
    ds = build_dataset(cfg, "train", True)
    plain = build_train_loader(cfg, ds, num_workers=0)
    workers = build_train_loader(cfg, ds, num_workers=2)
    assert workers.persistent_workers
    epochs = [_epoch(plain, e) for e in (0, 1)]
    for e in (0, 1):
        _assert_same_batches(_epoch(workers, e), epochs[e])
    # Two ranks: every sample a rank gets equals the one-rank sample of that image.
    single = _samples_by_image(epochs[1])
    for rank in range(2):
        shard = _samples_by_image(_epoch(build_train_loader(cfg, ds, rank=rank, world_size=2, num_workers=0), 1))
        for image_id, (img, t) in shard.items():
            _assert_same_batches([([img], [t])], [([single[image_id][0]], [single[image_id][1]])])
    # A fresh loader (as after a restart) started 3 batches into epoch 1.
    restarted = build_train_loader(cfg, ds, num_workers=2)
    restarted.batch_sampler.set_epoch(1)
    restarted.batch_sampler.set_start(3)
    _assert_same_batches(list(restarted), epochs[1][3:])
    # Epoch 0 and epoch 1 draw different sizes or flips for the same images.
    first = _samples_by_image(epochs[0])
    differ = [i for i in first if not torch.equal(first[i][0], single[i][0])]
    assert len(differ) >= len(first) // 3


@pytest.mark.gpu
def test_pinned_batches_with_cuda(shapes_cfg):
    cfg = shapes_cfg("data.num_workers=1", "data.persistent_workers=false", "train.device=cuda")
    loader = build_train_loader(cfg, build_dataset(cfg, "train", True))
    assert loader.pin_memory
    loader.batch_sampler.set_epoch(0)
    images, targets = next(iter(loader))
    assert all(img.is_pinned() for img in images) and all(t["boxes"].is_pinned() for t in targets)
    moved = [img.to("cuda", non_blocking=True) for img in images]
    assert torch.equal(moved[0].cpu(), images[0])


def test_repeat_factor_and_ungrouped_options(shapes_cfg):
    from detector.data.samplers import RepeatFactorSampler

    cfg = shapes_cfg("data.num_workers=0", "data.repeat_factor_threshold=0.9", "data.aspect_ratio_grouping=false")
    ds = build_dataset(cfg, "train", True)
    loaders = [build_train_loader(cfg, ds, rank=r, world_size=2) for r in range(2)]
    assert all(isinstance(ld.batch_sampler.sampler, RepeatFactorSampler) for ld in loaders)
    assert len(loaders[0]) == len(loaders[1]) >= len(ds) // 2 // 2
    for ld in loaders:
        ld.batch_sampler.set_epoch(1)
        assert len(list(ld)) == len(ld)


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps_rollup") or not hasattr(os, "fork"),
                    reason="needs Linux /proc/<pid>/smaps_rollup and fork")
def test_a_workers_garbage_collection_leaves_the_parents_objects_shared():
    """A forked worker's full ``gc.collect()`` writes to every object it inherited unless
    they were frozen while it forked: torch's DataLoader (the control) makes those pages
    private, ours does not, and the parent is unfrozen afterwards."""
    ballast = [[i] for i in range(300_000)]  # ~20 MiB of objects the collector tracks
    ours, theirs = worker_gc_growth(DetectionDataLoader), worker_gc_growth(torch.utils.data.DataLoader)
    assert theirs > 12 and ours < 2, (ours, theirs)
    assert gc.get_freeze_count() == 0
    gc.freeze()  # a freeze made by someone else stays
    try:
        frozen = gc.get_freeze_count()
        worker_gc_growth(DetectionDataLoader)
        # still frozen (objects freed meanwhile leave the count; an unfreeze would empty it)
        assert gc.get_freeze_count() > frozen // 2
    finally:
        gc.unfreeze()
    del ballast


EXIT_SCRIPT = """
import sys
from functools import partial

import torch
from detector.data import loader as L

class Numbers(torch.utils.data.Dataset):
    def __len__(self):
        return 8
    def __getitem__(self, i):
        return torch.tensor([i])

if sys.argv[1] == "control":  # without the exit stop: what the process did before
    L._stop_workers_at_exit = lambda iterator: None
# Held in a module global, as a script or notebook holds its trainer: the persistent
# workers are alive when the interpreter ends.
loader = L.DetectionDataLoader(Numbers(), batch_size=4, num_workers=1, persistent_workers=True,
                               worker_init_fn=partial(L.worker_init_fn, rank=0))
print(sum(int(b.sum()) for b in loader), flush=True)
"""


def test_a_process_ends_while_its_persistent_workers_live(tmp_path):
    """The workers ignore SIGTERM (``worker_init_fn``), which is how ``multiprocessing``'s
    exit handler stops daemon children before it joins them: a process ending with live
    persistent workers waited for ever. They are now stopped first (a finalizer), and the
    control, without it, still hangs."""
    script = tmp_path / "exit.py"
    script.write_text(EXIT_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    control = subprocess.Popen([sys.executable, str(script), "control"], env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        done = subprocess.run([sys.executable, str(script), "fixed"], env=env, capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 0 and done.stdout.split() == ["28"], done.stderr
        with pytest.raises(subprocess.TimeoutExpired):  # started together: it has had as long, and 10 s more
            control.wait(timeout=10)
    finally:
        os.killpg(control.pid, signal.SIGKILL)
        control.wait()


def test_close_stops_the_persistent_workers(shapes_cfg):
    cfg = shapes_cfg("data.num_workers=1", "data.persistent_workers=true")
    loader = build_train_loader(cfg, build_dataset(cfg, "train", True))
    assert len(_epoch(loader, 0)) == len(loader)
    workers = list(loader._iterator._workers)
    assert workers and all(w.is_alive() for w in workers)
    loader.close()
    assert loader._iterator is None and not any(w.is_alive() for w in workers)
    assert len(_epoch(loader, 1)) == len(loader)  # a later epoch starts new workers
    loader.close()
