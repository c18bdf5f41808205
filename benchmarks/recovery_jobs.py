"""The jobs benchmarks/recovery.py times: one node, two nodes in namespaces, torchft.

Each `run_*` function runs one job to its end in OUT and returns None, or the
one-line reason the launcher refused its flags (exit code 2 before any step: a
mode the current code does not offer yet). Anything else that fails raises with
the log's path. The training scripts write OUT/events.jsonl, OUT/kill.json and
OUT/final_rank<R>.pt (benchmarks/recovery_train.py's docstring).
"""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import time
from pathlib import Path

from lockstep.testing.netns import Host, kill_inside, two_hosts

HERE = Path(__file__).parent
TRAIN, TORCHFT = str(HERE / "recovery_train.py"), str(HERE / "recovery_torchft.py")
TIMEOUT_S = 300
NODE_PORT = 29561  # inside namespaces of our own, so no other job holds it
REJOIN_AFTER_S = 3.0  # from a lost node's kill to its launcher's new start
LIGHTHOUSE = ["--min_replicas", "1", "--quorum_tick_ms", "100", "--join_timeout_ms", "10000"]


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _refusal(code: int | None, out: Path, log: Path) -> str | None:
    """The launcher's error line when it refused its flags before any step, else None."""
    if code != 2 or (out / "events.jsonl").exists():
        return None
    lines = [line for line in log.read_text(errors="replace").splitlines() if "error:" in line]
    return lines[-1].split("error:", 1)[1].strip() if lines else f"exit code 2, see {log}"


def _check(codes: list[int | None], out: Path, logs: list[Path]) -> str | None:
    for code, log in zip(codes, logs, strict=True):
        reason = _refusal(code, out, log)
        if reason:
            return reason
    if any(code != 0 for code in codes):
        raise SystemExit(f"run failed {codes}; see {', '.join(map(str, logs))}")
    return None


def _launcher(nnodes: int, node: int, master: str, flags: list[str]) -> list[str]:
    argv = [sys.executable, "-m", "lockstep.cli", "run", "--nproc-per-node", "2"]
    if nnodes > 1:
        argv += ["--nnodes", str(nnodes), "--node-rank", str(node)]
        argv += ["--master-addr", master, "--master-port", str(NODE_PORT)]
    return [*argv, *flags]


def run_one_node(out: Path, flags: list[str], steps: int, kill: str) -> str | None:
    """`lockstep run --nproc-per-node 2 FLAGS recovery_train.py` on this machine."""
    out.mkdir(parents=True)
    argv = [*_launcher(1, 0, "", flags), TRAIN, "--out", str(out), "--steps", str(steps)]
    env = {**os.environ, "RECOVERY_KILL": kill}
    with open(out / "launcher.log", "w") as log:
        done = subprocess.run(
            argv, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=TIMEOUT_S
        )
    return _check([done.returncode], out, [out / "launcher.log"])


class _TwoNodes:
    """Both launchers of one two-node job, node N in host N, logs in OUT/node<N>.log."""

    def __init__(self, hosts: tuple[Host, Host], out: Path, flags: list[str], script: list[str]):
        self.hosts, self.out, self.flags, self.script = hosts, out, flags, script
        self.procs: list[subprocess.Popen] = []
        self.env = {**os.environ, "LOCKSTEP_JOB_SECRET": secrets.token_hex(32)}

    def start(self, node: int, env: dict[str, str]) -> None:
        argv = [*_launcher(2, node, self.hosts[0].address, self.flags), TRAIN, *self.script]
        with open(self.out / f"node{node}.log", "a") as log:
            proc = self.hosts[node].popen(
                argv, stdout=log, stderr=subprocess.STDOUT, env={**self.env, **env}
            )
        if node < len(self.procs):
            self.procs[node] = proc
        else:
            self.procs.append(proc)

    def kill_node(self, node: int) -> float:
        """SIGKILL every process in node's namespace (launcher and workers); the time."""
        killed_at = time.time()
        kill_inside(self.hosts[node].namespace)
        self.procs[node].wait(timeout=30)
        return killed_at

    def wait(self) -> list[int | None]:
        """Exit codes; once one launcher refused (2), the other is not waited for."""
        deadline = time.monotonic() + TIMEOUT_S
        while time.monotonic() < deadline:
            codes = [proc.poll() for proc in self.procs]
            if all(code is not None for code in codes) or 2 in codes:
                return codes
            time.sleep(0.1)
        return [proc.poll() for proc in self.procs]


def _lose_node(job: _TwoNodes) -> None:
    """Wait until a node-1 worker holds at the kill point, kill node 1, start it again.

    The new launcher starts REJOIN_AFTER_S after the kill (a scheduler's requeue takes
    seconds too). One that comes back before the survivors noticed the loss finds its
    dead predecessor registered in the current rendezvous round and stops ("two nodes
    were started with --node-rank 1"): it is then started again, up to 3 times.
    """
    request = job.out / "kill_request"
    deadline = time.monotonic() + TIMEOUT_S
    while not request.exists():
        if time.monotonic() > deadline or any(p.poll() is not None for p in job.procs):
            return  # the job ended or was refused; wait() reports it
        time.sleep(0.01)
    killed_at = job.kill_node(1)
    (job.out / "kill.json").write_text(f'{{"rank": "node 1", "t": {killed_at}}}')
    for _ in range(3):
        time.sleep(REJOIN_AFTER_S)
        job.start(1, {"RECOVERY_KILL": ""})
        if not _stopped_early(job.procs[1], job.procs[0]):
            return


def _stopped_early(node: subprocess.Popen, other: subprocess.Popen, within: float = 20) -> bool:
    """True if `node` exits with an error within `within` s while `other` still runs."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline and other.poll() is None:
        code = node.poll()
        if code is not None:
            return code != 0
        time.sleep(0.1)
    return False


def run_two_nodes(out: Path, flags: list[str], steps: int, kill: str, lose: bool) -> str | None:
    """Two namespaces x `lockstep run --nproc-per-node 2`; `lose`: node 1 killed whole."""
    out.mkdir(parents=True)
    script = ["--out", str(out), "--steps", str(steps)]
    with two_hosts(prefix="rcv") as hosts:
        job = _TwoNodes(hosts, out, flags, script)
        for node in (0, 1):
            job.start(node, {"RECOVERY_KILL": f"{kill}:hold" if lose and kill else kill})
        if lose and kill:
            _lose_node(job)
        codes = job.wait()
    return _check(codes, out, [out / "node0.log", out / "node1.log"])


def run_torchft(out: Path, flags: list[str], steps: int, kill: str) -> str | None:
    """A lighthouse and two replica groups under torchrun (it restarts the killed one).

    `flags` go to recovery_torchft.py (--wrapper, --step-sleep), but for `--heartbeat-ms N`, which
    goes to the lighthouse (its --heartbeat_timeout_ms, 5000 unless given: how long a
    replica that stopped heartbeating still counts, so how long a survivor waits).
    """
    out.mkdir(parents=True)
    flags, lighthouse_flags = list(flags), list(LIGHTHOUSE)
    if "--heartbeat-ms" in flags:
        at = flags.index("--heartbeat-ms")
        lighthouse_flags += ["--heartbeat_timeout_ms", flags[at + 1]]
        del flags[at : at + 2]
    bind = f"127.0.0.1:{_free_port()}"
    tool = str(Path(sys.executable).with_name("torchft_lighthouse"))
    lighthouse_log = open(out / "lighthouse.log", "w")  # noqa: SIM115 (closed below)
    lighthouse = subprocess.Popen(
        [tool, *lighthouse_flags, "--bind", bind], stdout=lighthouse_log, stderr=subprocess.STDOUT
    )
    procs, logs = [], [out / f"replica{r}.log" for r in (0, 1)]
    try:
        for replica, log in enumerate(logs):
            argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1"]
            argv += ["--nproc-per-node", "1", "--master-port", str(_free_port())]
            argv += ["--max-restarts", "1", "--monitor-interval", "0.1"]
            argv += [TORCHFT, "--out", str(out), "--steps", str(steps), *flags]
            env = {**os.environ, "RECOVERY_KILL": kill, "REPLICA_GROUP_ID": str(replica)}
            env["TORCHFT_LIGHTHOUSE"] = f"http://{bind}"
            with open(log, "w") as sink:
                procs.append(subprocess.Popen(argv, stdout=sink, stderr=subprocess.STDOUT, env=env))
        codes = [proc.wait(timeout=TIMEOUT_S) for proc in procs]
    finally:
        for proc in procs:  # torchrun passes SIGTERM on to its worker
            if proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=30)
        lighthouse.kill()
        lighthouse.wait()
        lighthouse_log.close()
    return _check(codes, out, logs)
