"""`make gpu-check`: every GPU test and benchmark in one run, one table, within 10 minutes.

    PYTHONPATH=src python3 tests/gpu/gpu_check.py            # a GPU machine's own python
    PYTHONPATH=src python3 tests/gpu/gpu_check.py --smoke    # benchmarks at tiny sizes
    PYTHONPATH=src python3 tests/gpu/gpu_check.py --out DIR  # keep junit.xml and the JSON

Nothing is installed or fetched: it needs torch, and pytest for the tests (without
pytest the tests' row says so and the benchmarks still run). Without a CUDA device
the CUDA tests skip with their reason and the benchmarks run at smoke sizes on the
CPU, labelled so: a row marked "smoke" is never a GPU figure. Each part runs in
its own process under a time limit, so one hang cannot take the table with it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS = ["tests/gpu", "tests/unit/test_streams.py"]
LIMITS_S = {"tests": 330, "gpu_vs_torch": 170, "gpu_memory": 80}


def environment_rows() -> list[tuple[str, str, str]]:
    import torch
    import torch.distributed as dist

    from lockstep.testing.torch_features import absent_from_installed_torch

    cuda = torch.cuda.is_available()
    device = torch.cuda.get_device_name(0) if cuda else "none (CPU only)"
    absent = absent_from_installed_torch()
    return [
        ("environment", f"torch {torch.__version__}", f"python {sys.version.split()[0]}"),
        ("device", device, f"NCCL {'yes' if dist.is_nccl_available() else 'no'}"),
        (
            "torch DDP arguments",
            "all of torch 2.13's" if not absent else f"{len(absent)} absent",
            "comparisons using them skip: " + ", ".join(absent) if absent else "",
        ),
    ]


def summarise_junit(xml_text: str) -> list[tuple[str, str, str]]:
    """One row per test function: counts of passed/failed/skipped, first failure's message."""
    counts: dict[str, Counter] = {}
    notes: dict[str, str] = {}
    for case in ET.fromstring(xml_text).iter("testcase"):
        name = f"{case.get('classname', '').split('.')[-1]}::{case.get('name', '').split('[')[0]}"
        outcome, note = "passed", ""
        for child in case:
            if child.tag in ("failure", "error"):
                outcome, note = "failed", (child.get("message") or "").splitlines()[0][:150]
            elif child.tag == "skipped":
                outcome, note = "skipped", (child.get("message") or "")[:150]
        counts.setdefault(name, Counter())[outcome] += 1
        if note and (outcome == "failed" or name not in notes):
            notes[name] = note
    rows = []
    for name, c in counts.items():
        result = ", ".join(f"{c[k]} {k}" for k in ("passed", "failed", "skipped") if c[k])
        rows.append((name, ("FAIL " if c["failed"] else "") + result, notes.get(name, "")))
    return rows


def run_tests(out_dir: Path) -> list[tuple[str, str, str]]:
    try:
        import pytest  # noqa: F401
    except ImportError:
        return [("tests", "not run", "pytest is not installed in this python")]
    xml = out_dir / "junit.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *TESTS]
    cmd += [f"--junitxml={xml}", "-o", "addopts="]
    code, tail = _run(cmd, LIMITS_S["tests"], log=out_dir / "tests.log")
    if not xml.exists():
        return [("tests", f"no report (exit {code})", tail)]
    return summarise_junit(xml.read_text())


def run_benchmark(name: str, smoke: bool, out_dir: Path) -> tuple[dict | None, str]:
    target = out_dir / f"{name}.json"
    cmd = [sys.executable, f"benchmarks/{name}.py", "--json", str(target)]
    code, tail = _run(cmd + (["--smoke"] if smoke else []), LIMITS_S[name], out_dir / f"{name}.log")
    if code != 0 or not target.exists():
        return None, f"exit {code}: {tail}"
    return json.loads(target.read_text()), ""


def _run(cmd: list[str], limit_s: float, log: Path) -> tuple[int | str, str]:
    """Run one part under its time limit; its whole output goes to `log`."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    try:
        done = subprocess.run(
            cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=limit_s, check=False
        )
    except subprocess.TimeoutExpired as stopped:
        log.write_text(str(stopped.stdout or "") + str(stopped.stderr or ""))
        return "timeout", f"stopped after {limit_s:.0f} s"
    log.write_text(done.stdout + done.stderr)
    text = (done.stdout + done.stderr).strip().splitlines()
    return done.returncode, " | ".join(text[-3:])[:300]


def benchmark_rows(speed: dict | None, memory: dict | None, smoke: bool, errors: dict) -> list:
    label = " (smoke, not a GPU figure)" if smoke else ""
    rows = []
    if speed is None:
        rows.append(("gpu_vs_torch" + label, "FAIL", errors["gpu_vs_torch"]))
    else:
        one = speed["ddp_world1"]
        rows.append(
            (
                f"DDP world 1, GPT {one['params_m']:.0f}M bf16{label}",
                f"ratio {one['ratio']:.3f}",
                f"lockstep {one['lockstep_ms']:.1f} ms / torch {one['torch_ms']:.1f} ms",
            )
        )
        rows.append(
            (
                f"engine CPU per step{label}",
                f"{one['engine_cpu_ms_per_step']:.2f} ms",
                f"{one['engine_cpu_us_per_tensor']:.1f} us per gradient tensor, "
                f"{one['engine_cpu_share_of_torch_step']:.1%} of torch's step",
            )
        )
        ms = speed["sharded_world2_ms"]
        rows.append(
            (
                f"world 2 gloo step{label}",
                f"stage3/fsdp2 {ms['stage3'] / ms['fsdp2']:.2f}",
                ", ".join(f"{k} {v:.1f} ms" for k, v in ms.items()),
            )
        )
    if memory is None:
        rows.append(("gpu_memory" + label, "FAIL", errors["gpu_memory"]))
    else:
        for engine, row in memory["rows"].items():
            got = row.get("states_mib")
            result = f"states {got:.0f} MiB" if got is not None else "no device figure"
            detail = f"plan {row['plan_mib']:.0f} MiB"
            if "peak_mib" in row:
                detail += f", peak {row['peak_mib']:.0f} MiB"
            rows.append((f"memory per rank: {engine}{label}", result, detail))
    return rows


def render(rows: list[tuple[str, str, str]]) -> str:
    width = [max(len(r[i]) for r in rows) for i in range(2)]
    lines = [f"{'check':{width[0]}}  {'result':{width[1]}}  detail"]
    lines += [f"{a:{width[0]}}  {b:{width[1]}}  {c}" for a, b, c in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="benchmarks at tiny sizes")
    parser.add_argument("--out", type=Path, help="keep the junit report and benchmark JSON here")
    args = parser.parse_args(argv)
    import torch

    smoke = args.smoke or not torch.cuda.is_available()
    start = time.monotonic()
    rows = environment_rows()
    with tempfile.TemporaryDirectory(prefix="lockstep-gpu-check-") as tmp:
        out = args.out or Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        rows += run_tests(out)
        speed, speed_error = run_benchmark("gpu_vs_torch", smoke, out)
        memory, memory_error = run_benchmark("gpu_memory", smoke, out)
    errors = {"gpu_vs_torch": speed_error, "gpu_memory": memory_error}
    rows += benchmark_rows(speed, memory, smoke, errors)
    rows.append(("wall time", f"{time.monotonic() - start:.0f} s", "limit 600 s"))
    print(render(rows))
    return 1 if any(r[1].startswith("FAIL") or r[1].startswith("no report") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
