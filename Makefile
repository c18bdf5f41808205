# The only setup a newcomer needs: `make demo` and `make test`.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
# A CPU build of torch: pinned so that no tool resolves a multi-GB CUDA build.
TORCH   := torch==2.13.0

.PHONY: install test test-fast demo lint format bench soak clean compat frameworks gpu-check

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q $(TORCH)
	$(BIN)/python -m pip install -q -e '.[dev]' $(TORCH)
	touch $(STAMP)

# Three pytest-xdist workers on two cores: most multi-rank tests wait (process start,
# rendezvous, timed faults) more than they compute. Namespace, Slurm and MPI tests each
# keep to one worker (tests/conftest.py), so their timed heartbeats never race each other.
# Work goes out longest first (tests/conftest.py's order, which xdist keeps with
# --no-loadscope-reorder).
PYTEST  := $(BIN)/python -m pytest -q -n 3 --dist loadgroup --no-loadscope-reorder

# Everything but the soak scenarios (`make soak`, which CI runs after this).
test: install
	$(PYTEST) -m "not soak" tests

# The inner loop: every test but those marked slow (launchers end to end, two nodes).
test-fast: install
	$(PYTEST) -m "not slow and not soak" tests

# A character-level GPT on the standard library's source, 2 processes; pictures in runs/gpt_demo/.
demo: install
	$(BIN)/lockstep run --nproc-per-node 2 examples/gpt_demo.py

lint: install
	$(BIN)/ruff check src tests examples benchmarks
	$(BIN)/ruff format --check src tests examples benchmarks

format: install
	$(BIN)/ruff check --fix src tests examples benchmarks
	$(BIN)/ruff format src tests examples benchmarks

bench: install
	$(BIN)/python benchmarks/engine_vs_torch.py
	$(BIN)/python benchmarks/hook_cost.py
	$(BIN)/python benchmarks/observe_cost.py
	$(BIN)/python benchmarks/sharded_vs_ddp.py

# The long scenarios (tests marked `soak`: every live-recovery fault, cuts between two
# nodes, stalls, leftovers; root for the namespaces), 10 runs of each launcher and
# engine to a clean exit (one in twenty hangs without lockstep.teardown), then 20
# worker kills (in a save, mid-all-reduce, rank 0, random) and one lost node across
# two nodes, then 50 SIGKILLs and 10 SIGSTOPs at random moments of one node x 4,
# every run checked bitwise. CI runs it after `make test`; tens of minutes.
soak: install
	LOCKSTEP_EXIT_RUNS=10 $(PYTEST) -m soak tests
	cd benchmarks/soak && ../../$(BIN)/python soak_two_nodes.py --out ../../runs/soak
	cd benchmarks/soak && ../../$(BIN)/python soak_one_node.py --out ../../runs/soak_one_node

clean:
	rm -rf $(VENV) runs build *.egg-info src/*.egg-info

# torch's own DDP test suite, with torch's class and with lockstep's, side by side (not in `test`).
compat: install
	PYTHONPATH=src $(BIN)/python tests/compat/compare.py

# Accelerate's own distributed test scripts (shipped in the installed package), each under
# torchrun with 2 CPU processes, on torch's engine and on lockstep's, side by side (not in
# `test`, for time: about 90 s on 2 cores); logs in runs/frameworks/.
frameworks: install
	PYTHONPATH=src $(BIN)/python tests/frameworks/peer_scripts.py

# Every GPU test and benchmark, one table, < 10 min; the GPU machine's own python, nothing
# installed (GPU_PY=...); without CUDA the CUDA tests skip and benchmarks run at smoke sizes.
GPU_PY ?= python3
gpu-check:
	PYTHONPATH=src $(GPU_PY) tests/gpu/gpu_check.py
