"""`shard()`: a DataLoader that reads this rank's share of the data, resumably.

It pairs a `ShardedSampler` with a DataLoader that tells the sampler, after each
batch it hands to the training loop, how far the loop has got, so a checkpoint
records batches received rather than indices that workers fetched ahead. Its
workers seed their random generators from the loader's base seed and the rank:
augmentation differs across ranks and is reproducible from the script's seed.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

from lockstep.data.sampler import ShardedSampler, mix_seed

_NOT_ALLOWED = ("sampler", "batch_sampler", "shuffle")


class WorkerSeeder:
    """worker_init_fn that gives each DataLoader worker of each rank its own random streams.

    In a worker, torch.initial_seed() is the loader's base seed (drawn from the
    script's generator when the pass starts) plus the worker id; mixing in the
    rank makes ranks differ even when every rank seeded its generator alike.
    """

    def __init__(self, rank: int, then: Callable[[int], None] | None = None) -> None:
        self.rank = rank
        self.then = then

    def __call__(self, worker_id: int) -> None:
        seed = mix_seed(torch.initial_seed(), self.rank)
        torch.manual_seed(seed)
        random.seed(seed)
        try:
            import numpy as np
        except ImportError:
            pass
        else:
            np.random.seed(seed % 2**32)
        if self.then is not None:
            self.then(worker_id)


class ShardedLoader(DataLoader):
    """A DataLoader over a `ShardedSampler`; `state_dict()` is the sampler's.

    Unless given a generator, it owns one and seeds it at each pass from (seed,
    rank, epoch, start position). The DataLoader draws its workers' base seed
    from it, not from the script's global generator, so starting a pass never
    shifts the global random stream: a resumed run draws the same dropout masks.
    """

    sampler: ShardedSampler

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        if getattr(self, "owns_generator", False):
            self.generator.manual_seed(
                mix_seed(self.sampler.seed, self.sampler.rank, *self.sampler.next_pass())
            )
        for delivered, batch in enumerate(super().__iter__(), start=1):
            self.sampler.mark_consumed(delivered * (self.batch_size or 1))
            yield batch

    def state_dict(self) -> dict[str, Any]:
        """The sampler's state: the epoch and the place inside it."""
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume the sampler at a saved place (see `ShardedSampler.load_state_dict`)."""
        self.sampler.load_state_dict(state)


def shard(
    dataset: Dataset,
    batch_size: int,
    *,
    shuffle: bool = True,
    seed: int | None = 0,
    drop_last: bool = False,
    process_group: dist.ProcessGroup | None = None,
    **loader_kwargs: Any,
) -> ShardedLoader:
    """A DataLoader that gives this rank its share of `dataset`, `batch_size` samples at a time.

    Args:
        dataset: a map-style dataset (indexable, with a length), the same on every rank.
        batch_size: samples per batch on this rank (the global batch divided by the
            world size).
        shuffle: a new order every epoch, drawn from (seed, epoch).
        seed: the shuffle seed, the same on every rank; None lets rank 0 pick one.
        drop_last: drop the tail that does not fill every rank and the last short batch,
            instead of repeating samples to fill them.
        process_group: the data-parallel group; the default group when None.
        **loader_kwargs: passed to torch.utils.data.DataLoader (num_workers, collate_fn,
            pin_memory, ...); a worker_init_fn runs after the workers are seeded; a
            generator, if given, replaces the loader's own (and is the caller's to seed).

    Returns:
        A `ShardedLoader`; its `.sampler` is the `ShardedSampler` to checkpoint.

    Raises:
        TypeError: sampler, batch_sampler or shuffle were passed in `loader_kwargs`.
    """
    clashing = [key for key in _NOT_ALLOWED if key in loader_kwargs]
    if clashing:
        raise TypeError(
            f"shard() chooses the sampler itself; found {clashing} in its arguments. Use "
            "shuffle=/seed=/drop_last= of shard() instead."
        )
    sampler = ShardedSampler(
        dataset,
        batch_size=batch_size,
        shuffle=shuffle,
        seed=seed,
        drop_last=drop_last,
        process_group=process_group,
    )
    loader_kwargs["worker_init_fn"] = WorkerSeeder(
        sampler.rank, loader_kwargs.get("worker_init_fn")
    )
    owns_generator = loader_kwargs.get("generator") is None
    if owns_generator:
        loader_kwargs["generator"] = torch.Generator()
    loader = ShardedLoader(
        dataset, batch_size=batch_size, sampler=sampler, drop_last=drop_last, **loader_kwargs
    )
    loader.owns_generator = owns_generator
    return loader
