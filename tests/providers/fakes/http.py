"""A tiny JSON-over-HTTP fake server: a route table on a ThreadingHTTPServer bound to 127.0.0.1:0.

The clouds' fakes (GCP compute/operations/billing, Azure ARM/retail prices) are route tables on this.
Each request is also recorded (method, path, query) so tests can assert what the real SDK sent.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

Reply = tuple[int, Any] | tuple[int, Any, dict[str, str]]
Handler = Callable[..., Reply]


class FakeHttpServer:
    def __init__(self) -> None:
        self.routes: list[tuple[str, re.Pattern[str], Handler]] = []
        self.requests: list[tuple[str, str, dict[str, list[str]]]] = []
        self.lock = threading.RLock()
        outer = self

        class _H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _do(self) -> None:
                parts = urlsplit(self.path)
                query = parse_qs(parts.query)
                n = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(n) if n else b""
                body = json.loads(raw) if raw.strip() else None
                with outer.lock:
                    outer.requests.append((self.command, parts.path, query))
                reply: Reply = (404, {"error": {"code": 404, "message": f"no route {self.command} {parts.path}"}})
                for method, pattern, handler in outer.routes:
                    m = pattern.fullmatch(parts.path)
                    if m and method == self.command:
                        with outer.lock:
                            reply = handler(*m.groups(), query=query, body=body, headers=self.headers)
                        break
                status, payload, *rest = reply
                extra: dict[str, str] = rest[0] if rest else {}
                data = b"" if payload is None else json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for k, v in extra.items():
                    self.send_header(k, v.replace("{base}", outer.url))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = _do

        class _Server(ThreadingHTTPServer):
            def handle_error(self, request: Any, client_address: Any) -> None:
                import sys

                if not isinstance(sys.exc_info()[1], ConnectionError):  # clients hanging up are normal
                    super().handle_error(request, client_address)

        self.httpd = _Server(("127.0.0.1", 0), _H)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def route(self, method: str, pattern: str, handler: Handler) -> None:
        self.routes.append((method, re.compile(pattern), handler))

    def start(self) -> FakeHttpServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
