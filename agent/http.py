"""A minimal, cancellable HTTP/1.1 client for the metadata services (plain http on a link-local address).

Role: the agent's only HTTP needs are small GET/PUT/POST requests to 169.254.169.254 (or a fake), one
of them a long poll (GCP ``wait_for_change``). A thread-based client cannot be cancelled in a long
poll; this one runs on asyncio streams, so cancelling the watcher task ends the request at once.
``Connection: close`` on every request: no pooling, the body is read to EOF (or Content-Length).
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
    """One request; raises HttpError on connection problems or timeouts."""
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
                status_line = await reader.readline()
                try:
                    status = int(status_line.split()[1])
                except (IndexError, ValueError):
                    raise HttpError(f"bad status line {status_line!r}") from None
                resp_headers: dict[str, str] = {}
                while True:
                    line = await reader.readline()
                    if line in (b"\r\n", b"\n", b""):
                        break
                    name, _, value = line.decode("latin-1").partition(":")
                    resp_headers[name.strip().lower()] = value.strip()
                length = resp_headers.get("content-length")
                if length is not None and length.isdigit():
                    data = await reader.readexactly(int(length))
                else:
                    data = await reader.read()
                return Response(status, resp_headers, data, url)
            finally:
                writer.close()
    except TimeoutError:
        raise HttpError(f"{method} {url}: timed out after {timeout_s}s") from None
    except (OSError, asyncio.IncompleteReadError) as e:
        if isinstance(e, HttpError):
            raise
        raise HttpError(f"{method} {url}: {e}") from None
