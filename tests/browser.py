"""Headless Chromium driven over the DevTools protocol, for tests of ComfyUI's web page.

`Browser` starts Debian's /usr/bin/chromium with --remote-debugging-pipe (JSON
messages, each ended by a NUL byte, on fds 3 and 4), so no port is opened and
nothing beyond the standard library is needed. It attaches to the one page
target; `goto`, `evaluate` (awaits promises, returns JSON values), `wait_for`
and `screenshot` are all it offers. Every call is bounded in time.

The flags are those that run on these machines as root with no network:
--no-sandbox, no GPU, and no background connections that would be refused.
"""
import base64
import fcntl
import json
import os
import select
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

CHROMIUM = Path("/usr/bin/chromium")
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--hide-scrollbars", "--mute-audio")


class BrowserError(RuntimeError):
    pass


class Browser:
    def __init__(self, width=1400, height=900, timeout=30.0):
        if not CHROMIUM.exists():
            raise FileNotFoundError(f"{CHROMIUM} not found (Debian package 'chromium')")
        self.timeout = timeout
        self._profile = tempfile.mkdtemp(prefix="bigdit-chromium-")
        to_browser_r, self._to_browser = os.pipe()
        self._from_browser, from_browser_w = os.pipe()

        def child_fds():
            # Chromium reads commands on fd 3 and writes replies to fd 4. Go through close-on-exec
            # copies above 10 first: a pipe end may itself be fd 3 or 4.
            read_end = fcntl.fcntl(to_browser_r, fcntl.F_DUPFD_CLOEXEC, 10)
            write_end = fcntl.fcntl(from_browser_w, fcntl.F_DUPFD_CLOEXEC, 10)
            os.dup2(read_end, 3)
            os.dup2(write_end, 4)

        # close_fds=False keeps fds 3 and 4; every fd Python opened is close-on-exec anyway.
        self._proc = subprocess.Popen(
            [str(CHROMIUM), *FLAGS, f"--user-data-dir={self._profile}", f"--window-size={width},{height}",
             "--remote-debugging-pipe", "about:blank"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            preexec_fn=child_fds, close_fds=False)
        os.close(to_browser_r)
        os.close(from_browser_w)
        self._next_id = 0
        self._buffer = b""
        self.console = []  # (level, text) of console messages and uncaught exceptions, for failure messages
        try:
            page = self._page_target()
            self._session = self.send("Target.attachToTarget", {"targetId": page, "flatten": True},
                                      session=False)["sessionId"]
            self.send("Page.enable")
            self.send("Runtime.enable")
            self.send("Emulation.setDeviceMetricsOverride",
                      {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False})
        except Exception:
            self.close()
            raise

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        for fd in (self._to_browser, self._from_browser):
            try:
                os.close(fd)
            except OSError:
                pass
        shutil.rmtree(self._profile, ignore_errors=True)

    # -- protocol ------------------------------------------------------------
    def _read_message(self, deadline) -> dict:
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("no message from Chromium in time")
            ready, _, _ = select.select([self._from_browser], [], [], left)
            if ready:
                chunk = os.read(self._from_browser, 1 << 20)
                if not chunk:
                    raise BrowserError(f"Chromium closed the pipe (exit code {self._proc.poll()})")
                self._buffer += chunk
        raw, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(raw)

    def _record_event(self, message):
        method, params = message.get("method"), message.get("params", {})
        if method == "Runtime.consoleAPICalled":
            text = " ".join(str(a.get("value", a.get("description", ""))) for a in params.get("args", []))
            self.console.append((params.get("type"), text))
        elif method == "Runtime.exceptionThrown":
            details = params.get("exceptionDetails", {})
            self.console.append(("exception", details.get("exception", {}).get("description")
                                 or details.get("text", "")))

    def send(self, method, params=None, session=True, timeout=None):
        self._next_id += 1
        message = {"id": self._next_id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = self._session
        os.write(self._to_browser, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + (timeout or self.timeout)
        while True:
            reply = self._read_message(deadline)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise BrowserError(f"{method}: {reply['error'].get('message')}")
                return reply.get("result", {})
            self._record_event(reply)

    def _page_target(self) -> str:
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            targets = self.send("Target.getTargets", session=False)["targetInfos"]
            pages = [t["targetId"] for t in targets if t["type"] == "page"]
            if pages:
                return pages[0]
            time.sleep(0.1)
        raise TimeoutError("Chromium opened no page")

    # -- page ----------------------------------------------------------------
    def goto(self, url):
        self.send("Page.navigate", {"url": url})

    def evaluate(self, expression, timeout=None):
        """The JSON value of a JS expression (a promise is awaited); a JS exception raises BrowserError."""
        result = self.send("Runtime.evaluate", {"expression": expression, "awaitPromise": True,
                                                "returnByValue": True}, timeout=timeout)
        if "exceptionDetails" in result:
            details = result["exceptionDetails"]
            raise BrowserError(details.get("exception", {}).get("description") or details.get("text"))
        return result.get("result", {}).get("value")

    def wait_for(self, expression, timeout=30.0, interval=0.2):
        """Poll until the expression is truthy; returns its value."""
        deadline = time.monotonic() + timeout
        while True:
            value = self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                errors = [text for level, text in self.console if level in ("error", "exception")]
                raise TimeoutError(f"still false after {timeout} s: {expression}\n"
                                   f"page errors: {errors[-5:] or 'none'}")
            time.sleep(interval)

    def screenshot(self, path, clip=None, fmt="png", quality=85) -> Path:
        params = {"format": fmt}
        if fmt == "jpeg":
            params["quality"] = quality
        if clip:
            params["clip"] = {**clip, "scale": 1}
        data = self.send("Page.captureScreenshot", params)["data"]
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(data))
        return path
