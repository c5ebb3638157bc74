"""A bounded pool of daemon threads for user environment code that may hang.

`concurrent.futures.ThreadPoolExecutor` joins its threads at interpreter exit, so one environment
step stuck forever would keep a worker process from exiting; and a stuck thread would hold its
pool slot for good. `DaemonPool` runs submitted functions on daemon threads, returns futures, and
`abandon` replaces a stuck thread with a fresh one (the stuck one exits if its function ever
returns).
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any


class DaemonPool:
    """At most `workers` daemon threads running submitted functions, returning futures.

    Unlike concurrent.futures.ThreadPoolExecutor, whose threads the interpreter joins at exit,
    a thread stuck in an environment never blocks the process from exiting, and `abandon`
    replaces such a thread: the pool starts a fresh one, and the stuck one exits when (if ever)
    its function returns.
    """

    def __init__(self, workers: int, name: str = "env") -> None:
        self._tasks: queue.SimpleQueue[tuple[Future[Any], Callable[..., Any], tuple[Any, ...]] | None] = (
            queue.SimpleQueue())
        self._lock = threading.Lock()
        self._name, self._workers, self._spawned = name, workers, 0
        self._running: set[Future[Any]] = set()
        self._abandoned: set[Future[Any]] = set()
        self._closed = False
        for _ in range(workers):
            self._spawn()

    def _spawn(self) -> None:
        self._spawned += 1
        threading.Thread(target=self._work, name=f"{self._name}-{self._spawned}", daemon=True).start()

    def _work(self) -> None:
        while (item := self._tasks.get()) is not None:
            future, fn, args = item
            with self._lock:
                if not future.set_running_or_notify_cancel():
                    continue
                self._running.add(future)
            try:
                result = fn(*args)
            except BaseException as exc:  # noqa: BLE001 (handed to the future's owner)
                future.set_exception(exc)
            else:
                future.set_result(result)
            with self._lock:
                self._running.discard(future)
                if future in self._abandoned:  # a replacement took this thread's place
                    self._abandoned.discard(future)
                    return

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        if self._closed:
            raise RuntimeError("DaemonPool.submit after close")
        future: Future[Any] = Future()
        self._tasks.put((future, fn, args))
        return future

    def abandon(self, future: Future[Any]) -> None:
        """`future`'s function will not be waited for: if it is still running, start a thread in
        place of its own (which exits once the function returns)."""
        with self._lock:
            if not self._closed and future in self._running and future not in self._abandoned:
                self._abandoned.add(future)
                self._spawn()

    def close(self) -> None:
        """Cancel what has not started and let idle threads exit; never waits for running ones."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            threads = self._workers + len(self._abandoned)
        with contextlib.suppress(queue.Empty):  # the pool's threads may take items meanwhile
            while True:
                if (item := self._tasks.get_nowait()) is not None:
                    item[0].cancel()
        for _ in range(threads):
            self._tasks.put(None)


__all__ = ["DaemonPool"]
