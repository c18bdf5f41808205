"""`runtime/streams.py` and `runtime/control_device.py` on the CPU (no stream there).

The callback queued by `at_backward_end` runs once, after autograd has written
every gradient, in the order queued; outside a backward autograd refuses it.
The CUDA side (the callback on the caller's stream) is `tests/gpu/test_streams_cuda.py`.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lockstep.runtime.control_device import control_device
from lockstep.runtime.streams import at_backward_end, current_stream


def test_callback_runs_once_after_every_gradient_in_queue_order():
    a = torch.ones(3, requires_grad=True)
    b = torch.ones(3, requires_grad=True)
    seen: list[tuple[str, bool, bool]] = []

    def hook(_: torch.Tensor) -> None:
        if not seen:  # the first gradient queues both, as the engines do
            at_backward_end(lambda: seen.append(("first", a.grad is not None, b.grad is not None)))
            at_backward_end(lambda: seen.append(("second", True, True)))
        seen.append(("hook", True, True))

    a.register_post_accumulate_grad_hook(hook)
    b.register_post_accumulate_grad_hook(hook)
    (a * 2 + b * 3).sum().backward()
    ends = [s for s in seen if s[0] != "hook"]
    assert ends == [("first", True, True), ("second", True, True)]
    assert seen[-2:] == ends  # after both hooks
    (a * 2).sum().backward()  # a later backward does not run them again
    assert [s for s in seen if s[0] != "hook"] == ends


def test_outside_a_backward_autograd_refuses():
    with pytest.raises(RuntimeError):
        at_backward_end(lambda: None)


def test_no_stream_off_cuda():
    assert current_stream(torch.device("cpu")) is None


def test_control_tensors_live_on_the_cpu_for_gloo():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert control_device(None) == torch.device("cpu")
        assert control_device(dist.new_group([0])) == torch.device("cpu")
    finally:
        dist.destroy_process_group()
