"""A headless Chromium driven over the DevTools protocol (a websocket), for page tests.

Debian's `chromium` package, started with a fresh profile and every background service off
(the machine may be offline); tests skip when it is not installed. Only the few protocol
calls page tests need: set headers, navigate and wait for the load, evaluate, screenshot,
and the console errors and exceptions the page raised.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import shutil
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from websockets.asyncio.client import ClientConnection, connect

FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--no-first-run",
    "--disable-default-apps", "--hide-scrollbars", "--mute-audio",
)  # fmt: skip
START_S = 30.0


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        found = shutil.which(name)
        if found is not None:
            return found
    pytest.skip("no chromium installed (Debian: apt-get install -y chromium)")


class Page:
    """One tab. `errors`: console errors, uncaught exceptions and failed loads so far."""

    def __init__(self, socket: ClientConnection) -> None:
        self.socket = socket
        self.errors: list[str] = []
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._events: dict[str, asyncio.Event] = {}
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        async for raw in self.socket:
            message = json.loads(raw)
            if "id" in message:
                future = self._waiting.pop(message["id"], None)
                if future is not None and not future.done():
                    future.set_result(message)
                continue
            method, params = message.get("method", ""), message.get("params", {})
            if method == "Runtime.consoleAPICalled" and params.get("type") == "error":
                self.errors.append(" ".join(str(a.get("value")) for a in params.get("args", [])))
            elif method == "Runtime.exceptionThrown":
                self.errors.append(params["exceptionDetails"].get("text", "exception"))
            elif method == "Log.entryAdded" and params["entry"].get("level") == "error":
                self.errors.append(params["entry"].get("text", ""))
            event = self._events.get(method)
            if event is not None:
                event.set()

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        number = next(self._ids)
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._waiting[number] = future
        await self.socket.send(json.dumps({"id": number, "method": method, "params": params}))
        async with asyncio.timeout(START_S):
            reply = await future
        if "error" in reply:
            raise RuntimeError(f"{method}: {reply['error']}")
        return dict(reply.get("result", {}))

    async def goto(self, url: str) -> None:
        loaded = self._events["Page.loadEventFired"] = asyncio.Event()
        await self.call("Page.navigate", url=url)
        async with asyncio.timeout(START_S):
            await loaded.wait()

    async def evaluate(self, expression: str) -> Any:
        result = await self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def screenshot(self, path: Path, width: int, height: int) -> None:
        await self.call(
            "Emulation.setDeviceMetricsOverride",
            width=width, height=height, deviceScaleFactor=1, mobile=False,
        )  # fmt: skip
        shot = await self.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)
        await asyncio.to_thread(path.write_bytes, base64.b64decode(shot["data"]))


@contextlib.asynccontextmanager
async def open_page() -> AsyncIterator[Page]:
    """A fresh headless Chromium with one tab, closed (and its profile removed) after."""
    binary = chromium()
    profile = Path(tempfile.mkdtemp(prefix="cp-chromium-"))
    process = subprocess.Popen(  # noqa: ASYNC220 - started once, not waited on here
        [binary, *FLAGS, f"--user-data-dir={profile}", "--remote-debugging-port=0",
         "--window-size=1400,1000", "about:blank"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + START_S
        while not (port_file.exists() and port_file.read_text().count("\n") >= 1):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("chromium did not start its DevTools endpoint")
            await asyncio.sleep(0.05)
        port = int(port_file.read_text().splitlines()[0])
        async with httpx.AsyncClient(trust_env=False) as client:
            targets = (await client.get(f"http://127.0.0.1:{port}/json/list")).json()
        [tab] = [t for t in targets if t["type"] == "page"]
        async with connect(tab["webSocketDebuggerUrl"], max_size=64 * 1024 * 1024) as socket:
            page = Page(socket)
            for domain in ("Page", "Runtime", "Log", "Network"):
                await page.call(f"{domain}.enable")
            try:
                yield page
            finally:
                page._reader.cancel()
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)
        shutil.rmtree(profile, ignore_errors=True)
