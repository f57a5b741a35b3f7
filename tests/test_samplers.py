"""Samplers: aspect groups, rank shards, epoch reshuffles, mid-epoch start, repeat factors,
inference shards."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from detector.data.samplers import (
    GroupedBatchSampler,
    InferenceSampler,
    RepeatFactorSampler,
    SampleKey,
    TrainingSampler,
    aspect_ratio_group_ids,
    repeat_factors_from_labels,
)


def indices(sampler):
    """The data-set indices of one pass of a training sampler."""
    return [key.index for key in sampler]


def test_grouped_batches_are_one_group_and_count_is_fixed():
    gen = torch.Generator().manual_seed(0)
    group_ids = (torch.rand(103, generator=gen) < 0.3).long().tolist()
    for world in (1, 2, 3):
        lens = []
        for rank in range(world):
            sampler = TrainingSampler(103, seed=1, rank=rank, world_size=world)
            bs = GroupedBatchSampler(sampler, group_ids, batch_size=4)
            for epoch in range(3):
                bs.set_epoch(epoch)
                batches = list(bs)
                assert len(batches) == len(bs) == len(sampler) // 4
                for b in batches:
                    assert len(b) == 4
                    assert len({group_ids[k.index] for k in b}) == 1
            lens.append(len(bs))
        assert len(set(lens)) == 1  # the same number of batches on every rank


def test_aspect_ratio_groups():
    assert aspect_ratio_group_ids([0.5, 1.0, 1.5, 0.99]) == [0, 1, 1, 0]


def test_rank_shards_disjoint_and_cover_each_epoch():
    n, world = 40, 4
    orders = {}
    for epoch in (0, 1):
        shards = []
        for rank in range(world):
            s = TrainingSampler(n, seed=5, rank=rank, world_size=world)
            s.set_epoch(epoch)
            shards.append(indices(s))
        flat = [i for sh in shards for i in sh]
        assert sorted(flat) == list(range(n))  # disjoint and covering
        orders[epoch] = shards
    assert orders[0] != orders[1]


def test_uneven_size_pads_equally():
    shards = [indices(TrainingSampler(10, seed=0, rank=r, world_size=4)) for r in range(4)]
    assert [len(s) for s in shards] == [3, 3, 3, 3]
    assert set(i for s in shards for i in s) == set(range(10))


def test_set_epoch_reproducible_and_different():
    a, b = TrainingSampler(50, seed=3), TrainingSampler(50, seed=3)
    a.set_epoch(2)
    b.set_epoch(2)
    assert list(a) == list(b)
    b.set_epoch(3)
    assert indices(a) != indices(b)
    assert sorted(indices(a)) == list(range(50))


def test_keys_number_the_epoch_globally_whatever_the_world_size():
    whole = TrainingSampler(10, seed=4)
    whole.set_epoch(7)
    assert list(whole) == [SampleKey(i, 7, p) for p, i in enumerate(indices(whole))]
    shards = []
    for rank in range(3):
        s = TrainingSampler(10, seed=4, rank=rank, world_size=3)
        s.set_epoch(7)
        shards.append(list(s))
        assert [k.position for k in shards[-1]] == list(range(rank, 12, 3))
    by_position = {k.position: k for shard in shards for k in shard}
    # The first 10 positions are the same samples as with one rank; 10 and 11 are padding:
    # repeats of items 0 and 1 at positions (hence augmentations) of their own.
    assert [by_position[p] for p in range(10)] == list(whole)
    assert [by_position[p].index for p in (10, 11)] == indices(whole)[:2]


@pytest.mark.parametrize("world,rank", [(1, 0), (3, 2)])
def test_start_mid_epoch_yields_exactly_the_remaining_batches(world, rank):
    group_ids = [i % 3 == 0 for i in range(61)]
    bs = GroupedBatchSampler(TrainingSampler(61, seed=9, rank=rank, world_size=world), group_ids, batch_size=2)
    bs.set_epoch(4)
    full = list(bs)
    for k in (0, 1, 5, len(full) - 1, len(full)):
        bs.set_epoch(4)
        bs.set_start(k)
        assert list(bs) == full[k:]
    assert list(bs) == full  # the next pass starts from 0 again
    with pytest.raises(ValueError, match=r"set_start\(99\): must be in 0\.\."):
        bs.set_start(99)


def test_too_small_for_one_batch():
    with pytest.raises(ValueError, match=r"2 images per rank are fewer than one batch of 4"):
        GroupedBatchSampler(TrainingSampler(7, rank=0, world_size=4), [0] * 7, 4)


def test_repeat_factors_formula():
    # class 1 in all 10 images, class 2 in 1 of 10: f = 1.0 and 0.1
    labels = [[1]] * 9 + [[1, 2]]
    r = repeat_factors_from_labels(labels, threshold=0.4)
    assert r[:9].tolist() == [1.0] * 9
    assert r[9].item() == pytest.approx(math.sqrt(0.4 / 0.1))  # = 2
    assert repeat_factors_from_labels([[], [1]], 0.1).tolist() == [1.0, 1.0]


def test_repeat_factor_sampler_draws_rare_images_as_often_as_their_factor():
    # 100 images: 10 contain the rare class 2 (f = 0.1); threshold 0.25 -> r = sqrt(2.5) = 1.581
    labels = [[1]] * 90 + [[1, 2]] * 10
    factors = repeat_factors_from_labels(labels, threshold=0.25)
    expected = math.sqrt(2.5)
    counts = Counter()
    epochs = 200
    lens = set()
    samplers = [RepeatFactorSampler(factors, seed=0, rank=rank, world_size=2) for rank in range(2)]
    for epoch in range(epochs):
        for s in samplers:
            s.set_epoch(epoch)
            shard = indices(s)
            lens.add(len(shard))
            counts.update(shard)
    assert lens == {math.ceil(round(90 + 10 * expected) / 2)}  # fixed epoch length, same on every rank
    rare = sum(counts[i] for i in range(90, 100)) / (10 * epochs)
    common = sum(counts[i] for i in range(90)) / (90 * epochs)
    # Tolerance: 5% of the factor (the sampling error here is about 1%).
    assert rare / common == pytest.approx(expected, rel=0.05)


def test_repeat_factor_sampler_epoch_seeding():
    f = torch.tensor([1.0, 2.5, 1.2, 3.7])
    a, b = RepeatFactorSampler(f, seed=1), RepeatFactorSampler(f, seed=1)
    a.set_epoch(0)
    b.set_epoch(0)
    assert list(a) == list(b)
    seqs = set()
    for e in range(5):
        b.set_epoch(e)
        seqs.add(tuple(indices(b)))
    assert len(seqs) > 1


@pytest.mark.parametrize("size,world", [(10, 4), (3, 4), (17, 1), (0, 2), (100, 7)])
def test_inference_sampler_covers_each_index_once(size, world):
    shards = [list(InferenceSampler(size, r, world)) for r in range(world)]
    assert [i for s in shards for i in s] == list(range(size))  # contiguous, in order, no duplicates
    assert max(map(len, shards)) - min(map(len, shards)) <= 1


def test_bad_rank():
    with pytest.raises(ValueError, match=r"need 0 <= rank < world_size, got rank=4, world_size=4"):
        InferenceSampler(10, 4, 4)
