"""shard() and the pre-flight agreement check on real gloo ranks."""

from __future__ import annotations

from collections import Counter

import torch

from lockstep.data import ShardedSampler, epoch_order, shard
from lockstep.errors import RankMismatchError
from lockstep.testing import run_ranks


class Noisy(torch.utils.data.Dataset):
    """Sample i is (i, a random 'augmentation' drawn from the process's torch generator)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[int, float]:
        return i, torch.rand(()).item()


def _first_pass_error(ctx, n, seed, batch_size):
    sampler = ShardedSampler(range(n), seed=seed, batch_size=batch_size)
    try:
        next(iter(sampler))
    except RankMismatchError as error:
        return str(error)
    return None


def _mismatches(ctx):
    r = ctx.rank
    return [
        _first_pass_error(ctx, 23 + r, 0, 4),  # datasets of different lengths
        _first_pass_error(ctx, 23, r, 4),  # a per-rank seed
        _first_pass_error(ctx, 40, 0, 4 + 4 * r),  # different batch sizes
        _first_pass_error(ctx, 23, 0, 4),  # all agree
    ]


def test_disagreeing_ranks_all_raise_naming_each_rank_and_value():
    results = run_ranks(_mismatches, 2)
    on_rank_0 = [m and m.replace("(seen on rank 1)", "(seen on rank 0)") for m in results[1]]
    assert results[0] == on_rank_0 and results[0][3] is None
    length, seed, batches = results[0][:3]
    assert "dataset length: rank 0 has 23, rank 1 has 24" in length
    assert "seed: rank 0 has 0, rank 1 has 1" in seed and "dataset length" not in seed
    assert "batches per epoch: rank 0 has 5, rank 1 has 3" in batches


# Ranks start from a forkserver; DataLoader workers would default to it too, which is slow.
WORKERS = {"num_workers": 1, "multiprocessing_context": "fork"}


def _batches(loader):
    return [(ids.tolist(), noise.tolist()) for ids, noise in loader]


def _two_epochs(ctx, n, batch_size):
    torch.manual_seed(0)  # the same generator on every rank: the worker seeding must still differ
    loader = shard(Noisy(n), batch_size, seed=None, **WORKERS)
    epochs = [_batches(loader) for _ in range(2)]
    torch.manual_seed(1)
    first = _batches(shard(Noisy(n), batch_size, seed=5, **WORKERS))
    torch.manual_seed(1)
    second = _batches(shard(Noisy(n), batch_size, seed=5, **WORKERS))
    return loader.sampler.seed, epochs, first == second


def test_shards_are_disjoint_equal_and_worker_randomness_differs_by_rank():
    n, batch_size = 23, 4
    results = run_ranks(_two_epochs, 2, n, batch_size)
    seeds = {seed for seed, _, _ in results}
    assert len(seeds) == 1  # seed=None: every rank took rank 0's random seed
    seed = seeds.pop()
    for epoch in range(2):
        batches = [epochs[epoch] for _, epochs, _ in results]
        assert len(batches[0]) == len(batches[1]) == 3
        ids = [i for rank in batches for b in rank for i in b[0]]
        order = epoch_order(n, seed, epoch).tolist()
        assert Counter(ids) == Counter(range(n)) + Counter(order[:1])  # one sample of padding
        noise = [[x for b in rank for x in b[1]] for rank in batches]
        assert set(noise[0]).isdisjoint(noise[1])
    assert [reproducible for _, _, reproducible in results] == [True, True]
