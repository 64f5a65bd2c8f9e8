"""A real headless Chromium for tests, driven through chromedriver's W3C WebDriver HTTP API
(Debian's ``chromium`` and ``chromium-driver``; ``make test`` installs both). No Selenium: the
few calls a test needs are plain JSON over HTTP."""
from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--no-first-run", "--disable-sync",
                 "--disable-dev-shm-usage", "--window-size=1400,2400"]


def missing() -> str | None:
    """Why a browser test cannot run here (None when it can)."""
    for tool in ("chromedriver", "chromium"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (apt-get install chromium chromium-driver; make test does)"
    return None


class Browser:
    """One chromedriver process and one headless Chromium session with a fresh profile."""

    def __init__(self, log_dir: Path):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.profile = tempfile.mkdtemp(prefix="sluice-chromium-")
        self.log = open(log_dir / "chromedriver.log", "w")
        self.driver = subprocess.Popen([shutil.which("chromedriver"), f"--port={port}"],
                                       stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.time() + 30
        while True:
            try:
                if self._call("GET", "/status")["ready"]:
                    break
            except OSError:
                pass
            if time.time() > deadline:
                self.close()
                raise RuntimeError(f"chromedriver did not start; see {log_dir / 'chromedriver.log'}")
            time.sleep(0.2)
        caps = {"browserName": "chrome",
                "goog:chromeOptions": {"args": CHROMIUM_ARGS + [f"--user-data-dir={self.profile}"]}}
        self.session = self._call("POST", "/session", {"capabilities": {"alwaysMatch": caps}})["sessionId"]

    def _call(self, method: str, path: str, body: dict | None = None) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            return json.loads(r.read())["value"]

    def open(self, url: str) -> None:
        self._call("POST", f"/session/{self.session}/url", {"url": url})

    def js(self, script: str, *args: Any) -> Any:
        """Run ``script`` (a function body; ``arguments[i]`` are ``args``) in the page."""
        return self._call("POST", f"/session/{self.session}/execute/sync", {"script": script, "args": list(args)})

    def wait_for(self, script: str, timeout: float = 60.0, every: float = 0.5) -> Any:
        """Poll ``script`` until it returns something truthy; return that."""
        deadline = time.time() + timeout
        while True:
            got = self.js(script)
            if got:
                return got
            if time.time() > deadline:
                raise TimeoutError(f"the page never satisfied: {script[:200]}")
            time.sleep(every)

    def screenshot(self, path: Path) -> None:
        path.write_bytes(base64.b64decode(self._call("GET", f"/session/{self.session}/screenshot")))

    def close(self) -> None:
        try:
            if getattr(self, "session", None):
                self._call("DELETE", f"/session/{self.session}")
        except OSError:
            pass
        finally:  # chromedriver and any Chromium it left: their own process group
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.driver.pid, signal.SIGTERM)
            try:
                self.driver.wait(15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.driver.pid, signal.SIGKILL)
                self.driver.wait()
            self.log.close()
            shutil.rmtree(self.profile, ignore_errors=True)
