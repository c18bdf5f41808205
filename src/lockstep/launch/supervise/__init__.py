"""Supervision: start this node's workers through torch.distributed.elastic, watch them, report.

`runner.py` builds the run; `agent.py` is torch's agent with whole-group failover;
`bootstrap.py` is each worker's first frame; `group.py` holds what nodes tell each other
when workers stop; `scratch.py` the launcher's scratch folder.
"""
