"""Samplers: distributed-aware, epoch-seeded, resumable mid-epoch.

The training samplers yield ``SampleKey(index, epoch, position)``: the data-set item,
the epoch, and the sample's place in the epoch's global order (the order all ranks
share, before sharding). A data set indexed with a key draws the sample's augmentation
from ``(seed, epoch, position)``, so the key alone fixes the augmented sample: the key
travels to DataLoader workers with the index, whatever their number or persistence.

- ``TrainingSampler``: one shuffled permutation per epoch (seeded by ``seed + epoch``),
  padded to a multiple of ``world_size`` by repeating its first indices, and sharded
  ``rank::world_size`` (DistributedSampler semantics). Every rank gets the same count.
- ``RepeatFactorSampler``: like ``TrainingSampler`` but each image appears ``r_i`` times
  per epoch in expectation (LVIS repeat-factor sampling), with stochastic rounding seeded
  by the epoch; the epoch length is fixed, so every rank and every epoch has the same count.
- ``GroupedBatchSampler``: batches whose images share an aspect-ratio group, over any of
  the samplers above; exactly ``len(self)`` batches per epoch; ``set_start(n)`` skips the
  first ``n`` batches of the next epoch pass (exact resume).
- ``InferenceSampler``: a contiguous shard per rank, no padding, no duplicates.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Dict, Iterator, List, NamedTuple, Sequence

import numpy as np
import torch
from torch.utils.data import Sampler


class SampleKey(NamedTuple):
    """One training sample: data-set item ``index`` drawn at ``position`` of ``epoch``.

    ``position`` counts the samples of the epoch over all ranks (0 .. total - 1), so it
    does not depend on the world size, and a repeated item (repeat-factor sampling,
    padding) gets a position, hence an augmentation, of its own.
    """

    index: int
    epoch: int
    position: int


def _check_rank(rank: int, world_size: int) -> None:
    if world_size < 1 or not (0 <= rank < world_size):
        raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")


class TrainingSampler(Sampler[SampleKey]):
    """Shuffled (or ordered) ``SampleKey``s of ``size`` items for one rank, one epoch at a time.

    Rank ``r`` of ``W`` gets positions ``r, r + W, r + 2W, ...`` of the epoch's padded order.

    Args:
        size: number of items in the data set.
        shuffle: shuffle each epoch with ``torch.Generator().manual_seed(seed + epoch)``.
        seed: base seed; must be the same on every rank.
        rank, world_size: this process's shard.
    """

    def __init__(self, size: int, shuffle: bool = True, seed: int = 0, rank: int = 0, world_size: int = 1) -> None:
        if size <= 0:
            raise ValueError(f"TrainingSampler needs a non-empty data set, got size={size}")
        _check_rank(rank, world_size)
        self.size = size
        self.shuffle = shuffle
        self.seed = int(seed)
        self.rank = rank
        self.world_size = world_size
        self.epoch = 0
        self.num_samples = math.ceil(size / world_size)  # per rank
        self.total_size = self.num_samples * world_size

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def _epoch_indices(self) -> List[int]:
        """The full (all ranks) index list of this epoch, before padding."""
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            return torch.randperm(self.size, generator=g).tolist()
        return list(range(self.size))

    def __iter__(self) -> Iterator[SampleKey]:
        indices = _pad_to(self._epoch_indices(), self.total_size)
        for position in range(self.rank, self.total_size, self.world_size):
            yield SampleKey(indices[position], self.epoch, position)

    def __len__(self) -> int:
        return self.num_samples


def _pad_to(indices: List[int], total: int) -> List[int]:
    """Repeat ``indices`` from its start until it has ``total`` entries (or truncate)."""
    if len(indices) >= total:
        return indices[:total]
    reps = math.ceil(total / len(indices))
    return (indices * reps)[:total]


def repeat_factors_from_labels(labels_per_image: Sequence[Sequence[int]], threshold: float) -> torch.Tensor:
    """LVIS repeat factors: for category c with image frequency f_c (fraction of images
    that contain c), ``r_c = max(1, sqrt(threshold / f_c))``; an image's factor is the max
    over its categories (1 for an image without objects). Returns float64 ``[num_images]``."""
    if threshold <= 0:
        raise ValueError(f"repeat factor threshold must be > 0, got {threshold}")
    n = len(labels_per_image)
    counts: Dict[int, int] = defaultdict(int)
    for labels in labels_per_image:
        for c in set(int(x) for x in labels):
            counts[c] += 1
    cat_factor = {c: max(1.0, math.sqrt(threshold / (k / n))) for c, k in counts.items()}
    factors = [max((cat_factor[int(c)] for c in set(labels)), default=1.0) for labels in labels_per_image]
    return torch.tensor(factors, dtype=torch.float64)


class RepeatFactorSampler(TrainingSampler):
    """Repeat-factor sampling for imbalanced data (LVIS, Gupta et al. 2019).

    Each epoch, image i appears ``floor(r_i)`` times plus once more with probability
    ``frac(r_i)`` (stochastic rounding, generator seeded by ``seed + epoch``); the list is
    shuffled, then cut or cyclically padded to the fixed epoch length
    ``round(sum(r))`` rounded up to a multiple of ``world_size``, and sharded.

    Args:
        repeat_factors: float ``[size]`` (e.g. from ``repeat_factors_from_labels``).
    """

    def __init__(self, repeat_factors: torch.Tensor | Sequence[float], seed: int = 0, rank: int = 0,
                 world_size: int = 1) -> None:
        factors = torch.as_tensor(repeat_factors, dtype=torch.float64)
        if factors.ndim != 1 or len(factors) == 0 or (factors < 0).any():
            raise ValueError("repeat_factors must be a non-empty 1-D list of non-negative numbers")
        super().__init__(len(factors), shuffle=True, seed=seed, rank=rank, world_size=world_size)
        self.repeat_factors = factors
        epoch_len = max(1, int(round(float(factors.sum()))))
        self.num_samples = math.ceil(epoch_len / world_size)
        self.total_size = self.num_samples * world_size

    def _epoch_indices(self) -> List[int]:
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        whole = torch.floor(self.repeat_factors)
        extra = (torch.rand(len(whole), generator=g, dtype=torch.float64) < (self.repeat_factors - whole)).double()
        reps = (whole + extra).long().numpy()
        # numpy here: torch.repeat_interleave goes through the intra-op thread pool, which
        # is slow when the CPU is oversubscribed.
        indices = np.repeat(np.arange(len(reps)), reps)
        if len(indices) == 0:
            indices = np.arange(len(reps))
        order = torch.randperm(len(indices), generator=g).numpy()
        return indices[order].tolist()


class GroupedBatchSampler(Sampler[List[SampleKey]]):
    """Batches of ``batch_size`` keys from ``sampler``, each batch from one group.

    Keys are buffered per group and a batch is emitted when its group's buffer is full.
    The epoch has exactly ``num_batches = len(sampler) // batch_size`` batches (the same on
    every rank, since the samplers above give every rank the same count): when the sampler
    runs out with fewer batches emitted, the fullest leftover buffers are completed with
    keys of the same group seen earlier in the epoch. With one group (all ids equal)
    this is plain batching with ``drop_last``.

    Args:
        sampler: yields ``SampleKey``s; may have ``set_epoch``.
        group_ids: group of each dataset index (e.g. 0 for w/h < 1, 1 otherwise).
        batch_size: images per batch (per rank).
    """

    def __init__(self, sampler: Sampler[int], group_ids: Sequence[int], batch_size: int) -> None:
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        self.sampler = sampler
        self.group_ids = [int(g) for g in group_ids]
        self.batch_size = batch_size
        self.num_batches = len(sampler) // batch_size
        if self.num_batches == 0:
            raise ValueError(
                f"{len(sampler)} images per rank are fewer than one batch of {batch_size}: "
                f"use a smaller batch (solver.images_per_gpu) or fewer processes"
            )
        self.start = 0

    def set_epoch(self, epoch: int) -> None:
        """Reshuffle for ``epoch`` (same epoch -> same batches)."""
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)

    def set_start(self, num_batches_done: int) -> None:
        """Skip the first ``num_batches_done`` batches of the next pass (exact resume);
        the pass after that starts from 0 again."""
        if not (0 <= num_batches_done <= self.num_batches):
            raise ValueError(f"set_start({num_batches_done}): must be in 0..{self.num_batches}")
        self.start = int(num_batches_done)

    def _batches(self) -> Iterator[List[SampleKey]]:
        buffers: Dict[int, List[SampleKey]] = defaultdict(list)
        seen: Dict[int, List[SampleKey]] = defaultdict(list)
        emitted = 0
        for key in self.sampler:
            g = self.group_ids[key.index]
            buffers[g].append(key)
            seen[g].append(key)
            if len(buffers[g]) == self.batch_size:
                yield buffers[g]
                buffers[g] = []
                emitted += 1
                if emitted == self.num_batches:
                    return
        # Complete the fullest leftover groups with repeats from the same group.
        leftovers = sorted((b for b in buffers.items() if b[1]), key=lambda kv: (-len(kv[1]), kv[0]))
        for g, batch in leftovers:
            if emitted == self.num_batches:
                return
            pool = seen[g]
            i = 0
            while len(batch) < self.batch_size:
                batch.append(pool[i % len(pool)])
                i += 1
            yield batch
            emitted += 1
        assert emitted == self.num_batches, "GroupedBatchSampler: fewer batches than promised"

    def __iter__(self) -> Iterator[List[SampleKey]]:
        start, self.start = self.start, 0
        for i, batch in enumerate(self._batches()):
            if i >= start:
                yield batch

    def __len__(self) -> int:
        return self.num_batches


class InferenceSampler(Sampler[int]):
    """Indices ``[begin, end)`` of a contiguous shard for ``rank``: shard sizes differ by
    at most one, and the shards of all ranks cover ``0..size-1`` exactly once."""

    def __init__(self, size: int, rank: int = 0, world_size: int = 1) -> None:
        _check_rank(rank, world_size)
        self.size = size
        base, extra = divmod(size, world_size)
        self.begin = rank * base + min(rank, extra)
        self.end = self.begin + base + (1 if rank < extra else 0)

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.begin, self.end))

    def __len__(self) -> int:
        return self.end - self.begin


def aspect_ratio_group_ids(aspect_ratios: Sequence[float]) -> List[int]:
    """Two groups: 0 for portrait (w/h < 1), 1 for landscape or square."""
    return [0 if ar < 1.0 else 1 for ar in aspect_ratios]
