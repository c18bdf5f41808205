"""Keep lockstep's own bookkeeping out of the graphs that torch.compile captures.

torch.compile (TorchDynamo) traces user code and skips torch's own files; left
alone, it would treat lockstep as user code and trace the wrapper's forward,
its timers, its step state and its collectives, each untraceable call a graph
break. `keep_out_of_graphs` puts lockstep's source folder on Dynamo's skip list
(`torch._dynamo.trace_rules.add`), as torch's own DistributedDataParallel is:
under `torch.compile(DDP(model))` the wrapper's frame runs eagerly and the
wrapped module's forward is compiled as one graph. docs/compat.md measures it.
"""

from __future__ import annotations

from functools import cache


@cache
def keep_out_of_graphs() -> bool:
    """Ask Dynamo to skip every frame of the lockstep package (once per process).

    Returns:
        True if Dynamo now skips lockstep, False where this torch has no Dynamo.
    """
    try:
        from torch._dynamo import trace_rules
    except ImportError:  # a torch built without Dynamo: nothing traces lockstep
        return False
    trace_rules.add(__name__.split(".")[0])
    return True
