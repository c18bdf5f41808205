"""The agent reads torch's private members in one place: torch must still have them.

`LockstepAgent.worker_group`, `.workers_context` and `.remaining_restarts` are the
adapters over torch's `SimpleElasticAgent` internals (`_worker_group`, `_pcontext`,
`_remaining_restarts`, torch 2.13). If a torch release renames one, this test says
which, before a live recovery meets it.
"""

from __future__ import annotations

import sys

from torch.distributed.elastic.agent.server.api import WorkerSpec
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs

from lockstep.launch.supervise.agent import LockstepAgent


class _Rendezvous:  # what WorkerSpec asks of a handler, no more
    def get_run_id(self) -> str:
        return "adapter-test"


def test_torchs_agent_still_keeps_what_the_adapters_read(tmp_path):
    spec = WorkerSpec(
        role="default",
        local_world_size=1,
        rdzv_handler=_Rendezvous(),
        entrypoint=sys.executable,
        args=("-c", "pass"),
        max_restarts=3,
    )
    agent = LocalElasticAgent(spec, DefaultLogsSpecs(log_dir=str(tmp_path)))
    # the adapters, applied to torch's own agent
    assert LockstepAgent.worker_group.fget(agent).spec is spec
    assert LockstepAgent.workers_context.fget(agent) is None  # no workers started
    assert LockstepAgent.remaining_restarts.fget(agent) == 3
    LockstepAgent.remaining_restarts.fset(agent, 1)
    assert agent._remaining_restarts == 1
