"""`ShardedSampler`: which samples this rank reads in an epoch, in what order, where it stopped.

Each epoch puts the whole dataset in one order, drawn from (seed, epoch) alone,
so it is the same on every rank. With W ranks, rank r reads positions r, r + W,
r + 2W, ... of that order: global batch i (batch i of every rank together) holds
the samples of batch i of one process whose batch is W times larger. Every rank
gets the same count, by wrapping around to the start of the order or, with
drop_last, by cutting the tail. The place inside an epoch is kept as a global
count of consumed samples, so a checkpoint resumes at any world size.
"""

from __future__ import annotations

import hashlib
import math
import os
import warnings
from collections.abc import Iterator, Sized
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Sampler

from lockstep.context import group_context
from lockstep.data.agreement import check_data_agreement

STATE_KEYS = ("epoch", "position", "seed", "num_samples", "world_size", "shuffle")


def mix_seed(*parts: int) -> int:
    """A 63-bit seed from integers; unrelated inputs give unrelated seeds (unlike seed + epoch)."""
    text = "/".join(str(int(p)) for p in parts).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 1


def epoch_order(num_samples: int, seed: int, epoch: int, shuffle: bool = True) -> torch.Tensor:
    """The order of the whole dataset in `epoch`: a permutation drawn from (seed, epoch) only."""
    if not shuffle:
        return torch.arange(num_samples)
    generator = torch.Generator().manual_seed(mix_seed(seed, epoch))
    return torch.randperm(num_samples, generator=generator)


def _place(
    rank: int | None, world_size: int | None, process_group: dist.ProcessGroup | None
) -> tuple[int, int, bool]:
    """(rank, world_size, whether the ranks can talk) from the arguments or the process group."""
    if rank is not None or world_size is not None:
        if rank is None or world_size is None or not 0 <= rank < world_size:
            raise ValueError(
                f"ShardedSampler expected both rank and world_size with 0 <= rank < world_size; "
                f"found rank={rank}, world_size={world_size}. Pass both or neither."
            )
        return rank, world_size, False
    place = group_context(process_group, "ShardedSampler")
    rank, size = place.rank, place.world_size
    return rank, size, size > 1


class ShardedSampler(Sampler[int]):
    """This rank's disjoint share of every epoch; resumable inside an epoch.

    A new pass over the sampler (a new `for batch in loader`) starts the next
    epoch by itself; `set_epoch` is there for code written for torch's sampler.
    At the first pass, all ranks check that they agree on dataset length, seed
    and batches per epoch (see `lockstep.data.agreement`).

    Args:
        dataset: anything with a length.
        batch_size: this rank's batch size; used for the batches-per-epoch check and
            so that, with drop_last, a tail shorter than a batch counts as consumed.
        shuffle: draw a new order every epoch; otherwise the dataset order.
        seed: the shuffle seed, the same on every rank; None lets rank 0 pick one at
            random, which every rank then uses.
        drop_last: cut the order to a multiple of the world size instead of padding it.
        rank: this rank's index among the data-parallel ranks (with `world_size`); by
            default taken from `process_group`. Given explicitly, no check is exchanged.
        world_size: the number of data-parallel ranks.
        process_group: the data-parallel group; the default group when None.
    """

    def __init__(
        self,
        dataset: Sized,
        *,
        batch_size: int = 1,
        shuffle: bool = True,
        seed: int | None = 0,
        drop_last: bool = False,
        rank: int | None = None,
        world_size: int | None = None,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        self.num_samples = len(dataset)
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.process_group = process_group
        self.rank, self.world_size, self._exchange = _place(rank, world_size, process_group)
        self._check_config()
        self._seed_given = seed is not None
        self.seed = seed if seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
        self.epoch = 0
        self._start = 0  # global position in the epoch order where the current pass began
        self._started = False  # a pass over `epoch` has begun
        self._pass_len = 0  # samples this rank gets in the current pass
        self._consumed = 0  # of which consumed so far
        self._agreed = not self._exchange

    def _check_config(self) -> None:
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be at least 1; found {self.batch_size}")
        if self.num_samples == 0:
            raise ValueError("the dataset is empty; expected at least one sample to shard")
        if self.drop_last and self.num_samples < self.world_size:
            raise ValueError(
                f"the dataset has {self.num_samples} samples, fewer than the world size "
                f"{self.world_size}: with drop_last=True every rank would get none. Use "
                "drop_last=False (samples are repeated to fill every rank) or fewer ranks."
            )

    def __len__(self) -> int:
        """Samples this rank gets in a whole epoch (a resumed epoch has fewer left)."""
        if self.drop_last:
            return self.num_samples // self.world_size
        return math.ceil(self.num_samples / self.world_size)

    @property
    def batches_per_epoch(self) -> int:
        """Batches this rank gets in a whole epoch; the same on every rank."""
        if self.drop_last:
            return len(self) // self.batch_size
        return math.ceil(len(self) / self.batch_size)

    def set_epoch(self, epoch: int) -> None:
        """Make the next pass read `epoch` from its start; optional, as passes advance."""
        self.epoch, self._start, self._started = epoch, 0, False

    def __iter__(self) -> Iterator[int]:
        self._begin_pass()
        if not self._agreed:
            self._agree()
        indices = self.rank_indices()
        self._pass_len, self._consumed = len(indices), 0
        return self._counting(indices)

    def next_pass(self) -> tuple[int, int]:
        """(epoch, start position) that the next pass over the sampler will read."""
        if self._started or self._start >= self.num_samples:
            return self.epoch + 1, 0
        return self.epoch, self._start

    def _begin_pass(self) -> None:
        self.epoch, self._start = self.next_pass()
        self._started = True

    def _counting(self, indices: list[int]) -> Iterator[int]:
        for index in indices:
            self._consumed += 1
            yield index

    def rank_indices(self) -> list[int]:
        """The sample indices this rank reads in the current pass, from its start position."""
        order = epoch_order(self.num_samples, self.seed, self.epoch, self.shuffle)
        left = order[self._start :]
        if self.drop_last:
            left = left[: len(left) // self.world_size * self.world_size]
        else:
            pad = -len(left) % self.world_size
            # Wrap around to the epoch's first samples, as many times as a tiny dataset needs.
            left = torch.cat([left, order.repeat(math.ceil(pad / len(order)))[:pad]])
        return left[self.rank :: self.world_size].tolist()

    def mark_consumed(self, count: int) -> None:
        """Set how many samples of the current pass the training loop has received.

        `shard()`'s loader calls this after each batch it hands out, so samples that
        DataLoader workers fetched ahead are not counted as consumed.
        """
        self._consumed = min(count, self._pass_len)

    def _position(self) -> int:
        """Global count of samples of this epoch consumed by all ranks together."""
        if not self._started:
            return self._start
        left = self._pass_len - self._consumed
        if left == 0 or (self.drop_last and left < self.batch_size):
            return self.num_samples  # the epoch is done: the next pass starts the next one
        return min(self._start + self._consumed * self.world_size, self.num_samples)

    def _agree(self) -> None:
        statement = {
            "dataset length": self.num_samples,
            "batches per epoch": self.batches_per_epoch,
            "seed": self.seed if self._seed_given else None,
        }
        statements = check_data_agreement(
            statement, self.process_group, shared={"seed used": self.seed}, settle=self._settle
        )
        self._settle(statements[0])

    def _settle(self, rank0: dict[str, int | None]) -> None:
        """Take rank 0's seed: the agreement is done."""
        self.seed = int(rank0["seed used"] or 0)
        self._agreed = True

    @property
    def agreed(self) -> bool:
        """The ranks' first-pass agreement is done (the seed is every rank's from then on)."""
        return self._agreed

    def agreed_elsewhere(self) -> None:
        """Skip the first pass's check: a live replacement's peers agreed long ago, and its
        state (seed included) came from one of them (`live/sampler.py`)."""
        self._agreed = True

    def state_dict(self) -> dict[str, Any]:
        """Where this epoch stands: plain ints and bools, the same on every rank."""
        return {
            "epoch": self.epoch,
            "position": self._position(),
            "seed": self.seed,
            "num_samples": self.num_samples,
            "world_size": self.world_size,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at a saved place: the next pass reads what is left of the saved epoch.

        A state saved at another world size works: the samples left in the epoch
        are dealt over this sampler's ranks.

        Raises:
            ValueError: the state is not a sampler state, or it describes another dataset
                length or shuffle setting.
        """
        missing = [key for key in STATE_KEYS if key not in state]
        if missing:
            raise ValueError(f"sampler state lacks {missing}; found keys {sorted(state)}")
        for key, mine in (("num_samples", self.num_samples), ("shuffle", self.shuffle)):
            if state[key] != mine:
                raise ValueError(
                    f"the saved sampler has {key}={state[key]} but this one has {mine}; the "
                    "rest of the saved epoch cannot be resumed over different data. Use the "
                    "same dataset and shuffle setting as the saved run."
                )
        if self._seed_given and state["seed"] != self.seed:
            warnings.warn(
                f"resuming with the saved shuffle seed {state['seed']} instead of seed "
                f"{self.seed}, so the saved epoch continues in its own order",
                stacklevel=2,
            )
        self.seed, self._seed_given = int(state["seed"]), True
        self.epoch, self._start, self._started = int(state["epoch"]), int(state["position"]), False
        self._pass_len = self._consumed = 0
