"""`TorchFacedDDP`: lockstep's engine under torch's class name, for frameworks that check it.

Accelerate, the transformers Trainer and Lightning build torch's
`DistributedDataParallel` themselves and then test `isinstance(model,
torch.nn.parallel.DistributedDataParallel)` before unwrapping, saving or syncing.
This class is a subclass of torch's whose constructor never runs torch's (no C++
reducer, no torch hooks): it is lockstep's `DistributedDataParallel`, plus the few
torch internals those frameworks call (`reducer.prepare_for_backward`,
`reducer._rebuild_buckets`, `_get_ddp_logging_data`). Every other private method of
torch's class raises `NotImplementedError` naming itself, instead of reading a
reducer that is not there. `docs/frameworks.md` lists what is supported.
"""

from __future__ import annotations

import sys
import time
import weakref
from collections.abc import Callable
from typing import Any, NoReturn

from torch import nn
from torch.nn.parallel.distributed import DistributedDataParallel as TorchDDP

from lockstep.engine.ddp import DistributedDataParallel
from lockstep.engine.reducer import Reducer
from lockstep.env import read_variable
from lockstep.runtime.bucket_collective import CommHook

# torch's own names that stay as torch defines them: class-level state that torch's
# compiler reads on torch's class (`_get_active_ddp_module`), not on an instance.
_KEPT = {"_active_ddp_module", "_get_active_ddp_module", "_inside_ddp_forward"}
# Implemented here or by lockstep's class.
_PROVIDED = {"_get_ddp_logging_data", "_set_ddp_runtime_logging_sample_rate"}


class TorchFacingReducer(Reducer):
    """lockstep's `Reducer` with the three calls frameworks make on torch's C++ reducer."""

    unused_of: weakref.WeakMethod | None = None  # the wrapper's `_unused`, set by it

    def prepare_for_backward(self, outputs: Any = ()) -> None:
        """Arm the next backward to synchronise (after a forward that did not).

        Accelerate's `trigger_sync_in_backward` and Lightning's manual optimization
        call this after a forward under `no_sync()`; `outputs` find the unused
        parameters when `find_unused_parameters=True`, as in torch.
        """
        if self.static:
            raise NotImplementedError(
                "reducer.prepare_for_backward() with static_graph=True is not supported by "
                f"lockstep's engine (rank {self.rank}): a static graph routes the forward's "
                "outputs itself. Expected static_graph=False; or unset LOCKSTEP_ENGINE."
            )
        now = time.perf_counter()
        unused_of = self.unused_of() if self.unused_of is not None else None
        self.arm(unused_of(outputs) if unused_of is not None else [], now, now)

    def _rebuild_buckets(self) -> bool:
        """Re-bucket in the observed ready order if due; True when it did."""
        before = self._rebuilt
        self.rebuild_if_needed()
        return self._rebuilt and not before

    def _delay_all_reduce(self) -> NoReturn:
        raise NotImplementedError(
            "reducer._delay_all_reduce() (static_graph with manual optimization in Lightning) "
            "is not supported by lockstep's engine; expected static_graph=False or automatic "
            "optimization. Unset LOCKSTEP_ENGINE to use torch's engine for this run."
        )


class _TorchBase(TorchDDP):
    """torch's class as a base only: construction, pickling and the module's state dict."""

    def __init__(self) -> None:  # reached from lockstep's constructor; torch's never runs
        nn.Module.__init__(self)

    def __setstate__(self, state: dict[str, Any]) -> None:  # torch's rebuilds its reducer
        nn.Module.__setstate__(self, state)


def _refusal(name: str) -> Callable[..., NoReturn]:
    def refused(*args: Any, **kwargs: Any) -> NoReturn:
        raise NotImplementedError(
            f"torch's DistributedDataParallel.{name} reads torch's C++ reducer, which "
            "lockstep's engine replaces (LOCKSTEP_ENGINE=lockstep); it is not provided. "
            "Unset LOCKSTEP_ENGINE to use torch's engine, or see docs/frameworks.md."
        )

    refused.__name__ = name
    return refused


def _refuse_torch_internals() -> None:
    """Every method of torch's class that lockstep's class lacks refuses by name."""
    for name, value in vars(TorchDDP).items():
        if name.startswith("__") or name in _KEPT or name in _PROVIDED or name == "train":
            continue
        if isinstance(value, property) or name in dir(DistributedDataParallel):
            continue
        setattr(_TorchBase, name, _refusal(name))


class TorchFacedDDP(DistributedDataParallel, _TorchBase):
    """lockstep's engine, an instance of torch's `DistributedDataParallel`.

    Takes torch's arguments (and lockstep's keyword-only ones). Differences from
    lockstep's own class: `state_dict()` has torch's `module.` prefix, as a script
    written for torch's class expects, and `reducer` also answers
    `prepare_for_backward`, `_rebuild_buckets`.
    """

    _reducer_type = TorchFacingReducer

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _announce(self.ctx.rank, self.ctx.world_size, self._engines_checked)

    def __new__(cls, *args: Any, **kwargs: Any) -> TorchFacedDDP:
        return object.__new__(cls)  # not torch's class's, which adoption may redirect here

    def _build_runtime(self) -> None:
        super()._build_runtime()
        assert isinstance(self.reducer, TorchFacingReducer)
        self.reducer.unused_of = weakref.WeakMethod(self._unused)  # the wrapper may go first

    state_dict = nn.Module.state_dict  # torch's keys: "module." + the module's
    load_state_dict = nn.Module.load_state_dict

    def register_comm_hook(self, state: object, hook: CommHook) -> None:
        """lockstep's, and the hook's name kept for `_get_ddp_logging_data`, as torch does."""
        super().register_comm_hook(state, hook)
        self._comm_hook_name = getattr(hook, "__qualname__", type(hook).__name__)

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.pop("_comm_hook_name", None)  # a registered hook is not kept either
        return state

    def _get_ddp_logging_data(self) -> dict[str, Any]:
        """What torch's logging data holds that lockstep knows; `can_set_static_graph` False.

        `comm_hook` (the hook's `__qualname__`) is there once a hook is registered, as in
        torch's (Lightning's tests read it).
        """
        hook = getattr(self, "_comm_hook_name", None)
        return {
            **({"comm_hook": hook} if hook is not None else {}),
            "world_size": self.ctx.world_size,
            "rank": self.ctx.rank,
            "module_name": type(self.module).__name__,
            "static_graph": int(self.static_graph),
            "find_unused_parameters": int(self.find_unused_parameters),
            "gradient_as_bucket_view": int(self.gradient_as_bucket_view),
            "bucket_sizes": ", ".join(str(b.nbytes) for b in self.reducer.buckets),
            "can_set_static_graph": False,  # lockstep does not judge it
            "engine": "lockstep",
        }

    def _set_ddp_runtime_logging_sample_rate(self, sample_rate: int) -> None:
        """Accepted; lockstep's step statistics are always on (`observe/`)."""


_announced = [False]
_VARIABLE = "LOCKSTEP_ENGINE"  # lockstep.adopt.ENGINE_VARIABLE (that package imports this one)


def _announce(rank: int, world_size: int, checked: bool) -> None:
    """Once per process, on rank 0: which engine torch's class built, on which ranks.

    Every rank sent its engine in the wrap's first collective (`runtime/same_engine.py`);
    had one built torch's, the wrap would have raised instead, naming it.
    """
    if _announced[0] or rank != 0:
        return
    _announced[0] = True
    where = (
        f"on all {world_size} ranks"
        if checked or world_size == 1
        else "on rank 0 (the other ranks unchecked: init_sync=False)"
    )
    print(
        f"lockstep: torch's DistributedDataParallel built lockstep's engine {where} "
        f"({_VARIABLE}={read_variable(_VARIABLE) or 'unset, adopted in code'})",
        file=sys.stderr,
        flush=True,
    )


def _owner(cls: type, name: str) -> type | None:
    return next((c for c in cls.__mro__ if name in vars(c)), None)


def _prefer_lockstep() -> None:
    """Names lockstep's class inherits from its other bases (the Join protocol's `join`,
    `join_hook`, ...) come after torch's class in this class's order: point them back."""
    for base in DistributedDataParallel.__mro__[1:]:
        if base in (nn.Module, object):
            continue
        for name in vars(base):
            mine = _owner(TorchFacedDDP, name)
            theirs = _owner(DistributedDataParallel, name)
            if name.startswith("__") or mine in (TorchFacedDDP, theirs) or theirs is None:
                continue
            setattr(TorchFacedDDP, name, vars(theirs)[name])


_refuse_torch_internals()
_prefer_lockstep()
