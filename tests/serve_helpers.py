"""Driving a real `ggml-py serve` from tests: the server in a subprocess on 127.0.0.1 (a free port), raw HTTP over a
socket (for what an HTTP client library will not send: partial heads and bodies, lies in Content-Length), many slow
connections that never finish their request head; no internet for the client libraries under test (refuse_internet,
in this process or, through SITECUSTOMIZE, in a subprocess)."""

from __future__ import annotations

import errno
import json
import os
import resource
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from urllib.parse import urlsplit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the CLI with RLIMIT_NOFILE set first: a server under a low open-file limit (no preexec_fn: fork_exec stays vfork)
_LIMITED = ("import resource, sys\nn = int(sys.argv.pop(1))\nresource.setrlimit(resource.RLIMIT_NOFILE, (n, n))\n"
            "from ggml_py.commands.cli import main\nraise SystemExit(main(sys.argv[1:]))")


class ServerProc:
    """`ggml-py serve -m MODEL --port 0 --json ARGS` in a subprocess; `.url` once it listens, `.log` its stderr lines.
    `nofile` runs it under that open-file limit."""

    def __init__(self, model: str, *args: str, nofile: int | None = None, env: dict[str, str] | None = None) -> None:
        cmd = [sys.executable, "-m", "ggml_py"] if nofile is None else [sys.executable, "-c", _LIMITED, str(nofile)]
        self.p = subprocess.Popen([*cmd, "serve", "-m", model, "--port", "0", "--json", *args], cwd=ROOT,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  env={**os.environ, "PYTHONSAFEPATH": "1", **(env or {})})  # the installed package
        self.log: list[str] = []
        deadline = time.time() + 60
        assert self.p.stderr is not None
        while time.time() < deadline:
            line = self.p.stderr.readline()
            if not line:
                raise RuntimeError(f"the server exited: {''.join(self.log)}")
            self.log.append(line)
            if "listening on http://" in line:
                self.url = line.split("listening on ")[1].strip()
                break
        else:
            raise RuntimeError("the server did not start")
        self.host, self.port = urlsplit(self.url).hostname or "", urlsplit(self.url).port or 0
        self._reader = threading.Thread(target=self._drain, daemon=True)
        self._reader.start()

    def _drain(self) -> None:
        assert self.p.stderr is not None
        for line in self.p.stderr:
            self.log.append(line)

    @property
    def log_text(self) -> str:
        return "".join(self.log)

    def client(self, **kw):
        import openai

        kw.setdefault("api_key", "none")
        return openai.OpenAI(base_url=self.url + "/v1", **kw)

    def metrics(self) -> dict:
        import httpx

        return httpx.get(self.url + "/metrics?format=json").json()

    def rss_kib(self) -> int:
        with open(f"/proc/{self.p.pid}/status") as f:
            return int(next(ln.split()[1] for ln in f if ln.startswith("VmRSS:")))

    def wait(self, timeout: float) -> tuple[int, str]:
        """Wait for the server to exit (subprocess.TimeoutExpired if it does not): its exit code and stdout, with
        all its stderr in `.log`."""
        self.p.wait(timeout)
        assert self.p.stdout is not None
        out = self.p.stdout.read()
        self._reader.join(10)
        return self.p.returncode, out

    def stop(self, timeout: float = 30) -> tuple[int, str]:
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)
        try:
            return self.wait(timeout)
        except subprocess.TimeoutExpired:
            self.p.kill()
            return self.wait(10)


def raw_http(host: str, port: int, data: bytes, timeout: float = 10.0, shut: bool = False) -> tuple[int, dict, bytes]:
    """Send `data` as it is, read one response: (status, headers in lower case, body). `shut` half-closes the
    socket after sending."""
    with socket.create_connection((host, port), timeout=timeout) as s:
        s.sendall(data)
        if shut:
            s.shutdown(socket.SHUT_WR)
        return read_response(s)


def read_response(s: socket.socket) -> tuple[int, dict, bytes]:
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = s.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed before a response head: {buf!r}")
        buf += chunk
    head, _, body = buf.partition(b"\r\n\r\n")
    lines = head.decode("latin1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    n = int(headers.get("content-length", -1))
    while n >= 0 and len(body) < n or n < 0 and headers.get("transfer-encoding") is None:
        chunk = s.recv(65536)
        if not chunk:
            break
        body += chunk
    return status, headers, body


def post_head(path: str, length: int | None, ctype: str = "application/json", extra: str = "") -> bytes:
    cl = f"Content-Length: {length}\r\n" if length is not None else "Transfer-Encoding: chunked\r\n"
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: {ctype}\r\n{cl}{extra}\r\n").encode()


def raise_nofile(n: int) -> int:
    """Raise this process's soft open-file limit toward n (up to the hard limit); the limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < n:
        new = n if hard == resource.RLIM_INFINITY else min(n, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
        soft = new
    return soft


class SlowHeaders:
    """`n` connections that send the start of a request head and never its end (slowloris); a thread reopens the
    ones the server closes, so that `n` are always trying. `.opened` counts connections made, `.closed_by_server`
    those the server closed."""

    HEAD = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: "

    def __init__(self, host: str, port: int, n: int) -> None:
        self.addr = (host, port)
        self.n = n
        self.opened = 0
        self.closed_by_server = 0
        self.sel = selectors.DefaultSelector()
        self._stop = threading.Event()
        for _ in range(n):
            self._open()
        self.thread = threading.Thread(target=self._keep, daemon=True)
        self.thread.start()

    def _open(self) -> None:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.settimeout(5)
        try:
            s.connect(self.addr)
            s.sendall(self.HEAD)
        except OSError:
            s.close()
            return
        s.setblocking(False)
        self.sel.register(s, selectors.EVENT_READ)
        self.opened += 1

    def _keep(self) -> None:
        while not self._stop.is_set():
            for key, _ in self.sel.select(timeout=0.2):
                s = key.fileobj
                try:
                    data = s.recv(4096)  # type: ignore[union-attr]
                except OSError:
                    data = b""
                if not data:  # the server closed it: open another
                    self.sel.unregister(s)
                    s.close()  # type: ignore[union-attr]
                    self.closed_by_server += 1
                    if not self._stop.is_set():
                        self._open()

    def close(self) -> None:
        self._stop.set()
        self.thread.join(5)
        for key in list(self.sel.get_map().values()):
            key.fileobj.close()  # type: ignore[union-attr]
        self.sel.close()


_client = None


def timed_chat(url: str, max_tokens: int = 2, timeout: float = 30.0) -> tuple[float, dict]:
    """One chat completion on a new connection (Connection: close): (seconds to the whole answer, the answer)."""
    import httpx

    global _client
    if _client is None:
        _client = httpx.Client()
    body = {"messages": [{"role": "user", "content": "What is 2 + 2?"}], "max_tokens": max_tokens, "temperature": 0}
    t0 = time.perf_counter()
    r = _client.post(url + "/v1/chat/completions", json=body, timeout=timeout, headers={"Connection": "close"})
    dt = time.perf_counter() - t0
    r.raise_for_status()
    return dt, r.json()


def under_attack(url: str, n_slow: int = 1000, tries: int = 5, stop_chars: int = 2**20,
                 prompt_chars: int = 4 * 2**20, pause: float = 0.2) -> dict:
    """The issue's scenario: `n_slow` slow-header connections open, one client sending a stop string of
    `stop_chars` characters and one a prompt of `prompt_chars`, over and over, while `tries` 2-token chat requests
    are timed. Returns the latencies and what the hostile clients got."""
    import httpx

    u = urlsplit(url)
    raise_nofile(n_slow + 256)
    slow = SlowHeaders(u.hostname or "", u.port or 0, n_slow)
    stop = threading.Event()
    got: dict[str, list[int]] = {"stop": [], "prompt": []}
    started = {k: threading.Event() for k in got}
    msgs = [{"role": "user", "content": "Hi"}]
    bodies = {"stop": ("/v1/chat/completions", {"messages": msgs, "max_tokens": 2, "stop": ["x" * stop_chars]}),
              "prompt": ("/v1/completions", {"prompt": "word " * (prompt_chars // 5), "max_tokens": 2})}

    def hostile(kind: str) -> None:
        path, body = bodies[kind]
        raw = json.dumps(body).encode()
        with httpx.Client(timeout=60) as c:
            while not stop.is_set():
                started[kind].set()
                r = c.post(url + path, content=raw, headers={"Content-Type": "application/json"})
                got[kind].append(r.status_code)

    threads = [threading.Thread(target=hostile, args=(k,), daemon=True) for k in got]
    try:
        for t in threads:
            t.start()
        for e in started.values():
            e.wait(10)
        latencies = []
        for _ in range(tries):
            dt, answer = timed_chat(url)
            assert answer["usage"]["completion_tokens"] <= 2
            latencies.append(dt)
            time.sleep(pause)
        slow_open = len(slow.sel.get_map())
    finally:
        stop.set()
        for t in threads:
            t.join(60)
        slow.close()
    return {"latencies_s": latencies, "hostile_statuses": {k: sorted(set(v)) for k, v in got.items()},
            "hostile_requests": {k: len(v) for k, v in got.items()}, "slow_connections_open": slow_open,
            "slow_connections_made": slow.opened, "slow_closed_by_server": slow.closed_by_server}


# -- no internet: what a client library tries to reach beyond this machine ------------------------------------------
def _loopback(host: object) -> bool:
    import ipaddress

    if isinstance(host, bytes):
        host = host.decode("ascii", "replace")
    if not isinstance(host, str):
        return True  # not an internet address (AF_UNIX paths and the like)
    if host.lower() in ("localhost", "localhost.", ""):
        return True
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return False  # a name other than localhost: it would be looked up, i.e. reach a resolver


def refuse_internet(record: Callable[[str], None]) -> Callable[[], None]:
    """From now on, in this process, every name lookup of a host other than localhost and every connection to an
    address outside 127.0.0.0/8 and ::1 is recorded (`record("getaddrinfo example.com:443")`) and refused at once
    (OSError), as on a machine without a network; loopback traffic goes through. Returns the function that undoes
    it. Used in-process by the client tests and in their subprocesses (SITECUSTOMIZE below)."""
    orig_gai, orig_connect, orig_connect_ex = socket.getaddrinfo, socket.socket.connect, socket.socket.connect_ex

    def getaddrinfo(host, port, *args, **kw):  # type: ignore[no-untyped-def]
        if not _loopback(host):
            record(f"getaddrinfo {host}:{port}")
            raise socket.gaierror(socket.EAI_NONAME, f"no network in this test ({host})")
        return orig_gai(host, port, *args, **kw)

    def check(sock: socket.socket, address: object) -> None:
        if sock.family in (socket.AF_INET, socket.AF_INET6) and isinstance(address, tuple) \
                and not _loopback(address[0]):
            record(f"connect {address[0]}:{address[1]}")
            raise OSError(errno.ENETUNREACH, f"no network in this test ({address[0]})")

    def connect(self, address):  # type: ignore[no-untyped-def]
        check(self, address)
        return orig_connect(self, address)

    def connect_ex(self, address):  # type: ignore[no-untyped-def]
        check(self, address)
        return orig_connect_ex(self, address)

    socket.getaddrinfo = getaddrinfo  # type: ignore[assignment]
    socket.socket.connect = connect  # type: ignore[method-assign]
    socket.socket.connect_ex = connect_ex  # type: ignore[method-assign]

    def undo() -> None:
        socket.getaddrinfo = orig_gai  # type: ignore[assignment]
        socket.socket.connect = orig_connect  # type: ignore[method-assign]
        socket.socket.connect_ex = orig_connect_ex  # type: ignore[method-assign]

    return undo


# a sitecustomize.py for a subprocess (its folder and this one on PYTHONPATH): refuse_internet from its start, each
# attempt appended as a line to the file $GGML_PY_TEST_NET_LOG
SITECUSTOMIZE = """\
import os
from serve_helpers import refuse_internet


def _record(what, _path=os.environ["GGML_PY_TEST_NET_LOG"]):
    with open(_path, "a") as f:
        f.write(what + "\\n")


refuse_internet(_record)
"""
