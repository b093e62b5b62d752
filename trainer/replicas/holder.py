"""The replica holder: one process per node and job, holding shard replicas in host memory (torch-free).

    python -m trainer.replicas.holder --bind HOST [--port 0] [--keep 2]
    stdin, first line: {"job": J, "secret": S, "generation": G}   (then kept open: EOF = the parent is gone)
    stdout, first line: {"listening": "host:port", "pid": N}

Role: the part of the replica path that outlives the ranks. The agent starts it for a job with replicas on
(agent/replicas.py) and keeps it across that job's generations; ranks of the current generation put their
shard (after a step) into it and into their buddy's holder, and the next generation gets them back.

Versioned, complete or absent: a replica is (rank, step, world_size, generation, crc32c, bytes). It enters
the store only once its last byte arrived and its CRC32C matched; a connection that drops in the middle of
a put leaves nothing. Per rank the newest ``keep`` steps are kept (an older complete one is the fallback
when the newest turns out unusable); a put of step s drops that rank's replicas above s (another run of the
same steps, e.g. after a recovery from an older source). Trust: see trainer.replicas.protocol. Every
refusal is counted (``stats``) and logged on stderr, never fatal.

Concurrency: one asyncio loop; a replica is installed with one dict assignment after it is complete.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Any

import crc32c

from trainer.replicas import protocol as p


@dataclass(frozen=True, slots=True)
class Replica:
    rank: int
    step: int
    world_size: int
    generation: int
    crc: int
    body: bytes


class Store:
    """Replicas of one job: rank -> step -> Replica."""

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self.by_rank: dict[int, dict[int, Replica]] = {}

    def put(self, r: Replica) -> None:
        steps = {s: x for s, x in self.by_rank.get(r.rank, {}).items() if s < r.step}
        steps[r.step] = r
        newest = sorted(steps)[-self.keep:]
        self.by_rank[r.rank] = {s: steps[s] for s in newest}

    def get(self, rank: int, step: int) -> Replica | None:
        return self.by_rank.get(rank, {}).get(step)

    def inventory(self) -> list[list[int]]:
        """[[rank, step, world_size, generation], ...]: every complete replica held."""
        return [[x.rank, x.step, x.world_size, x.generation] for steps in self.by_rank.values() for x in steps.values()]

    def nbytes(self) -> int:
        return sum(len(x.body) for steps in self.by_rank.values() for x in steps.values())


class Holder:
    def __init__(self, job: str, secret: str, generation: int, *, keep: int = 2, max_bytes: int = 1 << 40,
                 allow_debug: bool = False) -> None:
        self.job, self.secret, self.generation = job, secret, generation
        self.store = Store(keep)
        self.max_bytes = max_bytes
        self.allow_debug = allow_debug
        self.refused: Counter[str] = Counter()
        self.served = 0
        self.stored = 0

    def refuse(self, reason: str, peer: object) -> dict[str, Any]:
        self.refused[reason] += 1
        sys.stderr.write(json.dumps({"event": "replica_refused", "reason": reason, "peer": str(peer)}) + "\n")
        sys.stderr.flush()
        return {"op": "refused", "reason": reason}

    async def _header(self, reader: asyncio.StreamReader) -> dict[str, Any]:
        (n,) = p.LEN.unpack(await reader.readexactly(4))
        if n > p.MAX_HEADER:
            raise p.ProtocolError(f"header of {n} bytes")
        return p.decode_header(await reader.readexactly(n))

    async def _auth(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> tuple[str, int] | None:
        nonce = os.urandom(16).hex()
        writer.write(p.encode_frame({"op": "hello", "job": self.job, "nonce": nonce}))
        await writer.drain()
        h = await self._header(reader)
        peer = writer.get_extra_info("peername")
        role, job, gen = h.get("role"), h.get("job"), h.get("generation")
        if h["op"] != "auth" or role not in (p.ROLE_RANK, p.ROLE_AGENT) or not isinstance(h.get("cnonce"), str):
            reply = self.refuse("bad_handshake", peer)
        elif job != self.job:
            reply = self.refuse("wrong_job", peer)
        elif not isinstance(gen, int) or (role == p.ROLE_RANK and gen != self.generation):
            reply = self.refuse("stale_generation" if isinstance(gen, int) and gen < self.generation
                                else "wrong_generation", peer)
        else:
            key = self.secret.encode() if role == p.ROLE_AGENT else p.generation_key(self.secret, gen)
            if not p.same(str(h.get("mac", "")), p.mac(key, "c", nonce, job, gen, role)):
                reply = self.refuse("bad_mac", peer)
            else:
                writer.write(p.encode_frame({"op": "ok", "mac": p.mac(key, "s", h["cnonce"], job, gen)}))
                await writer.drain()
                return str(role), gen
        writer.write(p.encode_frame(reply))
        await writer.drain()
        return None

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            who = await self._auth(reader, writer)
            while who is not None:
                try:
                    h = await self._header(reader)
                except asyncio.IncompleteReadError:
                    break
                reply, body = await self._op(h, who, reader, writer)
                writer.write(p.encode_frame(reply))
                if body is not None:
                    writer.write(body)
                await writer.drain()
        except (p.ProtocolError, asyncio.IncompleteReadError, ConnectionError) as e:
            self.refuse(f"protocol: {type(e).__name__}", writer.get_extra_info("peername"))
        finally:
            writer.close()

    async def _op(self, h: dict[str, Any], who: tuple[str, int], reader: asyncio.StreamReader,
                  writer: asyncio.StreamWriter) -> tuple[dict[str, Any], bytes | None]:
        role, gen = who
        op, peer = h["op"], writer.get_extra_info("peername")
        if role == p.ROLE_RANK and gen != self.generation:  # the agent moved on while this connection stayed
            raise p.ProtocolError("stale_generation")
        if op == "put":
            return await self._put(h, gen, reader, peer), None
        if op == "get":
            r = self.store.get(p.int_field(h, "rank"), p.int_field(h, "step"))
            if r is None:
                return {"op": "absent"}, None
            self.served += 1
            return {"op": "data", "nbytes": len(r.body), "crc": r.crc, "world_size": r.world_size,
                    "generation": r.generation, "rank": r.rank, "step": r.step}, r.body
        if op == "list":
            return {"op": "inventory", "replicas": self.store.inventory(), "generation": self.generation}, None
        if op == "stats":
            return {"op": "stats", "bytes": self.store.nbytes(), "stored": self.stored, "served": self.served,
                    "refused": dict(self.refused), "generation": self.generation}, None
        if role == p.ROLE_AGENT and op == "generation":
            self.generation = max(self.generation, p.int_field(h, "generation"))
            return {"op": "generation", "generation": self.generation}, None
        if role == p.ROLE_AGENT and op == "corrupt" and self.allow_debug:  # test hook: a bit flip in memory
            r = self.store.get(p.int_field(h, "rank"), p.int_field(h, "step"))
            if r is not None:
                flipped = bytearray(r.body)
                flipped[len(flipped) // 2] ^= 0x40
                self.store.by_rank[r.rank][r.step] = Replica(r.rank, r.step, r.world_size, r.generation, r.crc,
                                                             bytes(flipped))
            return {"op": "corrupted", "found": r is not None}, None
        return self.refuse(f"bad_op:{str(op)[:20]}", peer), None

    async def _put(self, h: dict[str, Any], gen: int, reader: asyncio.StreamReader, peer: object) -> dict[str, Any]:
        n = p.int_field(h, "nbytes", 1, self.max_bytes)
        rank, step = p.int_field(h, "rank", 0, 1 << 20), p.int_field(h, "step")
        ws, crc = p.int_field(h, "world_size", 1, 1 << 20), p.int_field(h, "crc", 0, (1 << 32) - 1)
        if rank >= ws:
            raise p.ProtocolError("rank >= world_size")
        body = await reader.readexactly(n)  # a peer that vanishes here leaves nothing behind
        if crc32c.crc32c(body) != crc:
            return self.refuse("checksum", peer)
        self.store.put(Replica(rank, step, ws, gen, crc, body))
        self.stored += 1
        return {"op": "stored", "rank": rank, "step": step}


def _watch_parent(loop: asyncio.AbstractEventLoop, stop: asyncio.Event) -> None:
    """stdin EOF (the agent is gone): stop the holder."""
    for _ in sys.stdin:
        pass
    loop.call_soon_threadsafe(stop.set)


async def main_async(args: argparse.Namespace) -> None:
    cfg = json.loads(sys.stdin.readline() or "{}")
    if not isinstance(cfg.get("job"), str) or not isinstance(cfg.get("secret"), str) or len(cfg["secret"]) < 16:
        raise SystemExit("holder: stdin must start with {\"job\": ..., \"secret\": (>= 16 chars), \"generation\": ...}")
    holder = Holder(cfg["job"], cfg["secret"], int(cfg.get("generation", 0)), keep=args.keep,
                    allow_debug=args.allow_debug)
    server = await asyncio.start_server(holder.serve, args.bind, args.port, limit=1 << 20)
    host, port = server.sockets[0].getsockname()[:2]
    print(json.dumps({"listening": f"{args.advertise or host}:{port}", "pid": os.getpid()}), flush=True)
    stop = asyncio.Event()
    threading.Thread(target=_watch_parent, args=(asyncio.get_running_loop(), stop), daemon=True).start()
    async with server:
        await stop.wait()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m trainer.replicas.holder")
    ap.add_argument("--bind", default="0.0.0.0")
    ap.add_argument("--advertise", default="")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--keep", type=int, default=2)
    ap.add_argument("--allow-debug", action="store_true")
    asyncio.run(main_async(ap.parse_args(argv)))


if __name__ == "__main__":
    main()
