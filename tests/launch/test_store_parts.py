"""The parts under the launchers' store: the seal, the secret, bounded calls, scratch folders."""

from __future__ import annotations

import os
import pickle
import re
import socket
import subprocess
import sys
import time

import pytest

from lockstep.launch.rendezvous.flood import FloodWatch, StoreFloodError
from lockstep.launch.rendezvous.secret import (
    SECRET_VARIABLE,
    Opened,
    Seal,
    SecretError,
    Signer,
    load_secret,
)
from lockstep.launch.rendezvous.store import BoundedStore, StoreUnreachable, host
from lockstep.launch.supervise import scratch


def test_only_values_sealed_with_the_secret_under_their_key_open():
    signer = Signer(b"a-secret-of-enough-length")
    sealed = signer.seal("lockstep/r0/report/1", {"cause": "x", "final": True})
    assert signer.open("lockstep/r0/report/1", sealed) == {"cause": "x", "final": True}
    assert signer.open("lockstep/r0/report/1", sealed.encode()) == {"cause": "x", "final": True}
    assert signer.open("lockstep/r1/report/1", sealed) is None  # moved to another key
    assert Signer(b"another-secret-of-length").open("lockstep/r0/report/1", sealed) is None
    tampered = sealed.replace('\\"x\\"', '\\"y\\"')
    assert tampered != sealed and signer.open("lockstep/r0/report/1", tampered) is None
    for junk in (None, b"", b"\x80\x04junk", pickle.dumps(object), "[1, 2]", '{"v": 1}'):
        assert signer.open("lockstep/r0/report/1", junk) is None


def test_the_secret_comes_from_a_file_the_environment_or_one_node(tmp_path, monkeypatch):
    monkeypatch.delenv(SECRET_VARIABLE, raising=False)
    with pytest.raises(SecretError, match="a job on 2 nodes needs a shared secret"):
        load_secret(2, None, node_rank=1)
    generated = load_secret(1, None)
    assert len(generated) == 64 and os.environ[SECRET_VARIABLE] == generated.decode()
    monkeypatch.setenv(SECRET_VARIABLE, "short")
    with pytest.raises(SecretError, match="expected at least 16"):
        load_secret(2, None)
    path = tmp_path / "secret"
    path.write_text("from-a-file-0123456789\n")
    path.chmod(0o600)
    assert load_secret(2, str(path)) == b"from-a-file-0123456789"
    with pytest.raises(SecretError, match="cannot read --secret-file"):
        load_secret(2, str(tmp_path / "missing"))


def test_a_hosted_store_listens_on_its_address_only():
    server, port = host("127.0.0.1", 0, timeout_s=5)
    client = BoundedStore("127.0.0.1", port, op_timeout_s=5)
    try:
        client.call("set", "k", "v")
        assert client.read("k") == b"v" and client.read("absent") is None
        listening = subprocess.run(["ss", "-Hltn"], capture_output=True, text=True).stdout
        ours = [line.split()[3] for line in listening.splitlines() if f":{port} " in line + " "]
        assert ours == [f"127.0.0.1:{port}"], listening
    finally:
        client.close()
        del server


def test_a_call_to_a_silent_server_ends_within_its_bound():
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts, never answers
        client = BoundedStore("127.0.0.1", silent.getsockname()[1], op_timeout_s=1.0)
        started = time.monotonic()
        with pytest.raises(StoreUnreachable, match="did not answer within 1 s"):
            client.call("check", ["k"])
        assert time.monotonic() - started < 5


def test_sweep_removes_only_folders_of_launchers_that_are_gone(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    gone = tmp_path / f"{scratch.PREFIX}{dead.pid}-abc"
    alive = tmp_path / f"{scratch.PREFIX}{os.getpid()}-def"
    other = tmp_path / "torchinductor_root"
    for folder in (gone, alive, other):
        folder.mkdir()
    assert scratch.sweep(tmp_path) == [gone]
    assert not gone.exists() and alive.exists() and other.exists()


def test_a_value_sealed_with_another_secret_is_told_from_a_forgery_or_a_replay():
    ours, theirs = Signer(b"a-secret-of-enough-length"), Signer(b"another-secret-of-length")
    assert ours.fingerprint != theirs.fingerprint and len(ours.fingerprint) == 16
    other = ours.inspect("lockstep/r0/node/1", theirs.seal("lockstep/r0/node/1", 1))
    assert other == Opened(Seal.OTHER_SECRET, None, theirs.fingerprint)
    replayed = ours.inspect("lockstep/job-b/r0/node/1", ours.seal("lockstep/job-a/r0/node/1", 1))
    assert replayed.seal is Seal.NOT_OURS and replayed.value is None
    assert ours.inspect("k", ours.seal("k", [1])) == Opened(Seal.OPEN, [1], ours.fingerprint)
    assert ours.inspect("k", None).seal is Seal.ABSENT
    for junk in (b"\x80\x04junk", "[1, 2]", '{"v": 1}', '{"v": "1", "mac": "0"}'):
        assert ours.inspect("k", junk).seal in (Seal.MALFORMED, Seal.NOT_OURS), junk


def test_a_secret_file_others_can_read_or_that_is_not_text_is_refused_plainly(tmp_path):
    path = tmp_path / "secret"
    path.write_text("from-a-file-0123456789\n")
    path.chmod(0o644)
    with pytest.raises(
        SecretError, match=rf"has mode 644, .* Run `chmod 600 {re.escape(str(path))}`"
    ):
        load_secret(2, str(path), node_rank=1)
    path.write_bytes(bytes.fromhex("deadbeef") * 8)
    path.chmod(0o600)
    with pytest.raises(SecretError, match=r"is not text .* `openssl rand -hex 32 >"):
        load_secret(2, str(path), node_rank=1)


def test_a_store_past_its_bounds_on_keys_or_memory_is_named_a_flood():
    server, port = host("127.0.0.1", 0, timeout_s=5)  # held in this process, as on node 0
    client = BoundedStore("127.0.0.1", port, op_timeout_s=5)
    try:
        for index in range(30):
            client.call("set", f"k{index}", "x")
        FloodWatch("127.0.0.1:1", max_keys=30).look(client, None)  # at the bound: fine
        with pytest.raises(StoreFloodError, match="the launchers' store: 31 keys"):
            client.call("set", "one-more", "x")
            FloodWatch("127.0.0.1:1", max_keys=30).look(client, None)
        watch = FloodWatch("127.0.0.1:1", max_growth_bytes=16 << 20)
        for index in range(40):  # 40 MiB more in this process's memory
            client.call("set", f"big{index}", os.urandom(1 << 20))
        with pytest.raises(StoreFloodError, match=r"memory grew by \d+ MiB"):
            watch.look(client, None)
    finally:
        client.close()
        del server
