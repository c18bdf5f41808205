"""Test hygiene shared by every test: no leaked process group, no leaked launcher variables."""

from __future__ import annotations

import gc
import os

import pytest

_LAUNCH_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "GROUP_RANK",
)


@pytest.fixture(autouse=True)
def _hygiene():
    # Imported here, not at the top: pytest-xdist's controller then never imports torch.
    import torch.distributed as dist

    before = {name: os.environ.get(name) for name in _LAUNCH_VARS}
    yield
    leaked_group = dist.is_available() and dist.is_initialized()
    if leaked_group:
        dist.destroy_process_group()
    after = {name: os.environ.get(name) for name in _LAUNCH_VARS}
    assert not leaked_group, "a test left the default process group initialized"
    assert after == before, f"a test changed launcher variables: {before} -> {after}"


# Folders whose modules share their ranks' runs through module-scoped fixtures (one
# `run_ranks` of every scenario, checked by many tests): each module runs on one worker,
# so the fixture runs once, not once per worker that takes one of its tests.
MODULE_GROUPED = ("dist", "frameworks", "compat", "gpu")
# The order work reaches the workers (the Makefile passes --no-loadscope-reorder, so
# pytest-xdist keeps it): the longest first, the short unit tests last, where they
# fill the gaps. xdist's own order (most tests per group first) left whole launcher
# runs, one test each, for the end: one worker ran on alone for a minute.
LONGEST_FIRST = ("netns", "slurm", "mpi", "launch", "frameworks", "compat", "dist", "gpu", "unit")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist (`make test`), tests that build network namespaces, a Slurm
    cluster or an MPI job run one at a time, on one worker each: they time real
    heartbeats and cuts, which must not share the two cores with each other. The
    modules of `MODULE_GROUPED` run each on one worker. Work is handed out longest
    first (`LONGEST_FIRST`)."""
    if not getattr(config.option, "loadgroup", False):
        return
    for item in items:
        for kind in ("netns", "slurm", "mpi"):
            if item.get_closest_marker(kind):
                _join_group(item, kind)
        if item.path.parent.name in MODULE_GROUPED:
            _join_group(item, item.path.stem)
    items.sort(key=_expected_length)


def _expected_length(item: pytest.Item) -> int:
    """`LONGEST_FIRST`'s index of the item's cluster group, else of its test folder."""
    for kind in LONGEST_FIRST[:3]:
        if item.get_closest_marker(kind):
            return LONGEST_FIRST.index(kind)
    folder = item.path.parent.name
    return LONGEST_FIRST.index(folder) if folder in LONGEST_FIRST else len(LONGEST_FIRST)


def _join_group(item: pytest.Item, group: str) -> None:
    """What pytest-xdist's `xdist_group` mark does: the group's name ends the node id,
    and the scheduler keeps a group on one worker. Its own hook sets `_nodeid`, which
    pytest 9.2 no longer reads (node ids live in `_id`), so the mark alone groups nothing."""
    from _pytest.nodeid import coerce_node_id  # pytest's own parser of node ids

    if "@" not in item.nodeid:
        item._id = coerce_node_id(f"{item.nodeid}@{group}")


def pytest_unconfigure(config: pytest.Config) -> None:
    """Leave the interpreter's last garbage collection nothing to walk: every object
    alive now dies with the process (with torch imported, that walk took 0.6-0.8 s of
    each pytest process's exit on this machine)."""
    gc.freeze()
