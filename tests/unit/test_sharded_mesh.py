"""HSDP's groups, as a pure function: consecutive shard groups, replica groups across them."""

from __future__ import annotations

from lockstep.sharded.mesh import hybrid_groups, shard_size_problem


def test_two_by_two_is_torchs_replicate_shard_mesh():
    assert hybrid_groups(4, 2) == ([[0, 1], [2, 3]], [[0, 2], [1, 3]])


def test_every_rank_is_in_one_shard_group_and_one_replica_group():
    shards, copies = hybrid_groups(12, 4)
    assert len(shards) == 3 and len(copies) == 4
    for rank in range(12):
        assert [rank in g for g in shards].count(True) == 1
        mine = next(g for g in copies if rank in g)
        assert all(r % 4 == rank % 4 for r in mine)


def test_sizes_that_do_not_divide_and_stage_1_are_refused():
    assert "must divide the world size 6" in shard_size_problem(6, 4, 3)
    assert "stages 2 and 3" in shard_size_problem(4, 2, 1)
    assert shard_size_problem(8, 4, 2) is None
