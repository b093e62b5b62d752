"""A minimal, cancellable HTTP/1.1 client for the metadata services (plain http on a link-local address).

Role: the agent's only HTTP needs are small GET/PUT/POST requests to 169.254.169.254 (or a fake), one
of them a long poll (GCP ``wait_for_change``). A thread-based client cannot be cancelled in a long
poll; this one runs on asyncio streams, so cancelling the watcher task ends the request at once.
``Connection: close`` on every request: no pooling. The body is framed as HTTP/1.1 says (RFC 9112
section 6.3): ``Transfer-Encoding: chunked`` (chunk extensions ignored, trailers read and dropped), else
``Content-Length``, else read until the server closes the connection. Malformed framing (a bad chunk
size, a missing CRLF, a body shorter than announced, a conflicting Content-Length) raises HttpError
naming the problem; every read is inside the request's timeout, so a stalled server never hangs it.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from urllib.parse import urlsplit


class HttpError(OSError):
    pass


@dataclass(frozen=True, slots=True)
class Response:
    status: int
    headers: dict[str, str]  # lower-case names
    body: bytes
    url: str = ""  # what was asked for: a parser tells the documents of one service apart by it

    def text(self) -> str:
        return self.body.decode("utf-8", errors="replace")


async def request(
    method: str,
    url: str,
    *,
    headers: dict[str, str] | None = None,
    body: bytes = b"",
    timeout_s: float = 5.0,
) -> Response:
    """One request; raises HttpError (naming the method and url) on connection problems, malformed
    responses or timeouts."""
    parts = urlsplit(url)
    if parts.scheme != "http":
        raise HttpError(f"only http:// is supported, got {url!r}")
    host = parts.hostname or "127.0.0.1"
    port = parts.port or 80
    target = parts.path or "/"
    if parts.query:
        target += "?" + parts.query
    try:
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_connection(host, port)
            try:
                lines = [f"{method} {target} HTTP/1.1", f"Host: {parts.netloc}", "Connection: close",
                         f"Content-Length: {len(body)}"]
                lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
                writer.write(("\r\n".join(lines) + "\r\n\r\n").encode() + body)
                await writer.drain()
                status_line = await _readline(reader, "status line")
                try:
                    status = int(status_line.split()[1])
                except (IndexError, ValueError):
                    raise HttpError(f"bad status line {status_line!r}") from None
                resp_headers = await _read_headers(reader)
                data = await _read_body(reader, resp_headers, method, status)
                return Response(status, resp_headers, data, url)
            finally:
                writer.close()
    except TimeoutError:
        raise HttpError(f"{method} {url}: timed out after {timeout_s}s") from None
    except (OSError, asyncio.IncompleteReadError) as e:
        raise HttpError(f"{method} {url}: {e}") from None


MAX_LINE = 64 * 1024
"""Longest status, header, chunk-size or trailer line accepted."""
MAX_HEADERS = 200
MAX_BODY = 64 * 1024 * 1024
"""Largest body accepted: metadata documents are small, a larger one is a broken or hostile server."""


async def _readline(reader: asyncio.StreamReader, what: str) -> bytes:
    try:
        line = await reader.readuntil(b"\n")
    except asyncio.LimitOverrunError:
        raise HttpError(f"{what}: line longer than the stream limit") from None
    except asyncio.IncompleteReadError as e:
        raise HttpError(f"{what}: connection closed mid-line after {len(e.partial)} bytes") from None
    if len(line) > MAX_LINE:
        raise HttpError(f"{what}: line of {len(line)} bytes is longer than {MAX_LINE}")
    return line


async def _read_headers(reader: asyncio.StreamReader, what: str = "headers") -> dict[str, str]:
    """Header (or trailer) fields up to the empty line; lower-case names, repeated fields joined by ", "."""
    out: dict[str, str] = {}
    for _ in range(MAX_HEADERS):
        try:
            line = await reader.readuntil(b"\n")
        except asyncio.IncompleteReadError as e:
            if not e.partial and what == "headers":
                return out  # the server closed right after the status line / last header
            raise HttpError(f"{what}: connection closed before the empty line ending them") from None
        except asyncio.LimitOverrunError:
            raise HttpError(f"{what}: line longer than the stream limit") from None
        if line in (b"\r\n", b"\n"):
            return out
        name, sep, value = line.decode("latin-1").partition(":")
        if not sep or not name.strip():
            raise HttpError(f"{what}: malformed field line {line[:80]!r}")
        key = name.strip().lower()
        out[key] = f"{out[key]}, {value.strip()}" if key in out else value.strip()
    raise HttpError(f"{what}: more than {MAX_HEADERS} fields")


async def _read_body(reader: asyncio.StreamReader, headers: dict[str, str], method: str, status: int) -> bytes:
    """The response body, framed per RFC 9112 section 6.3."""
    if method == "HEAD" or status in (204, 304):
        return b""
    te = headers.get("transfer-encoding")
    if te is not None:
        codings = [c.strip().lower() for c in te.split(",") if c.strip()]
        if codings != ["chunked"]:
            raise HttpError(f"unsupported Transfer-Encoding {te!r} (only chunked)")
        return await _read_chunked(reader)
    length = headers.get("content-length")
    if length is not None:
        values = {v.strip() for v in length.split(",")}
        if len(values) != 1 or not next(iter(values)).isdigit():
            raise HttpError(f"bad Content-Length {length!r}")
        n = int(next(iter(values)))
        if n > MAX_BODY:
            raise HttpError(f"Content-Length {n} is larger than {MAX_BODY}")
        try:
            return await reader.readexactly(n)
        except asyncio.IncompleteReadError as e:
            raise HttpError(f"body: connection closed after {len(e.partial)} of {n} bytes (Content-Length)") from None
    data = bytearray()  # no framing: the body ends when the server closes the connection
    while chunk := await reader.read(65536):
        data += chunk
        if len(data) > MAX_BODY:
            raise HttpError(f"body larger than {MAX_BODY} bytes")
    return bytes(data)


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    """``chunk-size [; ext] CRLF data CRLF`` ... ``0 CRLF`` trailers ``CRLF``."""
    parts: list[bytes] = []
    total = 0
    while True:
        line = await _readline(reader, "chunked body")
        size_text = line.split(b";", 1)[0].strip()
        try:
            if not size_text or not all(c in b"0123456789abcdefABCDEF" for c in size_text):
                raise ValueError
            size = int(size_text, 16)
        except ValueError:
            raise HttpError(f"chunked body: bad chunk size line {line[:80]!r}") from None
        if size == 0:
            await _read_headers(reader, "chunked trailer")
            return b"".join(parts)
        total += size
        if total > MAX_BODY:
            raise HttpError(f"chunked body larger than {MAX_BODY} bytes")
        try:
            parts.append(await reader.readexactly(size))
            end = await reader.readexactly(2)
        except asyncio.IncompleteReadError as e:
            raise HttpError(f"chunked body: connection closed inside a {size}-byte chunk "
                            f"({len(e.partial)} bytes read)") from None
        if end != b"\r\n":
            raise HttpError(f"chunked body: chunk of {size} bytes not followed by CRLF (got {end!r})")
