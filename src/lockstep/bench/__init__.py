"""`lockstep bench`: measure the collectives a training step uses, on the user's own machines.

`lockstep bench allreduce` sweeps message sizes and prints time, algorithm and bus
bandwidth; its `--json` result is what `lockstep plan --bandwidth-from` reads.
"""
