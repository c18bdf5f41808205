"""Live recovery, one wing: a lost worker is replaced while the other workers keep going.

Under `lockstep run --live-recovery` (docs/multinode.md) the launcher replaces a
worker that died and announces a new generation of the job's group; the survivors
re-form the group, the lowest surviving rank hands its state to the replacement, and
the interrupted step is finished with it. This package is the workers' side; the
launcher's is `lockstep.launch.recovery`. `lockstep/__init__.py` calls `install()`,
which plugs the wing in at the runtime's seams, and nowhere else:

- `runtime/recovery.py`, behind every recovery point: `LiveRecoverer` (`live/points.py`);
- the backward driver's slot (`BackwardDriver.recovery`): `LiveSteps`, one per engine
  (`live/steps.py`);
- `runtime/wrap_hooks.on_wrap`: each wrapped engine's part (`live/ddp.py`), or the
  reason it cannot be recovered;
- `runtime/waits.interrupt_with`: a wait ends when a new generation is announced;
- `context.join_with`: a replacement joins its generation's group; so does torch's
  `init_process_group` in a replacement whose script calls it (`live/torch_init.py`).

No engine, checkpoint, data or observe module imports this package
(tests/unit/test_layers.py).
"""

from __future__ import annotations

from typing import Any

from lockstep.context import join_with
from lockstep.engine.ddp import DistributedDataParallel
from lockstep.live import registry, torch_init
from lockstep.live.ddp import LiveDDP
from lockstep.live.points import LiveRecoverer
from lockstep.runtime import recovery, waits
from lockstep.runtime.wrap_hooks import on_wrap
from lockstep.sharded.engine import ShardedDataParallel


def install() -> None:
    """Plug the wing in when this process runs under `--live-recovery` (else nothing).

    Called again by a standby worker once it has its rank: the registry starts anew
    from the environment it was given.
    """
    registry.reset()
    if not registry.enabled():
        recovery.install(None)
        return
    recovery.install(LiveRecoverer())
    waits.interrupt_with(registry.announced)
    on_wrap(_attach, copies=False)
    join_with(torch_init.join_generation)
    torch_init.install()


def _attach(model: Any) -> None:
    """A wrapped engine: its part, or the reason it cannot be recovered live."""
    if registry.joining():  # a replacement receives its state over its generation's group
        torch_init.check_joined()
    if isinstance(model, DistributedDataParallel):
        LiveDDP.attach(model)
    elif isinstance(model, ShardedDataParallel):
        registry.refuse(registry.SHARDED_REFUSAL)
