"""Which of torch's DDP tests lockstep is held to, and which it is excused from (with why).

`BEHAVIOUR_SUBSET` is what `make test` runs with lockstep's class: the tests of
`DistributedTest._DistTestBase` that build a DDP wrapper and pass with torch's own
class on a CPU machine (gloo, world size 2), less `EXCLUDED`. `make compat`
measures both lists again and says when this one has drifted from the measurement.
"""

from __future__ import annotations

# Tests that read torch's private internals rather than DDP's behaviour.
EXCLUDED: dict[str, str] = {
    "test_ddp_logging_data_cpu": (
        "reads torch's logging data (`_get_ddp_logging_data()`, "
        "`_set_ddp_runtime_logging_sample_rate`): fields of torch's C++ reducer and logger "
        "(bucket sizes it chose, its comm-hook name, its rebuild counters), not DDP behaviour"
    ),
    "test_static_graph_api_cpu": (
        "the behaviour it checks passes (`_set_static_graph()` after training raises "
        "RuntimeError 'should be called before training loop starts'); its last line then "
        "reads the error back from torch's logging data (`_get_ddp_logging_data()['error']`). "
        "The behaviour is also tested in tests/dist/test_dropin_errors.py"
    ),
}

BEHAVIOUR_SUBSET: tuple[str, ...] = (
    "test_DistributedDataParallelCPU",
    "test_DistributedDataParallelCPU_grad_is_view",
    "test_DistributedDataParallel_requires_grad",
    "test_accumulate_gradients_no_sync",
    "test_accumulate_gradients_no_sync_allreduce_hook",
    "test_accumulate_gradients_no_sync_allreduce_with_then_hook",
    "test_accumulate_gradients_no_sync_grad_is_view",
    "test_ddp_create_graph",
    "test_grads_same_across_ranks_with_no_sync",
)
