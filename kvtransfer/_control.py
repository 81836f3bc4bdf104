"""A small key-value control channel for the gloo/NCCL backends, over Python sockets.

Why not torch's TCPStore: a TCPStore client connection sometimes takes seconds to
establish, which would stall connect(); plain Python sockets connect in milliseconds. The server also serves as the
rendezvous store of each pair's process group (`StoreAdapter`), and closing it wakes every
blocked client, which gives clean shutdown without sentinel messages.

Each receiver runs one `ControlServer`; its address and a random auth key travel in the
endpoint, so only peers that were handed the endpoint can connect. One `ControlClient` per
thread (a blocked `wait()` holds its connection).
"""

from __future__ import annotations

import secrets
import socket
import threading
import time
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

import torch.distributed as dist


def _nodelay(conn: Connection) -> None:
    # Request/reply traffic of tiny messages: without this, Nagle + delayed ACKs add latency.
    s = socket.fromfd(conn.fileno(), socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    finally:
        s.close()


def _shutdown(conn: Connection) -> None:
    # shutdown() (unlike close()) wakes a thread blocked reading this socket.
    s = socket.fromfd(conn.fileno(), socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        s.close()


class ControlClosed(ConnectionError):
    """The control server went away (peer closed or died)."""


class ControlTimeout(TimeoutError):
    pass


class ControlServer:
    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.authkey = secrets.token_bytes(16)
        self._listener = Listener((host, port), authkey=self.authkey)
        self.address: tuple[str, int] = self._listener.address
        self._data: dict[str, Any] = {}
        self._cond = threading.Condition()
        self._conns: list[Connection] = []
        self._closed = False
        self._accept = threading.Thread(target=self._accept_loop, daemon=True, name="kv-control-accept")
        self._accept.start()

    def _accept_loop(self) -> None:
        while True:
            try:
                conn = self._listener.accept()
            except Exception:
                if self._closed:
                    return
                continue  # a client failed authentication; keep serving the others
            with self._cond:
                if self._closed:
                    conn.close()
                    return
                self._conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True, name="kv-control-conn").start()

    def _serve(self, conn: Connection) -> None:
        try:
            _nodelay(conn)
            while True:
                op, args = conn.recv()
                conn.send(self._apply(op, args))
        except Exception:
            pass
        finally:
            # Under the lock, so close() never shuts down a descriptor number that was
            # already released (and possibly reused).
            with self._cond:
                if conn in self._conns:
                    self._conns.remove(conn)
                conn.close()

    def _apply(self, op: str, args: tuple) -> tuple[str, Any]:
        data = self._data
        with self._cond:
            if op == "set":
                key, value = args
                data[key] = value
                self._cond.notify_all()
                return "ok", None
            if op == "add":
                key, amount = args
                data[key] = int(data.get(key, 0)) + amount
                self._cond.notify_all()
                return "ok", data[key]
            if op == "append":
                stream, value = args
                n = int(data.get(f"{stream}/n", 0))
                data[f"{stream}/n"] = n + 1
                data[f"{stream}/{n}"] = value
                self._cond.notify_all()
                return "ok", n
            if op == "delete":
                return "ok", data.pop(args[0], None) is not None
            if op == "check":
                return "ok", all(k in data for k in args[0])
            if op == "compare_set":
                key, expected, desired = args
                current = data.get(key)
                if current == expected or (current is None and not expected):
                    data[key] = desired
                    self._cond.notify_all()
                    return "ok", desired
                return "ok", expected if current is None else current
            if op in ("get", "wait", "take"):
                keys, timeout = args
                ready = self._cond.wait_for(lambda: self._closed or all(k in data for k in keys), timeout)
                if self._closed:
                    return "closed", None
                if not ready:
                    return "timeout", f"timed out after {timeout}s waiting for {keys}"
                if op == "wait":
                    return "ok", None
                if op == "get":
                    return "ok", data[keys[0]]
                return "ok", data.pop(keys[0])
            if op == "num_keys":
                return "ok", len(data)
        return "error", f"unknown control op {op!r}"

    def close(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
            for conn in self._conns:
                _shutdown(conn)
        # accept() does not notice close(); a throwaway connection wakes it.
        try:
            socket.create_connection(self.address, timeout=1.0).close()
        except OSError:
            pass
        self._accept.join(timeout=2.0)
        self._listener.close()


class ControlClient:
    """Blocking client; not thread-safe (use one per thread, or lock)."""

    def __init__(self, address: tuple[str, int], authkey: bytes, timeout_s: float) -> None:
        self._timeout = timeout_s
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                host, port = address
                self._conn = Client((host, port), authkey=authkey)
                _nodelay(self._conn)
                break
            except ConnectionRefusedError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def _call(self, op: str, *args: Any, wait_s: float | None = None) -> Any:
        try:
            self._conn.send((op, args))
            # Bound the reply: a server that vanished without closing the socket must not
            # block this thread forever.
            bound = None if wait_s is None and op in ("get", "wait", "take") else (wait_s or 0) + self._timeout
            if bound is not None and not self._conn.poll(bound):
                raise ControlTimeout(f"control server did not answer {op} within {bound:.1f}s")
            status, value = self._conn.recv()
        except (EOFError, OSError) as exc:
            raise ControlClosed(f"control channel closed: {exc}") from None
        if status == "ok":
            return value
        if status == "timeout":
            raise ControlTimeout(value)
        if status == "closed":
            raise ControlClosed("control server closed")
        raise RuntimeError(value)

    def set(self, key: str, value: Any) -> None:
        self._call("set", key, value)

    def add(self, key: str, amount: int) -> int:
        return self._call("add", key, amount)

    def get(self, key: str, timeout_s: float | None = None) -> Any:
        return self._call("get", [key], timeout_s, wait_s=timeout_s)

    def take(self, key: str, timeout_s: float | None = None) -> Any:
        """Wait for `key`, return its value and delete it."""
        return self._call("take", [key], timeout_s, wait_s=timeout_s)

    def wait(self, keys: list[str], timeout_s: float | None = None) -> None:
        self._call("wait", list(keys), timeout_s, wait_s=timeout_s)

    def delete(self, key: str) -> bool:
        return self._call("delete", key)

    def append(self, stream: str, value: Any) -> None:
        """Append to an ordered stream `stream/0, stream/1, ...` with several writers."""
        self._call("append", stream, value)

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        return self._call("compare_set", key, expected, desired)

    def check(self, keys: list[str]) -> bool:
        return self._call("check", list(keys))

    def num_keys(self) -> int:
        return self._call("num_keys")

    def close(self) -> None:
        try:
            self._conn.close()
        except OSError:
            pass


class StoreAdapter(dist.Store):
    """torch.distributed Store over a ControlClient, for process-group rendezvous."""

    def __init__(self, client: ControlClient, prefix: str, timeout_s: float) -> None:
        super().__init__()
        self._client, self._prefix, self._timeout = client, prefix, timeout_s
        self._lock = threading.Lock()

    def _k(self, key: str) -> str:
        return f"{self._prefix}/{key}"

    def set(self, key, value) -> None:
        with self._lock:
            self._client.set(self._k(key), bytes(value) if not isinstance(value, str) else value.encode())

    def get(self, key) -> bytes:
        with self._lock:
            value = self._client.get(self._k(key), self._timeout)
        return str(value).encode() if isinstance(value, int) else value

    def add(self, key, amount) -> int:
        with self._lock:
            return self._client.add(self._k(key), int(amount))

    def compare_set(self, key, expected, desired) -> bytes:
        with self._lock:
            return self._client.compare_set(self._k(key), bytes(expected), bytes(desired))

    def wait(self, keys, timeout=None) -> None:
        seconds = self._timeout if timeout is None else timeout.total_seconds()
        with self._lock:
            self._client.wait([self._k(k) for k in keys], seconds)

    def check(self, keys) -> bool:
        with self._lock:
            return self._client.check([self._k(k) for k in keys])

    def delete_key(self, key) -> bool:
        with self._lock:
            return self._client.delete(self._k(key))

    def num_keys(self) -> int:
        with self._lock:
            return self._client.num_keys()
