"""Local servers for the remote-source tests, all on 127.0.0.1 with free ports:

- `Moto`: an S3-compatible server (moto in server mode, from PyPI).
- `RangeServer`: a static HTTP server that answers Range, ETag, If-Match and
  Last-Modified the way object stores do (http.server alone does not).
- `FaultProxy`: an HTTP proxy between stfs and either server that counts the
  requests it forwards and injects faults: 500s, 403s, dropped connections,
  slow answers, answers that never come.

Each is started by a test fixture and stopped by it (by pid / by shutdown)."""

import email.utils
import hashlib
import http.client
import http.server
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port, seconds=30, proc=None):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"nothing answers on port {port}")


class Moto:
    """moto's S3 server as a child process of the test."""

    def __init__(self, log_path, env=None):
        self.port = free_port()
        self.log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
            env={**os.environ, **(env or {})})
        wait_for_port(self.port, proc=self.proc)
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def client(self):
        import boto3
        return boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1",
                            aws_access_key_id="testing", aws_secret_access_key="testing")

    def stop(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.log.close()


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):
        # A client that hung up (a dropped or timed-out request) is expected here.
        if not isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
            super().handle_error(request, client_address)


class _RangeHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def _file(self):
        path = os.path.normpath(os.path.join(self.server.root, self.path.split("?")[0].lstrip("/")))
        if not path.startswith(self.server.root) or not os.path.isfile(path):
            return None
        return path

    def _answer(self, head):
        path = self._file()
        if path is None:
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        st = os.stat(path)
        etag = '"%s"' % hashlib.md5(f"{st.st_ino}-{st.st_size}-{st.st_mtime_ns}".encode()).hexdigest()
        mode = self.server.etags
        if mode == "weak":
            etag = "W/" + etag
        if_match = self.headers.get("If-Match")
        # A weak ETag never matches If-Match (strong comparison, RFC 9110).
        if (if_match is not None and if_match != "*" and mode not in ("none", "lastmod")
                and (mode == "weak" or etag not in [t.strip() for t in if_match.split(",")])):
            self.send_response(412)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        size, start, end, status = st.st_size, 0, st.st_size, 200
        m = re.fullmatch(r"bytes=(\d*)-(\d*)", self.headers.get("Range", "") or "")
        if m and (m.group(1) or m.group(2)):
            if m.group(1):
                start = int(m.group(1))
                end = min(size, int(m.group(2)) + 1) if m.group(2) else size
            else:
                start, end = max(0, size - int(m.group(2))), size
            if start >= size:
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{size}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            status = 206
        self.send_response(status)
        self.send_header("Content-Length", str(end - start))
        if mode not in ("none", "lastmod"):
            self.send_header("ETag", etag)
        if mode != "none":
            self.send_header("Last-Modified", email.utils.formatdate(st.st_mtime, usegmt=True))
        self.send_header("Accept-Ranges", "bytes")
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
        self.end_headers()
        if head:
            return
        with open(path, "rb") as f:
            f.seek(start)
            left = end - start
            while left:
                chunk = f.read(min(left, 1 << 20))
                if not chunk:
                    break
                self.wfile.write(chunk)
                left -= len(chunk)

    def do_GET(self):
        self._answer(False)

    def do_HEAD(self):
        self._answer(True)


class RangeServer:
    """Serves the files of `root` over HTTP with ranges and ETags: strong ones,
    weak ones (`W/"..."`, which If-Match never matches), only Last-Modified
    ("lastmod"), or neither ("none"), as servers do."""

    def __init__(self, root, etags="strong"):
        self.server = _Server(("127.0.0.1", 0), _RangeHandler)
        self.server.root = os.path.realpath(root)
        self.server.etags = etags
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self):
        self.server.shutdown()
        self.server.server_close()


class _ProxyHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def _hang_up(self):
        self.close_connection = True
        try:
            self.connection.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def _forward(self):
        proxy = self.server.proxy
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else None
        request = {"method": self.command, "path": self.path, "range": self.headers.get("Range"),
                   "authorization": self.headers.get("Authorization") or "",
                   "headers": {k.lower(): v for k, v in self.headers.items()}, "length": length}
        action = proxy.decide(request)
        if action == "drop":
            # Close without an answer: the client sees a broken connection.
            self._hang_up()
            return
        if action == "hang":
            proxy.release.wait(120)
            self.close_connection = True
            return
        if isinstance(action, int):
            payload = b"<Error><Code>InjectedFault</Code><Message>injected by the test proxy</Message></Error>"
            self.send_response(action)
            self.send_header("Content-Length", str(len(payload)))
            self.send_header("Content-Type", "application/xml")
            self.end_headers()
            self.wfile.write(payload)
            return
        if action == "error_200":
            # What S3 may answer to a copy or a completion that failed late.
            payload = b"<Error><Code>InternalError</Code><Message>injected after a 200</Message></Error>"
            self.send_response(200)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
            return
        if isinstance(action, tuple) and action[0] == "delay":
            time.sleep(action[1])
        if action == "hold":
            proxy.release.wait(120)
        conn = http.client.HTTPConnection("127.0.0.1", proxy.upstream_port, timeout=60)
        try:
            headers = {k: v for k, v in self.headers.items() if k.lower() not in ("connection", "keep-alive")}
            conn.request(self.command, self.path, body=body, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
        finally:
            conn.close()
        if action == "lose_answer":
            # The server did it; its answer never arrives.
            self._hang_up()
            return
        self.send_response(resp.status, resp.reason)
        for k, v in resp.getheaders():
            if k.lower() not in ("transfer-encoding", "connection", "content-length", "keep-alive"):
                self.send_header(k, v)
        # (A HEAD's answer has no body but the length of the object.)
        length = resp.getheader("Content-Length") if self.command == "HEAD" else None
        self.send_header("Content-Length", length or str(len(data)))
        self.end_headers()
        if self.command == "HEAD":
            return
        if action == "trickle_body":
            # Headers, then a byte a second until `release` (or the client leaves).
            for k in range(len(data)):
                if proxy.release.wait(1):
                    break
                try:
                    self.wfile.write(data[k:k + 1])
                    self.wfile.flush()
                except OSError:
                    break
            self.close_connection = True
            return
        if action == "stall_body":
            # Headers and half the body, then silence.
            self.wfile.write(data[:len(data) // 2])
            self.wfile.flush()
            proxy.release.wait(120)
            self.close_connection = True
            return
        self.wfile.write(data)

    do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _forward


class FaultProxy:
    """Forwards to 127.0.0.1:upstream_port. `rule(request) -> action` decides
    each request: None (forward), an HTTP status to answer instead, "drop",
    "hang" (until `release` is set, then drop), "hold" (until `release` is
    set, then forward), "error_200" (a 200 whose body is an S3 error), "lose_answer"
    (forward, then drop the server's answer), "stall_body" (forward the headers and half the body,
    then nothing until `release`), "trickle_body" (the headers, then a byte a
    second), or ("delay", seconds) then forward.
    `requests` lists every request seen: {method, path, range, headers
    (lower-case names), length (of the body)}."""

    def __init__(self, upstream_port):
        self.upstream_port = upstream_port
        self.rule = None
        self.requests = []
        self.lock = threading.Lock()
        self.release = threading.Event()
        self.server = _Server(("127.0.0.1", 0), _ProxyHandler)
        self.server.proxy = self
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def decide(self, request):
        with self.lock:
            self.requests.append(request)
            return self.rule(request) if self.rule else None

    def count(self, method="GET", ranged=None):
        """Requests seen with this method (ranged: only those with/without Range)."""
        with self.lock:
            return sum(1 for r in self.requests
                       if r["method"] == method and (ranged is None or bool(r["range"]) == ranged))

    def reset(self):
        with self.lock:
            self.requests.clear()
            self.rule = None
        self.release.set()
        self.release = threading.Event()

    def fail_next(self, n, action):
        """The next n requests get `action`; the rest are forwarded."""
        left = [n]

        def rule(_request):  # called under self.lock
            if left[0] > 0:
                left[0] -= 1
                return action
            return None

        self.rule = rule

    def let_go(self):
        """Answers the requests held or hung so far."""
        self.release.set()

    def stop(self):
        self.release.set()
        self.server.shutdown()
        self.server.server_close()
