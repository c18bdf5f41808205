"""The launchers' TCP stores: hosted on one address only, used with calls that always return.

`host(addr, port)` starts a TCPStore server on a socket bound to `addr` alone (torch's
own server listens on every interface; `master_listen_fd` lets us hand it our
socket), so a single-node job listens on loopback only. `BoundedStore` is a client
whose every call returns within a bound: a TCPStore client otherwise blocks for
ever when its server goes silent (a network cut, a frozen node, a program that is
not a store). A call that passes its bound drops the connection and raises
`StoreUnreachable`; the next call dials again, so a node rejoins when a cut heals.
"""

from __future__ import annotations

import queue
import socket
import threading
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from datetime import timedelta
from typing import Any

from torch.distributed import TCPStore

from lockstep.errors import LockstepError

STUCK_THREAD = "lockstep-store-stuck"


class StoreUnreachable(LockstepError):
    """A store call did not complete within its bound (or the store refused the connection)."""


class StoreLostError(LockstepError):
    """The rendezvous store (hosted by node 0's launcher) stopped answering."""

    def __init__(self, endpoint: str, error: BaseException, between: str) -> None:
        super().__init__(
            f"lost the rendezvous store at {endpoint}, which node 0's launcher hosts "
            f"({error}). Node 0 stopped or the network between {between} failed: check "
            "node 0's log."
        )


def listen(addr: str, port: int) -> socket.socket:
    """A TCP socket listening on `addr`:`port` only (port 0: a free one)."""
    family = socket.AF_INET6 if ":" in addr else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((addr, port))
        sock.listen(512)
    except OSError:
        sock.close()
        raise
    return sock


def host(addr: str, port: int, timeout_s: float) -> tuple[TCPStore, int]:
    """A TCPStore server listening on `addr` alone; returns it and its port."""
    sock = listen(addr, port)
    bound = int(sock.getsockname()[1])
    server = TCPStore(
        addr,
        bound,
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=timeout_s),
        master_listen_fd=sock.detach(),  # the server owns (and closes) the socket now
    )
    return server, bound


class _Connection:
    """One TCPStore client and the thread that makes its calls (it may block for ever)."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.store: TCPStore | None = None
        self._thread = threading.Thread(target=self._serve, name="lockstep-store", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            job, future = self._jobs.get()
            if job is None:
                return
            try:
                future.set_result(job())
            except BaseException as error:  # handed to the caller
                future.set_exception(error)

    def run(self, job: Callable[[], Any], timeout_s: float) -> Any:
        future: Future = Future()
        self._jobs.put((job, future))
        return future.result(timeout_s)

    def close(self, stuck: bool = False) -> None:
        """Let the thread end after its current call; `stuck`: that call may never return."""
        if stuck:
            self._thread.name = STUCK_THREAD
        self._jobs.put((None, None))


def stuck() -> bool:
    """Whether a store call of this process never returned (its thread blocks in C++).

    Such a thread can abort the interpreter's exit, so the launcher then leaves with
    `os._exit` once its cleanup is done.
    """
    return any(t.name == STUCK_THREAD and t.is_alive() for t in threading.enumerate())


class BoundedStore:
    """A TCPStore client whose calls return within `op_timeout_s` or raise StoreUnreachable.

    Args:
        addr, port: the server.
        op_timeout_s: the bound on one call (and on dialing).
    """

    def __init__(self, addr: str, port: int, op_timeout_s: float) -> None:
        self.addr, self.port = addr, port
        self.op_timeout_s = op_timeout_s
        self._lock = threading.Lock()
        self._conn: _Connection | None = None

    @property
    def endpoint(self) -> str:
        return f"{self.addr}:{self.port}"

    def _connection(self) -> _Connection:
        if self._conn is None:
            conn = _Connection()
            timeout = timedelta(seconds=self.op_timeout_s)
            self._conn = conn
            conn.store = self._bounded(
                conn, lambda: TCPStore(self.addr, self.port, is_master=False, timeout=timeout)
            )
        return self._conn

    def _bounded(self, conn: _Connection, job: Callable[[], Any]) -> Any:
        try:
            return conn.run(job, self.op_timeout_s)
        except (FutureTimeout, RuntimeError, OSError) as error:
            self._drop(conn, stuck=isinstance(error, FutureTimeout))
            what = "no answer" if isinstance(error, FutureTimeout) else str(error).splitlines()[0]
            raise StoreUnreachable(
                f"the store at {self.endpoint} did not answer within {self.op_timeout_s:.0f} s "
                f"({what or type(error).__name__})"
            ) from None

    def _drop(self, conn: _Connection, stuck: bool = False) -> None:
        conn.close(stuck)
        if self._conn is conn:
            self._conn = None

    def call(self, method: str, *args: Any) -> Any:
        """`store.method(*args)` on the server, within the bound."""
        with self._lock:
            conn = self._connection()
            return self._bounded(conn, lambda: getattr(conn.store, method)(*args))

    def raw(self) -> TCPStore:
        """The current client itself (for torch's code that wants a Store); dials if needed."""
        with self._lock:
            store = self._connection().store
            assert store is not None
            return store

    def read(self, key: str) -> bytes | None:
        """The value under `key`, or None when absent; never waits for the key."""
        if not self.call("check", [key]):
            return None
        return self.call("get", key)

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._drop(self._conn)
