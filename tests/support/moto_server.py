"""A moto S3 server on 127.0.0.1 (a real HTTP server in a child process), and a faulty TCP proxy."""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys
import threading
from contextlib import contextmanager
from typing import Iterator

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def moto_server() -> Iterator[str]:
    """Yield the endpoint URL of a moto server: ``PERSIST_TEST_S3_ENDPOINT`` if set, else a new one."""
    given = os.environ.get("PERSIST_TEST_S3_ENDPOINT")
    if given:
        yield given
        return
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env={**os.environ, **CREDENTIALS},
    )
    seen = []
    for line in proc.stderr:  # werkzeug announces the address once it listens
        seen.append(line)
        if "Running on" in line:
            break
    else:
        raise RuntimeError(f"moto server did not start: {''.join(seen)}")
    drain = threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True)
    drain.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(30)


class FaultyProxy:
    """A loopback TCP proxy to ``target``: it can reset connections mid-stream, stall, or die.

    * ``reset_connections(n, after_bytes)``: the next ``n`` connections are reset (RST) once
      ``after_bytes`` have gone from client to server on them.
    * ``stall_after(total_bytes)``: forward ``total_bytes`` client->server bytes in all, then hold
      every further byte until ``close()``.
    * ``kill()``: stop accepting and reset every open connection; later connects are refused.
    """

    def __init__(self, target_port: int) -> None:
        self._target = ("127.0.0.1", target_port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._resets_left, self._reset_after = 0, 0
        self._budget: int | None = None
        self._released = threading.Event()
        self._conns: list[socket.socket] = []
        self.resets_done = 0
        self._down = False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def reset_connections(self, n: int, after_bytes: int) -> None:
        with self._lock:
            self._resets_left, self._reset_after = n, after_bytes

    def stall_after(self, total_bytes: int) -> None:
        with self._lock:
            self._budget = total_bytes

    def outage(self, on: bool) -> None:
        """While on, reset every open connection and every new one at once (the remote is down)."""
        with self._lock:
            self._down = on
            conns, self._conns = (self._conns, []) if on else ([], self._conns)
        for c in conns:
            _reset(c)

    def kill(self) -> None:
        self._listener.close()
        with self._lock:
            conns, self._conns = self._conns, []
        for c in conns:
            _reset(c)

    def close(self) -> None:
        self._released.set()
        self.kill()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                down = self._down
            if down:
                _reset(client)
                continue
            upstream = socket.create_connection(self._target)
            with self._lock:
                self._conns += [client, upstream]
                reset_at = self._reset_after if self._resets_left > 0 else None
                if reset_at is not None:
                    self._resets_left -= 1
            threading.Thread(target=self._pump, args=(client, upstream, reset_at, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, None, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, reset_at: int | None, upstream: bool) -> None:
        sent = 0
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    dst.shutdown(socket.SHUT_WR)
                    return
                if upstream:
                    with self._lock:
                        stall = self._budget is not None and self._budget <= 0
                        if self._budget is not None:
                            self._budget -= len(data)
                    if stall:
                        self._released.wait()
                        return
                if reset_at is not None and sent + len(data) > reset_at:
                    with self._lock:
                        self.resets_done += 1
                    _reset(src)
                    _reset(dst)
                    return
                dst.sendall(data)
                sent += len(data)
        except OSError:
            _reset(src)
            _reset(dst)


def _reset(sock: socket.socket) -> None:
    """Abort ``sock`` (RST); ``shutdown`` first wakes a thread blocked in ``recv`` on it.

    A bare ``close()`` from another thread leaves that ``recv`` holding the socket open, so the
    client would see a half-open connection (a hang until its read timeout), not a reset.
    """
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    try:
        sock.close()
    except OSError:
        pass
