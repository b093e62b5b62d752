"""A blocking client of a replica holder (torch-free): the ranks' background thread and the agent use it.

One connection per client, authenticated once (trainer.replicas.protocol); every call raises
``ProtocolError`` (or ``OSError``) on failure and leaves the caller to try the next source.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Sequence
from typing import Any, TypeAlias

import crc32c

from trainer.replicas import protocol as p

Buffer: TypeAlias = bytes | bytearray | memoryview

def split_addr(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"replica holder address must be host:port, not {addr!r}")
    return host.strip("[]"), int(port)


class HolderClient:
    def __init__(self, addr: str, job: str, generation: int, key: bytes, *, role: str = p.ROLE_RANK,
                 timeout_s: float = 30.0) -> None:
        self.addr = addr
        self.sock = socket.create_connection(split_addr(addr), timeout=timeout_s)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            self._handshake(job, generation, key, role)
        except BaseException:
            self.sock.close()
            raise

    def _handshake(self, job: str, generation: int, key: bytes, role: str) -> None:
        hello = p.recv_header(self.sock)
        if hello["op"] != "hello" or hello.get("job") != job:
            raise p.ProtocolError(f"holder of job {str(hello.get('job'))[:64]!r}, not {job!r}")
        cnonce = os.urandom(16).hex()
        self.sock.sendall(p.encode_frame({"op": "auth", "job": job, "generation": generation, "role": role,
                                          "cnonce": cnonce,
                                          "mac": p.mac(key, "c", hello["nonce"], job, generation, role)}))
        reply = p.recv_header(self.sock)
        if reply["op"] != "ok":
            raise p.ProtocolError(f"refused: {str(reply.get('reason'))[:80]}")
        if not p.same(str(reply.get("mac", "")), p.mac(key, "s", cnonce, job, generation)):
            raise p.ProtocolError("the holder did not prove the key")

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> HolderClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, header: dict[str, Any], *parts: Buffer) -> dict[str, Any]:
        self.sock.sendall(p.encode_frame(header))
        for part in parts:  # the body, as one or more buffers sent as they are (no concatenation)
            self.sock.sendall(part)
        reply = p.recv_header(self.sock)
        if reply["op"] == "refused":
            raise p.ProtocolError(f"refused: {str(reply.get('reason'))[:80]}")
        return reply

    def put(self, rank: int, step: int, world_size: int, body: Buffer | Sequence[Buffer],
            crc: int | None = None, *, certified: int = 0) -> None:
        """Put rank ``rank``'s replica of ``step``: ``body`` one buffer or several sent one after the other
        (their concatenation is the replica). ``certified``: every rank's copy of that step is over (the
        holder then drops what is older)."""
        parts = [body] if isinstance(body, (bytes, bytearray, memoryview)) else list(body)
        if crc is None:
            crc = 0
            for part in parts:
                crc = crc32c.crc32c(part, crc)
        header = {"op": "put", "rank": rank, "step": step, "world_size": world_size,
                  "nbytes": sum(memoryview(x).nbytes for x in parts), "crc": crc}
        if certified:
            header["certified"] = certified
        reply = self._call(header, *parts)
        if reply["op"] != "stored":
            raise p.ProtocolError(f"put answered {reply['op']!r}")

    def commit(self, step: int, world_size: int) -> int:
        """Every rank's copy of ``step`` is over: the holder drops the replicas older than it (bytes freed)."""
        return int(self._call({"op": "commit", "step": step, "world_size": world_size}).get("freed", 0))

    def get(self, rank: int, step: int) -> tuple[bytes, int] | None:
        """(body, world_size) of a complete replica whose CRC32C verifies; None when absent. A replica
        whose bytes fail the checksum raises ProtocolError("checksum ...")."""
        reply = self._call({"op": "get", "rank": rank, "step": step})
        if reply["op"] == "absent":
            return None
        n = p.int_field(reply, "nbytes", 1)
        if reply.get("rank") != rank or reply.get("step") != step:
            raise p.ProtocolError("the holder answered another replica")
        body = p.recv_exact(self.sock, n)
        if crc32c.crc32c(body) != reply.get("crc"):
            raise p.ProtocolError(f"checksum mismatch in the replica of rank {rank} step {step} from {self.addr}")
        return body, p.int_field(reply, "world_size", 1)

    def inventory(self) -> list[tuple[int, int, int, int]]:
        """(rank, step, world_size, generation) of every complete replica held."""
        reply = self._call({"op": "list"})
        out = []
        for item in reply.get("replicas", []):
            if isinstance(item, list) and len(item) == 4 and all(isinstance(v, int) for v in item):
                out.append((item[0], item[1], item[2], item[3]))
        return out

    def stats(self) -> dict[str, Any]:
        return self._call({"op": "stats"})

    def set_generation(self, generation: int) -> int:
        return int(self._call({"op": "generation", "generation": generation})["generation"])

    def corrupt(self, rank: int, step: int) -> bool:
        return bool(self._call({"op": "corrupt", "rank": rank, "step": step}).get("found"))


def start_holder(job: str, secret: str, generation: int, *, bind: str = "127.0.0.1", advertise: str = "",
                 env: dict[str, str] | None = None, allow_debug: bool = False) -> tuple[subprocess.Popen[bytes], str]:
    """Start ``python -m trainer.replicas.holder`` (its stdin stays open: closing it stops the holder) and
    return it with the address it listens on."""
    argv = [sys.executable, "-m", "trainer.replicas.holder", "--bind", bind]
    if advertise:
        argv += ["--advertise", advertise]
    if allow_debug:
        argv.append("--allow-debug")
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, start_new_session=True)
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(json.dumps({"job": job, "secret": secret, "generation": generation}).encode() + b"\n")
    proc.stdin.flush()
    line = proc.stdout.readline()
    try:
        addr = json.loads(line)["listening"]
    except (ValueError, KeyError, TypeError):
        proc.kill()
        raise RuntimeError(f"replica holder did not start: {line[:200]!r}") from None
    return proc, str(addr)
