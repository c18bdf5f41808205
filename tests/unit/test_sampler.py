"""ShardedSampler on its own (explicit rank and world size, no process group)."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from torch.utils.data import DataLoader

from lockstep import Checkpointer
from lockstep.data import ShardedSampler, epoch_order, shard
from lockstep.errors import EnvironmentConfigError


class Ids(torch.utils.data.Dataset):
    """Sample i is the tensor [i]."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i])


def rank_lists(n, world_size, **kwargs):
    return [
        list(ShardedSampler(range(n), rank=r, world_size=world_size, **kwargs))
        for r in range(world_size)
    ]


@pytest.mark.parametrize("n", [1, 5, 23, 24])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("shuffle", [True, False])
def test_padded_shards_cover_everything_and_repeat_only_the_first_samples(n, world_size, shuffle):
    lists = rank_lists(n, world_size, shuffle=shuffle, seed=7)
    per_rank = math.ceil(n / world_size)
    assert [len(x) for x in lists] == [per_rank] * world_size
    counts = Counter(i for x in lists for i in x)
    assert set(counts) == set(range(n))
    order = epoch_order(n, 7, 0, shuffle).tolist()
    padding = (order * world_size)[: per_rank * world_size - n]
    assert counts - Counter(range(n)) == Counter(padding)


@pytest.mark.parametrize("n,world_size", [(23, 2), (24, 4), (10, 3)])
def test_drop_last_shards_are_disjoint_and_equal(n, world_size):
    lists = rank_lists(n, world_size, drop_last=True)
    assert [len(x) for x in lists] == [n // world_size] * world_size
    flat = [i for x in lists for i in x]
    assert len(flat) == len(set(flat)) == n // world_size * world_size


def test_order_depends_on_seed_and_epoch_only_and_global_batches_match_one_process():
    n, world_size, batch = 40, 4, 3
    single = list(ShardedSampler(range(n), rank=0, world_size=1, seed=3))
    assert single == epoch_order(n, 3, 0).tolist() != list(range(n))
    assert epoch_order(n, 3, 0).tolist() != epoch_order(n, 3, 1).tolist()
    assert epoch_order(n, 3, 1).tolist() != epoch_order(n, 4, 0).tolist()
    lists = rank_lists(n, world_size, seed=3)
    for i in range(math.ceil(len(lists[0]) / batch)):
        global_batch = {j for x in lists for j in x[i * batch : (i + 1) * batch]}
        assert global_batch == set(single[i * batch * world_size : (i + 1) * batch * world_size])


def test_each_new_pass_is_the_next_epoch_and_set_epoch_jumps():
    sampler = ShardedSampler(range(12), rank=1, world_size=2, seed=5)
    passes = [list(sampler) for _ in range(3)]
    assert [sampler.epoch] == [2]
    for epoch, got in enumerate(passes):
        assert got == epoch_order(12, 5, epoch).tolist()[1::2]
    sampler.set_epoch(7)
    assert list(sampler) == epoch_order(12, 5, 7).tolist()[1::2]
    assert sampler.epoch == 7


def _consume(sampler, count):
    it = iter(sampler)
    return [next(it) for _ in range(count)]


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_state_mid_epoch_resumes_exactly_what_is_left(world_size):
    n, k = 23, 4
    samplers = [ShardedSampler(range(n), rank=r, world_size=world_size) for r in range(world_size)]
    for s in samplers:
        list(s)  # one whole epoch
    iters = [iter(s) for s in samplers]
    for it in iters:
        _ = [next(it) for _ in range(k)]
    state = samplers[0].state_dict()
    assert state["epoch"] == 1 and state["position"] == k * world_size
    for rank, sampler in enumerate(samplers):
        rest, next_epoch = list(iters[rank]), list(sampler)  # the uninterrupted run
        resumed = ShardedSampler(range(n), rank=rank, world_size=world_size)
        resumed.load_state_dict(state)
        assert list(resumed) == rest
        assert resumed.epoch == 1
        fresh = ShardedSampler(range(n), rank=rank, world_size=world_size)
        fresh.set_epoch(2)
        assert list(resumed) == next_epoch == list(fresh)


@pytest.mark.parametrize("new_world_size", [1, 3])
def test_a_state_saved_at_two_ranks_is_reshared_over_other_world_sizes(new_world_size):
    n, k = 23, 5
    old = [ShardedSampler(range(n), rank=r, world_size=2, seed=1) for r in range(2)]
    seen = [i for s in old for i in _consume(s, k)]
    state = old[0].state_dict()
    new = [
        ShardedSampler(range(n), rank=r, world_size=new_world_size, seed=1)
        for r in range(new_world_size)
    ]
    for s in new:
        s.load_state_dict(state)
    rest = [list(s) for s in new]
    assert len({len(x) for x in rest}) == 1
    counts = Counter(seen + [i for x in rest for i in x])
    assert set(counts) == set(range(n))
    assert sum(counts.values()) - n < new_world_size  # only the padding of the new split


def test_a_state_saved_at_the_end_of_an_epoch_resumes_at_the_next_one():
    sampler = ShardedSampler(range(9), rank=0, world_size=2, batch_size=2, drop_last=True)
    loader = DataLoader(range(9), batch_size=2, sampler=sampler, drop_last=True)
    assert len(list(loader)) == sampler.batches_per_epoch == 2
    state = sampler.state_dict()
    assert state["position"] == 9  # the one-sample tail, shorter than a batch, counts as read
    resumed = ShardedSampler(range(9), rank=0, world_size=2, batch_size=2, drop_last=True)
    resumed.load_state_dict(state)
    assert list(resumed) == epoch_order(9, 0, 1).tolist()[0:8:2]


def test_shard_counts_batches_received_not_batches_prefetched_by_workers():
    loader = shard(Ids(20), 2, seed=4, num_workers=1, prefetch_factor=4)
    it = iter(loader)
    got = [next(it) for _ in range(3)]
    state = loader.state_dict()
    assert state["position"] == 6  # workers have fetched further ahead than this
    rest = list(it)
    resumed = shard(Ids(20), 2, seed=4)
    resumed.load_state_dict(state)
    assert torch.equal(torch.cat(got + list(resumed)), torch.cat(got + rest))
    assert sorted(torch.cat(got + rest).view(-1).tolist()) == list(range(20))


def test_bad_arguments_say_what_was_expected():
    with pytest.raises(ValueError, match="batch_size must be at least 1"):
        ShardedSampler(range(4), batch_size=0)
    with pytest.raises(ValueError, match="dataset is empty"):
        ShardedSampler(range(0))
    with pytest.raises(ValueError, match="fewer than the world size 4"):
        ShardedSampler(range(3), rank=0, world_size=4, drop_last=True)
    with pytest.raises(ValueError, match="both rank and world_size"):
        ShardedSampler(range(3), rank=1)
    with pytest.raises(TypeError, match="chooses the sampler itself"):
        shard(Ids(4), 2, shuffle=True, sampler=None)
    sampler = ShardedSampler(range(8))
    with pytest.raises(ValueError, match="num_samples=9 but this one has 8"):
        sampler.load_state_dict({**ShardedSampler(range(9)).state_dict()})
    with pytest.raises(ValueError, match="lacks"):
        sampler.load_state_dict({"epoch": 0})


def test_a_different_seed_on_resume_warns_and_keeps_the_saved_order():
    saved = ShardedSampler(range(10), seed=1)
    _consume(saved, 3)
    resumed = ShardedSampler(range(10), seed=2)
    with pytest.warns(UserWarning, match="saved shuffle seed 1 instead of seed 2"):
        resumed.load_state_dict(saved.state_dict())
    assert list(resumed) == epoch_order(10, 1, 0).tolist()[3:]


def test_a_launched_process_without_a_group_is_stopped_before_it_reads_everything(monkeypatch):
    for name, value in {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(EnvironmentConfigError, match=r"rank 1, although .* 2 processes"):
        shard(Ids(4), 2)
    with pytest.raises(EnvironmentConfigError, match="before Checkpointer"):
        Checkpointer("unused")
