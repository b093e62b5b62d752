"""agent/http.py against a real local HTTP/1.1 server (http.server in a thread) that frames its
responses by hand: chunked (with extensions and trailers), Content-Length, close-delimited, and
malformed framings that must end in a clear HttpError, never a hang."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from agent.http import HttpError, request

DOC = b'{"Events": [{"EventId": "e1", "EventType": "Preempt"}]}'

RESPONSES: dict[str, bytes] = {
    # path -> the raw bytes after the status line (headers, empty line, body)
    "/chunked": b"Transfer-Encoding: chunked\r\n\r\n"
                + b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in (DOC[:7], DOC[7:30], DOC[30:])) + b"0\r\n\r\n",
    "/chunked-ext-trailer": b"Transfer-Encoding: chunked\r\nTrailer: X-Digest\r\n\r\n"
                            b"5;name=value;q=\"x\"\r\nhello\r\n"
                            b"1\r\n \r\n"
                            b"5 ; ext\r\nworld\r\n"
                            b"0;last\r\nX-Digest: abc\r\nX-Other: 1\r\n\r\n",
    "/chunked-upper-hex": b"Transfer-Encoding: chunked\r\n\r\n1A\r\n" + b"a" * 26 + b"\r\n0\r\n\r\n",
    "/length": b"Content-Length: %d\r\n\r\n%s" % (len(DOC), DOC),
    "/close": b"Content-Type: text/plain\r\n\r\nuntil the server closes",
    "/bad-size": b"Transfer-Encoding: chunked\r\n\r\nzz\r\nhello\r\n0\r\n\r\n",
    "/no-crlf-after-chunk": b"Transfer-Encoding: chunked\r\n\r\n5\r\nhelloXX0\r\n\r\n",
    "/truncated-chunk": b"Transfer-Encoding: chunked\r\n\r\n10\r\nshort",
    "/no-last-chunk": b"Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n",
    "/short-length": b"Content-Length: 100\r\n\r\nonly this",
    "/bad-length": b"Content-Length: 12abc\r\n\r\nhello",
    "/conflicting-length": b"Content-Length: 5, 6\r\n\r\nhello!",
    "/gzip": b"Transfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n",
}
STALLS = {
    # path -> bytes sent before the server stops writing but keeps the connection open
    "/stall-in-chunk": b"Transfer-Encoding: chunked\r\n\r\n10\r\nabc",
    "/stall-before-last-chunk": b"Transfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n",
    "/stall-in-length": b"Content-Length: 10\r\n\r\nabc",
}


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    release: threading.Event

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self.path in STALLS:
            self.wfile.write(b"HTTP/1.1 200 OK\r\n" + STALLS[self.path])
            self.wfile.flush()
            self.release.wait(30)  # holds the connection open without sending more
        else:
            self.wfile.write(b"HTTP/1.1 200 OK\r\n" + RESPONSES[self.path])
            self.wfile.flush()
        self.close_connection = True

    def do_PUT(self) -> None:  # noqa: N802
        body = self.rfile.read(int(self.headers["Content-Length"]))
        reply = b"got " + body
        self.wfile.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                         b"%x\r\n%s\r\n0\r\n\r\n" % (len(reply), reply))
        self.close_connection = True

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    release = threading.Event()
    handler = type("H", (_Handler,), {"release": release})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    httpd.daemon_threads = True
    t = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_port}"
    finally:
        release.set()
        httpd.shutdown()
        httpd.server_close()


def get(url: str, timeout_s: float = 5.0, method: str = "GET", body: bytes = b""):  # type: ignore[no-untyped-def]
    return asyncio.run(request(method, url, body=body, timeout_s=timeout_s))


def test_chunked_body_is_reassembled(base_url: str) -> None:
    r = get(base_url + "/chunked")
    assert r.status == 200 and r.body == DOC
    assert "content-length" not in r.headers


def test_chunk_extensions_and_trailers(base_url: str) -> None:
    r = get(base_url + "/chunked-ext-trailer")
    assert r.body == b"hello world"
    assert "x-digest" not in r.headers  # trailers are read (the framing ends after them) and dropped


def test_upper_case_hex_size(base_url: str) -> None:
    assert get(base_url + "/chunked-upper-hex").body == b"a" * 26


def test_content_length_and_close_delimited(base_url: str) -> None:
    assert get(base_url + "/length").body == DOC
    assert get(base_url + "/close").body == b"until the server closes"


def test_put_with_body_gets_chunked_reply(base_url: str) -> None:
    assert get(base_url + "/x", method="PUT", body=b"payload").body == b"got payload"


@pytest.mark.parametrize(("path", "words"), [
    ("/bad-size", "bad chunk size"),
    ("/no-crlf-after-chunk", "not followed by CRLF"),
    ("/truncated-chunk", "closed inside a 16-byte chunk"),
    ("/no-last-chunk", "connection closed"),
    ("/short-length", "9 of 100 bytes"),
    ("/bad-length", "bad Content-Length"),
    ("/conflicting-length", "bad Content-Length"),
    ("/gzip", "unsupported Transfer-Encoding"),
])
def test_malformed_framing_is_a_clear_error(base_url: str, path: str, words: str) -> None:
    with pytest.raises(HttpError) as e:
        get(base_url + path)
    assert words in str(e.value) and path in str(e.value)


@pytest.mark.parametrize("path", sorted(STALLS))
def test_a_stalled_body_times_out(base_url: str, path: str) -> None:
    with pytest.raises(HttpError, match="timed out after 0.5s"):
        get(base_url + path, timeout_s=0.5)
