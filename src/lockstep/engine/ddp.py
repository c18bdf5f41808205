"""`DistributedDataParallel`: the bucketed, overlapping engine, as a drop-in for torch's.

Wrapping checks the arguments (`engine/args.py`), checks that every rank holds
the same parameters, broadcasts rank 0's weights and buffers, and builds a
`Reducer` (buckets and hooks), plus the optional parts each argument asks for:
static graph, delayed all-reduce, skipped unused buckets. Each forward rebuilds
the buckets once if due, broadcasts buffers when asked, runs the module, and arms
the reducer; the synchronisation itself happens inside `loss.backward()`, and
`optimizer.step()` stays purely local. Before a forward: torch's rule for when it
broadcasts the module's buffers (`will_sync_module_buffers`), the broadcast itself
(from group rank 0, or under Join from the rank that owns the model, a recovery point
at the step's start), and the move of inputs to `device_ids[0]`.
"""

from __future__ import annotations

import time
import warnings
import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Joinable
from torch.utils._pytree import tree_map

from lockstep.context import DistContext, group_context
from lockstep.engine import join
from lockstep.engine.args import DDPArguments, check_module, ignore_for_model, managed_parameters
from lockstep.engine.build import (
    build_mixed_precision,
    build_nonfinite,
    build_reducer,
    build_replicas,
    with_skip,
)
from lockstep.engine.comm_hooks import check_comm_hook
from lockstep.engine.compiler import keep_out_of_graphs
from lockstep.engine.delayed import DelayedAllReduce, build_delayed
from lockstep.engine.figures import EngineFigures
from lockstep.engine.reducer import Reducer
from lockstep.engine.static_graph import StaticGraph
from lockstep.engine.unused import unreachable_parameters
from lockstep.runtime import recovery
from lockstep.runtime.bucket_collective import CommHook, CommHookCollective
from lockstep.runtime.meta import refuse_meta
from lockstep.runtime.nesting import refuse_inside_torch_ddp, refuse_wrapped_inside
from lockstep.runtime.recovery import Point
from lockstep.runtime.replicate import broadcast_tensors, copy_back, flattened
from lockstep.runtime.same_engine import check_engines
from lockstep.runtime.same_parameters import verify_same_parameters
from lockstep.runtime.step_figures import SyncToggle
from lockstep.runtime.transport import NATIVE
from lockstep.runtime.wrap_hooks import wrapped

# What `__getstate__` leaves out (a group, a hook, a Work, a tracer); `__setstate__` rebuilds it.
_PER_PROCESS = ("process_group", "ctx", "reducer", "nonfinite", "_delayed", "_static", "_mp")
_PER_PROCESS += ("_buffer_owners", "_hooked", "env_tracer", "join_announcement", "replicas")


class DistributedDataParallel(nn.Module, join.JoinableDDP, EngineFigures, SyncToggle):
    """Data-parallel wrapper with torch DDP's arguments, attributes and semantics.

    The arguments are torch 2.13's, in its positional order, then lockstep's keyword-only
    `first_bucket_cap_mb`, `allreduce` ("native", "ring", "tree", "hierarchical"),
    `local_world_size`, `check_data_passes`, `nonfinite` and `check_replicas` (every step
    compares the ranks' replicas: `runtime/replica_check.py`). `engine/args.py` documents
    each; `docs/compat.md` lists what each does here and the test that shows it.

    Raises:
        RuntimeError: no trainable parameter; process_group with device_mesh.
        ValueError: device_ids on a CPU module; an argument out of range.
        RankMismatchError: ranks hold different parameters (raised on every rank); some
            rank built torch's engine (raised on those that built lockstep's).
    """

    _reducer_type: type[Reducer] = Reducer  # a subclass may add calls (adopt/torch_face.py)

    def __init__(
        self,
        module: nn.Module,
        device_ids: Sequence[int | torch.device] | None = None,
        output_device: int | torch.device | None = None,
        dim: int = 0,
        broadcast_buffers: bool | None = None,
        init_sync: bool = True,
        process_group: dist.ProcessGroup | None = None,
        bucket_cap_mb: float | None = None,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,
        gradient_as_bucket_view: bool = True,
        static_graph: bool = False,
        delay_all_reduce_named_params: Sequence[tuple[str, nn.Parameter]] | None = None,
        param_to_hook_all_reduce: nn.Parameter | None = None,
        mixed_precision: Any = None,
        device_mesh: Any = None,
        skip_all_reduce_unused_params: bool = False,
        bucket_cap_mb_list: Sequence[float] | None = None,
        batched_grad_copy: bool = False,
        forward_sync_buffers: bool | None = None,
        *,
        first_bucket_cap_mb: float | None = None,
        allreduce: str = NATIVE,
        local_world_size: int | None = None,
        check_data_passes: bool = True,
        nonfinite: str = "raise",
        check_replicas: bool | None = None,
    ) -> None:
        super().__init__()
        Joinable.__init__(self)
        args = DDPArguments(
            device_ids,
            output_device,
            dim,
            broadcast_buffers,
            init_sync,
            process_group,
            bucket_cap_mb,
            find_unused_parameters,
            check_reduction,
            gradient_as_bucket_view,
            static_graph,
            delay_all_reduce_named_params,
            param_to_hook_all_reduce,
            mixed_precision,
            device_mesh,
            skip_all_reduce_unused_params,
            bucket_cap_mb_list,
            batched_grad_copy,
            forward_sync_buffers,
            first_bucket_cap_mb,
            allreduce,
            local_world_size,
            check_data_passes,
            nonfinite,
            check_replicas,
        )
        refuse_wrapped_inside(module, "lockstep.DistributedDataParallel")
        self._engines_checked = check_engines(args.init_sync, args.group)  # first: as torch's
        refuse_meta(module, args.group, "lockstep.DistributedDataParallel")
        ignored = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ())) | args.ignored_names
        check_module(module, args, ignored)
        self.module = module
        self._build_settings(args, ignored)
        if args.init_sync and not recovery.replacing():  # a live replacement: from a peer
            self._build_replicas()
        self._build_runtime()
        if self._delayed is not None:  # as torch: whatever init_sync says
            self._delayed.broadcast_from(self.ctx.global_rank(0))
        wrapped(self)  # upper layers attach here (LOCKSTEP_TRACE: `lockstep/observe/trace_hook.py`)

    def _build_settings(self, args: DDPArguments, ignored: set[str]) -> None:
        """Plain attributes with torch's names; everything here pickles."""
        self._args = args
        self.parameters_to_ignore = ignored
        self.dim = args.dim
        self.device_ids = list(args.device_ids) if args.device_ids else None
        self.output_device = args.output_device if self.device_ids else None
        self.forward_sync_buffers = args.forward_buffers
        self.find_unused_parameters = args.find_unused_parameters
        self.gradient_as_bucket_view = args.gradient_as_bucket_view
        self.mixed_precision = args.mixed_precision
        self.static_graph = False
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True
        self.divide_by_initial_world_size = True

    def _build_replicas(self) -> None:
        """Check that every rank holds the same parameters, then copy rank 0's state."""
        group = self._args.group
        verify_same_parameters(managed_parameters(self.module, self.parameters_to_ignore), group)
        state = self.named_state(buffers=self._args.init_buffers)
        src = group_context(group, "DistributedDataParallel").global_rank(0)
        broadcast_tensors([t for _, t in state], src=src, process_group=group)

    def _build_runtime(self) -> None:
        """What holds a process group or hooks (rebuilt after unpickling)."""
        keep_out_of_graphs()  # torch.compile traces the wrapped module, never this wrapper
        self.process_group = self._args.group
        self.ctx: DistContext = group_context(self.process_group, "DistributedDataParallel")
        named = managed_parameters(self.module, self.parameters_to_ignore)
        self.note_buffer_owners()
        self.nonfinite = build_nonfinite(self._args, self.ctx, named, self.module)
        self.reducer = build_reducer(
            self._args, self.ctx, named, self.nonfinite, self._reducer_type
        )
        self._delayed: DelayedAllReduce | None = build_delayed(
            self._args, self.process_group, self.ctx.world_size
        )
        params = [p for _, p in self.named_state(buffers=False)]
        self._mp = build_mixed_precision(self._args, self.reducer, self.module, params)
        self.nonfinite.attach(self.reducer.driver)  # its end_step after _mp's restore
        self.replicas = build_replicas(self._args, self.ctx, self.reducer, self.named_state(True))
        me = weakref.ref(self)  # the reducer holds no strong reference to its wrapper
        self.reducer.sync_requested = lambda: (w := me()) is None or w.require_backward_grad_sync
        weakref.finalize(self, self.reducer.remove_hooks)  # the module may outlive its wrapper
        self._static: StaticGraph | None = None
        if self._args.static_graph:
            self._set_static_graph()

    def named_state(self, buffers: bool) -> list[tuple[str, torch.Tensor]]:
        """Parameters (and buffers) not ignored, each tensor once."""
        named = list(self.module.named_parameters())
        if buffers:
            named += list(self.module.named_buffers())
        return [(n, t) for n, t in named if n not in self.parameters_to_ignore]

    # ---------------------------------------------------------------- pickling
    def __getstate__(self) -> dict[str, Any]:
        if self.process_group is not dist.distributed_c10d._get_default_group():
            raise RuntimeError(
                "DistributedDataParallel pickles only when it uses the default process "
                "group; this one was given another. Save module.state_dict() instead."
            )
        state = dict(self.__dict__)
        for key in _PER_PROCESS:  # a registered comm hook is not kept either
            state.pop(key, None)
        state["_args"] = self._args.without_groups()
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        """An unpickled (or deep-copied) wrapper works in the current default group."""
        super().__setstate__(state)
        Joinable.__init__(self)
        self._build_runtime()
        wrapped(self, copy=True)  # live recovery keeps the wrapper the script built

    # -------------------------------------------------- buffers and inputs
    @property
    def broadcast_buffers(self) -> bool:
        """torch's older name for `forward_sync_buffers`."""
        return self.forward_sync_buffers

    @broadcast_buffers.setter
    def broadcast_buffers(self, value: bool) -> None:
        self.forward_sync_buffers = value

    def note_buffer_owners(self) -> None:
        """The submodules holding buffers, once at wrap time as torch (a walk of every
        module at each forward cost 0.6 ms per step on 200 layers without a buffer)."""
        holds = lambda m: any(True for _ in m.buffers(recurse=False))  # noqa: E731
        self._buffer_owners = [m for m in self.module.modules() if holds(m)]

    def will_sync_module_buffers(self) -> bool:
        """Whether the next forward broadcasts buffers (torch's rule)."""
        return (
            self.require_forward_param_sync
            and self.forward_sync_buffers
            and any(True for m in self._buffer_owners for _ in m.buffers(recurse=False))
        )

    def broadcast_buffers_named(self) -> list[tuple[str, torch.Tensor]]:
        """The buffers a forward broadcasts, by name (torch's `_ddp_ignored` ones left out)."""
        named = self.module.named_buffers()
        return [(n, b) for n, b in named if not getattr(b, "_ddp_ignored", False)]

    def sync_buffers(self, src_rank: int) -> None:
        """Broadcast buffers from group rank `src_rank` (0, or under Join the owner).

        A recovery point at the step's start (`runtime/recovery.py`): after a rank lost
        in it was recovered live, this rank takes what the broadcast carries from rank
        0's post, or keeps its own buffers when its peers' broadcast already matched them.
        """
        named = self.broadcast_buffers_named()
        if not named or self.ctx.world_size == 1:
            return
        src, group = self.ctx.global_rank(src_rank), self.process_group
        chunks = list(flattened([b for _, b in named]))  # small: a model's buffers

        def launch() -> list[dist.Work]:  # all launched, then waited: one wait's latency
            return [dist.broadcast(flat, src=src, group=group, async_op=True) for _, flat in chunks]

        outcome = recovery.run(Point.BUFFERS, self.reducer.driver.steps + 1, launch, group=group)
        if outcome.ran:
            for chunk, flat in chunks:
                copy_back(chunk, flat)
        elif outcome.value is not None:
            with torch.no_grad():
                for name, buffer in named:
                    buffer.copy_(outcome.value[name])

    def to_device(self, tree: Any) -> Any:
        """Every tensor in `tree` moved to `device_ids[0]` (non-blocking)."""
        device = self.device_ids[0] if self.device_ids else None
        device = torch.device("cuda", device) if isinstance(device, int) else device
        move = lambda x: x.to(device, non_blocking=True) if torch.is_tensor(x) else x  # noqa: E731
        return tree_map(move, tree)

    # ---------------------------------------------------------------- forward
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        refuse_inside_torch_ddp("lockstep.DistributedDataParallel")
        self.reducer.driver.check_previous_step()
        grad_enabled = torch.is_grad_enabled()
        args, kwargs = self._pre_forward(grad_enabled, args, kwargs)
        self.replicas.before_forward()  # the first: which buffers a forward moves
        output = self.module(*args, **kwargs)
        # Read after the module, as torch does: Lightning's manual optimization turns the
        # switch off inside its forward (its backwards arm themselves: prepare_for_backward).
        grad_sync = grad_enabled and self.require_backward_grad_sync
        self.require_forward_param_sync = grad_sync
        if grad_sync:
            self.reducer.arm(self._unused(output), start, time.perf_counter())
            self.nonfinite.note_forward()  # fp16 autocast: GradScaler owns overflow
            self.replicas.after_forward()
            if self._static is not None:
                output = self._static.wrap_output(output)
        else:
            self.reducer.driver.forward_without_sync(accumulating=grad_enabled)
        if self._delayed is not None:
            self._delayed.point_grads_at_buffer()
        return output

    def _pre_forward(self, grad_enabled: bool, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Join's notices, the one rebuild, buffers from their owner, inputs moved and cast."""
        joining = self.join_config.enable
        if joining:
            join.before_forward(self)
        if grad_enabled:
            self.reducer.rebuild_if_needed()
        if self.will_sync_module_buffers():
            self.sync_buffers(join.common_rank(self, True) if joining else 0)
        if joining:
            join.announce_sync(self)
        if self.device_ids:
            args, kwargs = self.to_device((args, kwargs))
        if self._mp is not None:
            args, kwargs = self._mp.before_forward(args, kwargs)
        return args, kwargs

    def _unused(self, output: Any) -> list[int]:
        """Parameters this backward will not reach (pre-marked ready when it starts)."""
        if self._static is not None:
            return self._static.unused()
        if self.find_unused_parameters:
            return unreachable_parameters(output, self.reducer.params)
        return []

    # ------------------------------------------------------------ user calls
    def _set_static_graph(self) -> None:
        """Declare the graph static (torch's private call; prefer `static_graph=True`)."""
        if self.static_graph:
            warnings.warn("static_graph is already set; nothing to do.", stacklevel=2)
            return
        if self.reducer.driver.steps > 0 or self.reducer.driver.step is not None:
            raise RuntimeError(
                "_set_static_graph() should be called before training loop starts (before "
                "the first forward); this wrapper has run already. Pass static_graph=True "
                "to DistributedDataParallel instead."
            )
        self.static_graph = True
        self._static = StaticGraph(self.reducer)

    _set_params_and_buffers_to_ignore_for_model = staticmethod(ignore_for_model)

    def register_comm_hook(self, state: object, hook: CommHook) -> None:
        """Replace the bucket all-reduce with `hook(state, bucket) -> Future[Tensor]`.

        The hook receives the bucket's flat buffer unscaled and must return a future
        whose value is the averaged buffer (torch's comm-hook contract). Once only.
        """
        check_comm_hook(hook, self.ctx.rank)  # torch's refusals, torch's types
        if getattr(self, "_hooked", False):
            raise RuntimeError(
                "register_comm_hook can only be called once; a hook is already registered"
            )
        self._hooked = True
        hooked = CommHookCollective(hook, state)
        self.reducer.set_collective(self.nonfinite.wrap(with_skip(self._args, hooked)))

    @property
    def arguments(self) -> DDPArguments:
        """The constructor's arguments, validated (read-only)."""
        return self._args

    @property
    def has_comm_hook(self) -> bool:
        return getattr(self, "_hooked", False)

    def use_process_group(self, group: dist.ProcessGroup) -> None:
        """Run every later collective on `group` (live recovery re-formed the default one)."""
        self.process_group = group
        self.reducer.use_group(group)
        self.nonfinite.group = group
        self.replicas.group = group

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The wrapped module's state dict: same keys as without the wrapper."""
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Load a state dict saved from the plain module (or from this wrapper)."""
        if any(key.startswith("module.") for key in state_dict):
            state_dict = {key.removeprefix("module."): v for key, v in state_dict.items()}
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)


DDP = DistributedDataParallel
