"""Test infrastructure: drive a real headless Chromium with nothing but the standard library.

Talks the Chrome DevTools Protocol (CDP) over ``--remote-debugging-pipe`` (file descriptors 3 and 4
of the browser, NUL-separated JSON messages): no TCP port, no websocket library, no chromedriver, no
browser download. Needs a Chromium binary; ``.ci/run`` installs Debian's ``chromium`` where missing.
Used by ``tests/e2e/test_report_browser.py`` to check the rendered ``report.html``::

    from tests.browser import Browser

    with Browser() as b:                      # raises BrowserNotFound (with the install command) if no chromium
        page = b.new_page(width=1200)
        page.goto("report.html")              # path or URL; waits for load + fonts + 2 frames
        title = page.eval_js("document.title")
        page.screenshot("report.png")         # full page by default

Cleanup guarantees: the browser runs in its own process group; ``close()`` (also called by
``__exit__``, a ``weakref.finalize`` and so at interpreter exit) asks it to quit, waits, then
SIGKILLs the whole process group and removes the temporary profile. If the Python process itself is
killed, the browser sees EOF on its pipe and exits by itself. Every flag keeps it offline.
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import select
import shutil
import signal
import tempfile
import time
import weakref
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Union

__all__ = ["Browser", "Page", "find_chromium", "BrowserError", "BrowserNotFound",
           "JSError", "CHROME_FLAGS", "browser_processes"]

#: Where we look, in order, after $HEALTHCHECK_CHROMIUM / $CHROMIUM_PATH.
#: /usr/lib/chromium/chromium is Debian's real binary; /usr/bin/chromium is a shell wrapper
#: that adds flags of its own (--enable-remote-extensions, --load-extension=...), so skip it.
CANDIDATES = ("/usr/lib/chromium/chromium", "chromium", "chromium-browser",
              "google-chrome-stable", "google-chrome", "/usr/lib/chromium-browser/chromium-browser")

INSTALL_HINT = ("Install Chromium as .ci/run does (Debian): `apt-get update && DEBIAN_FRONTEND=noninteractive "
                "apt-get install -y --no-install-recommends chromium fonts-liberation`, or set HEALTHCHECK_CHROMIUM "
                "to a Chromium/Chrome executable.")

#: Flags for a quiet, offline, deterministic headless browser.
CHROME_FLAGS = (
    "--headless",                       # new headless mode (the only one in Chromium >= 132)
    "--no-sandbox",                     # needed as root / in containers
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--no-default-browser-check",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-extensions",
    "--disable-default-apps",
    "--disable-breakpad",
    "--disable-dev-shm-usage",          # small /dev/shm in containers crashes renderers
    "--no-pings",
    "--mute-audio",
    "--hide-scrollbars",
    "--force-color-profile=srgb",
    "--password-store=basic",
    "--use-mock-keychain",
    # Even with the flags above Chromium still resolves accounts.google.com and
    # clients2.google.com at start-up; map every host name to "not found" so a
    # file:// report can never touch the network.
    "--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE localhost",
)

class BrowserError(RuntimeError):
    """The browser failed to start, crashed, timed out or returned a CDP error."""


class BrowserNotFound(BrowserError):
    """No Chromium executable was found."""


class JSError(BrowserError):
    """A JavaScript expression evaluated in the page threw."""


def find_chromium(explicit: Optional[str] = None) -> str:
    """Return the path of a Chromium executable or raise :class:`BrowserNotFound`."""
    for cand in (explicit, os.environ.get("HEALTHCHECK_CHROMIUM"), os.environ.get("CHROMIUM_PATH")):
        if cand:
            path = shutil.which(cand) or cand
            if os.path.isfile(path) and os.access(path, os.X_OK):
                return path
            raise BrowserNotFound(f"Chromium executable {cand!r} is not an executable file. {INSTALL_HINT}")
    for cand in CANDIDATES:
        path = shutil.which(cand)
        if path:
            return path
    raise BrowserNotFound(f"No Chromium/Chrome executable found (tried {', '.join(CANDIDATES)}). {INSTALL_HINT}")


def browser_processes(marker: str) -> List[int]:
    """PIDs of live processes whose command line contains ``marker`` (e.g. a profile dir)."""
    pids = []
    needle = marker.encode()
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                if needle in f.read():
                    with open(f"/proc/{d}/stat", "rb") as f2:
                        if f2.read().rsplit(b")", 1)[1].split()[0] != b"Z":   # skip zombies
                            pids.append(int(d))
        except OSError:
            continue
    return pids


def _high_fd(fd: int) -> int:
    """Move ``fd`` to a number >= 10 (close-on-exec) so 3/4 can't collide with it."""
    new = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10)
    os.close(fd)
    return new


class _Proc:
    """The bits of Popen we need, for a child started with os.posix_spawn."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: Optional[int] = None

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:       # reaped elsewhere
                self.returncode = -1
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"pid {self.pid} still running after {timeout}s")
            time.sleep(0.02)
        return self.returncode  # type: ignore[return-value]


def _cleanup(proc: Optional["_Proc"], fds: List[int], profile: Optional[str], grace: float) -> None:
    """Stop the browser for good. Safe to call several times."""
    for fd in fds:
        try:
            os.close(fd)                       # EOF on its pipe: Chromium quits on its own
        except OSError:
            pass
    fds.clear()
    if proc is not None:
        try:
            proc.wait(timeout=grace)
        except TimeoutError:
            pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whole group: browser, zygotes, renderers, gpu, utility
        except (ProcessLookupError, PermissionError):
            pass
        try:
            proc.wait(timeout=10)
        except TimeoutError:                    # pragma: no cover - would need a D-state process
            pass
    if profile:
        for _ in range(3):
            shutil.rmtree(profile, ignore_errors=True)
            if not os.path.exists(profile):
                break
            time.sleep(0.2)


class Browser:
    """A headless Chromium controlled over CDP on a pipe. Use as a context manager."""

    def __init__(self, executable: Optional[str] = None, *, timeout: float = 30.0,
                 extra_args: Iterable[str] = (), log_path: Optional[str] = None,
                 tmp_dir: Union[str, os.PathLike, None] = None):
        """``tmp_dir``: parent of the throw-away profile (e.g. pytest's ``tmp_path_factory``
        dir, so even a SIGKILLed run leaves nothing outside pytest's temp area)."""
        self.executable = find_chromium(executable)
        self.timeout = timeout
        self.extra_args = list(extra_args)
        self.profile = tempfile.mkdtemp(prefix="hc-chromium-", dir=tmp_dir)
        self.log_path = log_path or os.path.join(self.profile, "chromium.log")
        self._fds: List[int] = []
        self._buf = b""
        self._next_id = 0
        self._events: List[Dict[str, Any]] = []
        self.proc: Optional[_Proc] = None
        self._finalizer = weakref.finalize(self, _cleanup, None, self._fds, self.profile, 0)
        self._start()

    # -- process -----------------------------------------------------------------
    def _start(self) -> None:
        to_chrome_r, to_chrome_w = (_high_fd(fd) for fd in os.pipe())
        from_chrome_r, from_chrome_w = (_high_fd(fd) for fd in os.pipe())
        args = [self.executable, *CHROME_FLAGS, *self.extra_args,
                f"--user-data-dir={self.profile}", "--remote-debugging-pipe", "about:blank"]
        log_fd = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)
        try:
            # Chromium reads commands from fd 3 and writes replies to fd 4. posix_spawn's
            # file actions put the pipe ends there in the child (no preexec_fn, thread-safe);
            # setsid=True gives the browser its own session/process group for killpg().
            pid = os.posix_spawn(args[0], args, os.environ, setsid=True, file_actions=[
                (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
                (os.POSIX_SPAWN_DUP2, log_fd, 1),
                (os.POSIX_SPAWN_DUP2, log_fd, 2),
                (os.POSIX_SPAWN_DUP2, to_chrome_r, 3),
                (os.POSIX_SPAWN_DUP2, from_chrome_w, 4),
            ])
        except OSError:
            for fd in (to_chrome_r, to_chrome_w, from_chrome_r, from_chrome_w):
                os.close(fd)
            raise
        finally:
            os.close(log_fd)
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        self.proc = _Proc(pid)
        self._fds[:] = [to_chrome_w, from_chrome_r]
        self._w, self._r = to_chrome_w, from_chrome_r
        self._finalizer.detach()
        self._finalizer = weakref.finalize(self, _cleanup, self.proc, self._fds, self.profile, 3.0)
        try:
            version = self.send("Browser.getVersion", timeout=self.timeout)
        except BrowserError:
            self.close()
            raise
        self.version = version.get("product", "?")

    @property
    def pid(self) -> Optional[int]:
        return self.proc.pid if self.proc else None

    def close(self) -> None:
        """Quit the browser, kill its process group and delete the profile (idempotent)."""
        if self._finalizer.alive and self._fds and self.proc and self.proc.poll() is None:
            try:
                self.send("Browser.close", timeout=3)
            except BrowserError:
                pass
        self._finalizer()

    def __enter__(self) -> "Browser":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _log_tail(self, n: int = 2000) -> str:
        try:
            data = Path(self.log_path).read_bytes()[-n:]
            return data.decode("utf-8", "replace")
        except OSError:
            return ""

    # -- protocol ----------------------------------------------------------------
    def _read_message(self, deadline: float, what: str = "the browser") -> Dict[str, Any]:
        while b"\0" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise BrowserError(f"timed out waiting for {what}")
            ready, _, _ = select.select([self._r], [], [], min(left, 1.0))
            if not ready:
                if self.proc and self.proc.poll() is not None:
                    raise BrowserError(f"browser exited with code {self.proc.returncode}; "
                                       f"log tail:\n{self._log_tail()}")
                continue
            chunk = os.read(self._r, 1 << 20)
            if not chunk:
                raise BrowserError(f"browser closed the DevTools pipe; log tail:\n{self._log_tail()}")
            self._buf += chunk
        raw, self._buf = self._buf.split(b"\0", 1)
        return json.loads(raw)

    def send(self, method: str, params: Optional[Dict[str, Any]] = None, *,
             session_id: Optional[str] = None, timeout: Optional[float] = None) -> Dict[str, Any]:
        """Send one CDP command and return its ``result`` (events are queued)."""
        if not self._fds:
            raise BrowserError("browser is closed")
        self._next_id += 1
        msg: Dict[str, Any] = {"id": self._next_id, "method": method, "params": params or {}}
        if session_id:
            msg["sessionId"] = session_id
        data = json.dumps(msg).encode() + b"\0"
        try:
            while data:
                data = data[os.write(self._w, data):]
        except BrokenPipeError as e:
            raise BrowserError(f"browser is gone; log tail:\n{self._log_tail()}") from e
        wait = timeout or self.timeout
        deadline = time.monotonic() + wait
        while True:
            reply = self._read_message(deadline, f"the reply to {method} ({wait:g} s)")
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise BrowserError(f"{method} failed: {reply['error'].get('message')} "
                                       f"{reply['error'].get('data', '')}".rstrip())
                return reply.get("result", {})
            if "method" in reply:
                self._events.append(reply)

    def wait_event(self, method: str, *, session_id: Optional[str] = None,
                   timeout: Optional[float] = None) -> Dict[str, Any]:
        """Return (and consume) the first event ``method`` for ``session_id``."""
        deadline = time.monotonic() + (timeout or self.timeout)
        while True:
            for i, ev in enumerate(self._events):
                if ev.get("method") == method and ev.get("sessionId") == session_id:
                    return self._events.pop(i).get("params", {})
            self._events.append(self._read_message(deadline, f"event {method} ({timeout or self.timeout:g} s)"))

    def new_page(self, width: int = 1200, height: int = 800) -> "Page":
        return Page(self, width=width, height=height)


class Page:
    """One tab. ``goto`` → ``eval_js`` / ``screenshot``."""

    def __init__(self, browser: Browser, *, width: int = 1200, height: int = 800):
        self.browser = browser
        self.target_id = browser.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        self.session_id = browser.send("Target.attachToTarget",
                                       {"targetId": self.target_id, "flatten": True})["sessionId"]
        self.send("Page.enable")
        self.send("Runtime.enable")
        self.set_viewport(width, height)

    def send(self, method: str, params: Optional[Dict[str, Any]] = None, **kw) -> Dict[str, Any]:
        return self.browser.send(method, params, session_id=self.session_id, **kw)

    def set_viewport(self, width: int, height: int = 800, scale: float = 1.0) -> None:
        self.width, self.height = int(width), int(height)
        self.send("Emulation.setDeviceMetricsOverride",
                  {"width": self.width, "height": self.height, "deviceScaleFactor": scale, "mobile": False})

    def goto(self, target: Union[str, os.PathLike], *, timeout: Optional[float] = None) -> None:
        """Load a URL or a local file path and wait until it is rendered."""
        url = str(target)
        if "://" not in url and not url.startswith(("about:", "data:")):
            path = Path(url).resolve()
            if not path.is_file():
                raise FileNotFoundError(path)
            url = path.as_uri()
        self.browser._events = [e for e in self.browser._events if e.get("sessionId") != self.session_id]
        res = self.send("Page.navigate", {"url": url}, timeout=timeout)
        if res.get("errorText"):
            raise BrowserError(f"navigation to {url} failed: {res['errorText']}")
        self.browser.wait_event("Page.loadEventFired", session_id=self.session_id, timeout=timeout)
        # web fonts + two animation frames: layout and paint have settled
        self.eval_js("document.fonts.ready.then(() => new Promise(r => "
                     "requestAnimationFrame(() => requestAnimationFrame(() => r(true)))))")

    def eval_js(self, expression: str, *, timeout: Optional[float] = None) -> Any:
        """Evaluate a JS expression in the page; promises are awaited; JSON-able result returned."""
        res = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True,
                                             "awaitPromise": True, "userGesture": True}, timeout=timeout)
        if "exceptionDetails" in res:
            d = res["exceptionDetails"]
            desc = d.get("exception", {}).get("description") or d.get("text")
            raise JSError(f"JS error: {desc}")
        return res.get("result", {}).get("value")

    def screenshot(self, path: Union[str, os.PathLike], *, full_page: bool = True) -> Dict[str, int]:
        """Save a PNG (the whole scrollable page by default); returns its CSS size."""
        if full_page:
            m = self.send("Page.getLayoutMetrics")
            size = m.get("cssContentSize") or m["contentSize"]
            w, h = max(self.width, int(size["width"])), int(size["height"])
            params = {"format": "png", "captureBeyondViewport": True,
                      "clip": {"x": 0, "y": 0, "width": w, "height": h, "scale": 1}}
        else:
            w, h = self.width, self.height
            params = {"format": "png"}
        data = self.send("Page.captureScreenshot", params)["data"]
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_bytes(base64.b64decode(data))
        return {"width": w, "height": h}

    def close(self) -> None:
        try:
            self.browser.send("Target.closeTarget", {"targetId": self.target_id}, timeout=5)
        except BrowserError:
            pass

