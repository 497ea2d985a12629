"""The `bigdit.report` events a ComfyUI server sends: what a node of the pack shows after a sampling.

The web extension replaces a node's report with the text of such an event
(host/report.py `show_on_node`). Prompts the harness queues carry no
client id, so ComfyUI sends these events to every connected websocket; a
`ReportEvents` connected before the prompt runs receives them.

    with ReportEvents(comfy.url) as events:
        comfy.run(graph)
        text = events.wait_for("m0", "last run:")
"""
import asyncio
import json
import threading
import time

import aiohttp

REPORT_EVENT = "bigdit.report"


class ReportEvents:
    def __init__(self, url: str, timeout: float = 10.0):
        self.events: list[dict] = []  # {"node": id, "text": report}, in arrival order
        self._lock = threading.Lock()
        self._connected = threading.Event()
        self._error: BaseException | None = None
        self._loop = asyncio.new_event_loop()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._loop.run_until_complete, args=(self._listen(url),),
                                        daemon=True)
        self._thread.start()
        if not self._connected.wait(timeout):
            raise TimeoutError(f"no websocket connection to {url}/ws within {timeout} s: {self._error!r}")

    async def _listen(self, url: str):
        self._stop = asyncio.Event()
        try:
            async with aiohttp.ClientSession() as session, \
                    session.ws_connect(url.replace("http", "ws", 1) + "/ws?clientId=bigdit-tests") as ws:
                self._connected.set()
                receive = asyncio.ensure_future(self._receive(ws))
                await self._stop.wait()
                receive.cancel()
        except Exception as e:  # surfaced by the constructor's timeout message
            self._error = e

    async def _receive(self, ws):
        async for message in ws:
            if message.type != aiohttp.WSMsgType.TEXT:
                continue  # binary frames are previews
            data = json.loads(message.data)
            if data.get("type") == REPORT_EVENT:
                with self._lock:
                    self.events.append(data["data"])

    def texts(self, node_id: str) -> list[str]:
        with self._lock:
            return [e["text"] for e in self.events if e["node"] == str(node_id)]

    def wait_for(self, node_id: str, must_contain: str, timeout: float = 10.0) -> str:
        """The latest report of node `node_id` that contains `must_contain`, waiting for it."""
        deadline = time.monotonic() + timeout
        while True:
            found = [t for t in self.texts(node_id) if must_contain in t]
            if found:
                return found[-1]
            if time.monotonic() > deadline:
                raise TimeoutError(f"node {node_id} sent no report containing {must_contain!r} within {timeout} s; "
                                   f"its reports: {self.texts(node_id)}")
            time.sleep(0.05)

    def clear(self) -> None:
        with self._lock:
            self.events.clear()

    def close(self) -> None:
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
