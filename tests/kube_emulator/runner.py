"""Run the emulator on 127.0.0.1 (a free port) in a background thread with its own event loop."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import kmock
import yaml

from .server import KubeEmulator

T = TypeVar("T")


class EmulatorThread:
    """`with EmulatorThread() as emu:` → `emu.url`, `emu.write_kubeconfig(path)`, `emu.call(fn)`."""

    def __init__(self) -> None:
        self.emulator: KubeEmulator | None = None
        self.url = ""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="kube-emulator", daemon=True)

    def _main(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as exc:  # surfaced to the starting thread
            self._error = exc
            self._ready.set()

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        handler = KubeEmulator()
        async with handler, kmock.Server(handler, host="127.0.0.1") as server:
            self.emulator = handler
            self.url = f"http://127.0.0.1:{server.port}"
            handler.server_url = self.url
            self._ready.set()
            await self._stop.wait()

    def __enter__(self) -> EmulatorThread:
        self._thread.start()
        self._ready.wait(30)
        if self._error is not None:
            raise RuntimeError(f"kube emulator failed to start: {self._error!r}") from self._error
        if not self.url:
            raise RuntimeError("kube emulator did not start within 30 s")
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(15)

    def call(self, fn: Callable[[KubeEmulator], T]) -> T:
        """Run `fn(emulator)` on the emulator's loop (its store is not thread-safe)."""
        assert self._loop is not None and self.emulator is not None
        emulator = self.emulator

        async def run() -> T:
            return fn(emulator)

        future: concurrent.futures.Future[T] = asyncio.run_coroutine_threadsafe(run(), self._loop)
        return future.result(10)

    def write_kubeconfig(self, path: Path, namespace: str = "default", token: str = "emulator-token") -> Path:
        """A kubeconfig for this emulator; the token names the caller in `emulator.audit_log`."""
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "emulator", "cluster": {"server": self.url}}],
            "users": [{"name": "emulator", "user": {"token": token}}],
            "contexts": [
                {"name": "emulator", "context": {"cluster": "emulator", "user": "emulator", "namespace": namespace}}
            ],
            "current-context": "emulator",
        }
        path.write_text(yaml.safe_dump(config))
        return path
