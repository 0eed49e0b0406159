"""A deadline over a whole upstream call, its status line and headers included.

httpx's timeouts bound each read, not the call: an upstream that sends its status line and headers
a byte at a time, each inside the read timeout, held a call for minutes (140 s measured against a
9 s deadline), and with it a forwarding thread and an in-flight slot. The client's streams come from
``DeadlineBackend``: each read, write and connect waits at most until the deadline the calling
thread set (``until``), and times out past it, so httpx raises its usual timeout and the client
answers 504 as for any upstream too slow to answer. A pooled connection is read by whichever thread
calls next, so the deadline is the caller's (thread-local), not the connection's.
"""

from __future__ import annotations

import threading
import time
import typing
from collections.abc import Iterator
from contextlib import contextmanager

import httpcore

_local = threading.local()


@contextmanager
def until(deadline: float) -> Iterator[None]:
    """Network waits this thread makes inside the block end by ``deadline`` (``time.monotonic``)."""
    _local.deadline = deadline
    try:
        yield
    finally:
        _local.deadline = None


def _bounded(timeout: float | None, late: type[Exception]) -> float | None:
    """``timeout`` cut to what is left of the thread's deadline; ``late`` raised where none is."""
    deadline = getattr(_local, "deadline", None)
    if deadline is None:
        return timeout
    left = deadline - time.monotonic()
    if left <= 0:
        raise late("the call's deadline passed")
    return left if timeout is None else min(timeout, left)


class _Stream(httpcore.NetworkStream):
    """A connection whose every wait is cut to the calling thread's deadline."""

    def __init__(self, inner: httpcore.NetworkStream) -> None:
        self._inner = inner

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self._inner.read(max_bytes, _bounded(timeout, httpcore.ReadTimeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._inner.write(buffer, _bounded(timeout, httpcore.WriteTimeout))

    def close(self) -> None:
        self._inner.close()

    def start_tls(self, ssl_context: typing.Any, server_hostname: str | None = None,
                  timeout: float | None = None) -> httpcore.NetworkStream:
        return _Stream(self._inner.start_tls(ssl_context, server_hostname,
                                             _bounded(timeout, httpcore.ConnectTimeout)))

    def get_extra_info(self, info: str) -> typing.Any:
        return self._inner.get_extra_info(info)


class DeadlineBackend(httpcore.NetworkBackend):
    """httpcore's own backend, its streams bounded by the calling thread's deadline."""

    def __init__(self) -> None:
        self._inner = httpcore.SyncBackend()

    def connect_tcp(self, host: str, port: int, timeout: float | None = None,
                    local_address: str | None = None,
                    socket_options: typing.Iterable[typing.Any] | None = None) -> httpcore.NetworkStream:
        return _Stream(self._inner.connect_tcp(host, port, _bounded(timeout, httpcore.ConnectTimeout),
                                               local_address, socket_options))

    def connect_unix_socket(self, path: str, timeout: float | None = None,
                            socket_options: typing.Iterable[typing.Any] | None = None
                            ) -> httpcore.NetworkStream:
        return _Stream(self._inner.connect_unix_socket(path, _bounded(timeout, httpcore.ConnectTimeout),
                                                       socket_options))

    def sleep(self, seconds: float) -> None:
        self._inner.sleep(seconds)
