"""The static step on several processes (``TrainStep(average_gradients=True)``): two gloo
ranks on the CPU give DDP's update, the mean of the ranks' gradients, with rank 0's
buffers; the collective helpers it uses; what stays refused."""

from __future__ import annotations

import copy
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.static_check import synthetic_batches
from detector.config import load_config
from detector.distributed import all_reduce_mean_, broadcast_
from detector.engine.static_step import StaticForward, static_forward
from detector.engine.step import TrainStep
from detector.modeling import build_model

from conftest import TINY_CONFIG

STATIC = ["train.static_step=true", "model.canvas_sizes=[[96,96]]", "data.max_gt_per_image=6"]


def _init(rank: int, folder: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=2,
                            timeout=timedelta(seconds=120))


def _helpers_rank(rank: int, folder: str) -> None:
    _init(rank, folder)
    try:
        shapes = [(3, 4), (7,), (2, 2, 2)]
        floats = [torch.full(s, float(rank + 1)) * (i + 1) for i, s in enumerate(shapes)]
        doubles = [torch.arange(5, dtype=torch.float64) * (rank + 1)]
        all_reduce_mean_([*floats, *doubles], world_size=2)
        for i, t in enumerate(floats):  # mean of 1*(i+1) and 2*(i+1)
            assert torch.equal(t, torch.full(shapes[i], 1.5 * (i + 1))), (i, t)
        assert doubles[0].dtype == torch.float64 and torch.equal(doubles[0], torch.arange(5, dtype=torch.float64) * 1.5)
        buffers = [torch.full((2, 3), float(rank)), torch.tensor(10 + rank, dtype=torch.int64)]
        broadcast_(buffers, world_size=2)
        assert torch.equal(buffers[0], torch.zeros(2, 3)) and int(buffers[1]) == 10
        # Both ranks done before either leaves: with torch 2.6's gloo, a rank that tore
        # its group down after its peer had exited could wait for ever.
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.dist
def test_all_reduce_mean_and_broadcast_on_two_ranks(tmp_path):
    """Several shapes and dtypes in one call: the mean and rank 0's values, in place."""
    mp.spawn(_helpers_rank, args=(str(tmp_path),), nprocs=2, join=True)


def test_helpers_are_no_ops_in_one_process():
    t = torch.arange(4.0)
    all_reduce_mean_([t], world_size=1)
    broadcast_([t], world_size=1)
    assert torch.equal(t, torch.arange(4.0))


def _sgd(params):
    return torch.optim.SGD(params, lr=0.02, momentum=0.9, weight_decay=1e-4)


def _static_ddp_rank(rank: int, folder: str) -> None:
    """Rank ``r`` trains one static step on batch ``r``, its model wrapped in DDP; every rank
    then checks its parameters against one process's update from the mean of the two
    batches' gradients (each drawn from the seed of its rank)."""
    _init(rank, folder)
    try:
        cfg = load_config(TINY_CONFIG, STATIC)
        torch.manual_seed(0)
        model = build_model(cfg).train()
        reference = copy.deepcopy(model)
        batches = synthetic_batches(cfg, 2, seed=5)
        # A buffer that differs on rank 1: the step must train with rank 0's (DDP's
        # broadcast_buffers), as the reference does.
        name, buffer = next((n, b) for n, b in model.named_buffers() if b.is_floating_point())
        if rank == 1:
            buffer.mul_(1.5)
        ddp = torch.nn.parallel.DistributedDataParallel(model, broadcast_buffers=False)
        # (DDP broadcast rank 0's parameters at construction; broadcast_buffers=False keeps
        # its buffers out of it, so the step's own broadcast is what is tested.)
        assert rank == 0 or not torch.equal(buffer, dict(reference.named_buffers())[name])
        opt = _sgd([p for p in ddp.parameters() if p.requires_grad])
        step = TrainStep(ddp, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda it: 1.0), world_size=2,
                         forward=StaticForward.from_config(ddp, cfg), average_gradients=True)
        torch.manual_seed(100 + rank)
        result = step(*batches[rank])
        assert not result.skipped
        assert torch.equal(buffer, dict(reference.named_buffers())[name]), f"{name} is not rank 0's"

        forward = StaticForward.from_config(reference, cfg)
        trained = [p for p in reference.parameters() if p.requires_grad]
        grads = []
        for r in (0, 1):
            reference.zero_grad(set_to_none=True)
            torch.manual_seed(100 + r)
            losses = forward(*batches[r])
            torch.stack([losses[k].float() for k in sorted(losses)]).sum().backward()
            grads.append([p.grad.clone() for p in trained])
        # The ranks' gradients differ: without the average the ranks would part.
        assert any(not torch.allclose(a, b) for a, b in zip(*grads))
        for p, g0, g1 in zip(trained, *grads):
            p.grad = (g0 + g1) / 2
        _sgd(trained).step()
        for (n, p), q in zip(model.named_parameters(), reference.parameters()):  # frozen ones included
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7, msg=lambda m: f"rank {rank}, {n}: {m}")
        dist.barrier()  # both ranks done before either leaves (see _helpers_rank)
    finally:
        dist.destroy_process_group()


@pytest.mark.dist
def test_static_step_on_two_ranks_is_the_mean_gradient_update(tmp_path):
    mp.spawn(_static_ddp_rank, args=(str(tmp_path),), nprocs=2, join=True)


def test_static_forward_on_several_processes_refuses_only_syncbn():
    """Several processes get the static forward (``TrainStep`` averages); SyncBatchNorm
    layers (``model.norm=syncbn`` on CUDA with several processes) are refused in one line
    naming the key. On the CPU ``syncbn`` runs as BatchNorm, which is accepted."""
    cfg = load_config(TINY_CONFIG, [*STATIC, "model.norm=syncbn"])
    model = build_model(cfg)
    assert isinstance(static_forward(cfg, model, world_size=2, eager=True), StaticForward)
    assert static_forward(load_config(TINY_CONFIG, []), model, world_size=2) is None  # static step off
    synced = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    with pytest.raises(ValueError, match="config key 'model.norm' is syncbn .*SyncBatchNorm across 2 processes"):
        static_forward(cfg, synced, world_size=2, eager=True)
