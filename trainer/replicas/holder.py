"""The replica holder: one process per node and job, holding shard replicas in host memory (torch-free).

    python -m trainer.replicas.holder --bind HOST [--port 0] [--keep 2]
    stdin, first line: {"job": J, "secret": S, "generation": G}   (then kept open: EOF = the parent is gone)
    stdout, first line: {"listening": "host:port", "pid": N}

Role: the part of the replica path that outlives the ranks. The agent starts it for a job with replicas on
(agent/replicas.py) and keeps it across that job's generations; ranks of the current generation put their
shard (after a step) into it and into their buddy's holder, and the next generation gets them back.

Versioned, complete or absent: a replica is (rank, step, world_size, generation, crc32c, bytes). It enters
the store only once its last byte arrived and its CRC32C matched; a connection that drops in the middle of
a put leaves nothing. A put of step s drops that rank's replicas above s (another run of the same steps,
e.g. after a recovery from an older source).

Memory: at most two versions per rank - the newest one known complete on every rank (``certified``) and
the one being received. The ranks certify a step when their per-step agreement says every rank's copy of
it is over; they say so in their next put (``certified``) or, when no put follows at once, in a
``commit``. Either drops the replicas older than the certified step of each rank that has it here (a
replica of it exists for every rank wherever it could), and of the ranks of a larger, older world. Until
then the older version is what a node lost in the middle of a copy leaves usable on the survivors.
``keep`` (2) caps the versions per rank whatever the ranks say. Each body is its own anonymous mapping
(its capacity rounded up to a multiple of 64 KiB, or of 1/32 of it at most when larger: ``capacity``); a
dropped one is kept as the receive buffer of the next put of that capacity (one per rank at most,
``spares``; never one a ``get`` is still sending), its pages given back with MADV_FREE: the kernel takes
them when it needs memory, until then refilling them costs no page fault (on the 2-core VM a fresh
mapping made a 3.5 MB receive about 2.5x the CPU of a reused one).

Concurrency: one thread per connection (at most ``MAX_CONNECTIONS``); the bytes arrive with
``recv_into`` straight into the body's mapping and are checked with CRC32C, both in C without the GIL;
the store changes under one lock, a replica installed with one dict assignment once complete. Every
refusal is counted (``stats``) and logged on stderr, never fatal.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import socket
import sys
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Any

import crc32c

from trainer.replicas import protocol as p

MAX_CONNECTIONS = 256
HANDSHAKE_TIMEOUT_S = 30.0


@dataclass(frozen=True, slots=True)
class Replica:
    rank: int
    step: int
    world_size: int
    generation: int
    crc: int
    buf: mmap.mmap | bytes  # its first ``size`` bytes are the replica (a buffer's capacity is rounded up)
    size: int

    @property
    def body(self) -> memoryview:
        return memoryview(self.buf)[:self.size]


def capacity(n: int) -> int:
    """The size of a receive buffer for a body of ``n`` bytes: rounded up to a multiple of a granule of 1/64
    to 1/32 of it (64 KiB at least), so that bodies whose small pickled part grew or shrank by a few bytes
    reuse one buffer."""
    granule = 1 << max(16, n.bit_length() - 6)
    return -(-n // granule) * granule


class Store:
    """Replicas of one job: rank -> step -> Replica (the caller holds the holder's lock)."""

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self.by_rank: dict[int, dict[int, Replica]] = {}

    def put(self, r: Replica) -> list[Replica]:
        """Install ``r``; the replicas it drops (later steps of a rerun, versions past ``keep``)."""
        old = self.by_rank.get(r.rank, {})
        steps = {s: x for s, x in old.items() if s < r.step}
        steps[r.step] = r
        newest = sorted(steps)[-self.keep:]
        self.by_rank[r.rank] = {s: steps[s] for s in newest}
        return [x for s, x in old.items() if s not in self.by_rank[r.rank]]

    def certify(self, step: int, world_size: int) -> list[Replica]:
        """Every rank's copy of ``step`` is over (in a world of ``world_size`` ranks): drop what is older of
        each rank this holder has ``step`` or newer of, and of the ranks of a larger old world (ranks >=
        ``world_size``: a resharded resume left them); a rank whose copy of ``step`` did not arrive here
        keeps what it has. Those dropped."""
        dropped = []
        for rank, steps in list(self.by_rank.items()):
            if rank < world_size and max(steps) < step:
                continue
            keep = {s: x for s, x in steps.items() if s >= step}
            dropped += [x for s, x in steps.items() if s < step]
            if keep:
                self.by_rank[rank] = keep
            else:
                del self.by_rank[rank]
        return dropped

    def get(self, rank: int, step: int) -> Replica | None:
        return self.by_rank.get(rank, {}).get(step)

    def inventory(self) -> list[list[int]]:
        """[[rank, step, world_size, generation], ...]: every complete replica held."""
        return [[x.rank, x.step, x.world_size, x.generation] for steps in self.by_rank.values() for x in steps.values()]

    def nbytes(self) -> int:
        return sum(x.size for steps in self.by_rank.values() for x in steps.values())


def _recv_body(sock: socket.socket, body: mmap.mmap, n: int) -> mmap.mmap:
    """Exactly ``n`` bytes into the start of ``body`` (ProtocolError when the peer closes first)."""
    view = memoryview(body)
    try:
        got = 0
        while got < n:  # MSG_WAITALL: one wake-up for the whole body, not one per segment that arrived
            k = sock.recv_into(view[got:], n - got, socket.MSG_WAITALL)
            if k == 0:
                raise p.ProtocolError(f"connection closed after {got} of {n} bytes")
            got += k
    finally:
        view.release()
    return body


def _say_and_close(conn: socket.socket, reply: dict[str, Any]) -> None:
    """Tell a peer that broke the protocol why, then let it finish sending (up to a second) before the close,
    so that it reads the reason instead of a reset."""
    try:
        conn.sendall(p.encode_frame(reply))
        conn.shutdown(socket.SHUT_WR)
        conn.settimeout(1.0)
        while conn.recv(1 << 16):
            pass
    except OSError:
        pass


class Holder:
    def __init__(self, job: str, secret: str, generation: int, *, keep: int = 2, max_bytes: int = 1 << 40,
                 allow_debug: bool = False) -> None:
        self.job, self.secret, self.generation = job, secret, generation
        self.store = Store(keep)
        self.max_bytes = max_bytes
        self.allow_debug = allow_debug
        self.lock = threading.Lock()
        self.refused: Counter[str] = Counter()
        self.served = 0
        self.stored = 0
        self.dropped = 0  # connections lost (their put under way, if any, is absent)
        self.receiving = 0  # bytes of puts under way (not in the store yet)
        self.peak_bytes = 0  # the most the store and the puts under way held at once
        self.connections = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self.spares: list[mmap.mmap] = []  # dropped buffers kept for the next receives (at most one per rank)
        self.lent: Counter[int] = Counter()  # id() of buffers a ``get`` is sending: never recycled meanwhile

    def _drop(self, dropped: list[Replica]) -> None:
        """Replicas no longer in the store (the caller holds the lock): a few buffers become spares."""
        for buf in (r.buf for r in dropped):
            if (isinstance(buf, mmap.mmap) and not self.lent[id(buf)]
                    and len(self.spares) < max(len(self.store.by_rank), 1)):
                buf.madvise(mmap.MADV_FREE)
                self.spares.append(buf)

    def _buffer(self, n: int) -> mmap.mmap:
        """A receive buffer for ``n`` bytes: a spare of its capacity, else a fresh mapping (the caller holds
        the lock)."""
        cap = capacity(n)
        for i, buf in enumerate(self.spares):
            if len(buf) == cap:
                return self.spares.pop(i)
        return mmap.mmap(-1, cap, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)

    def refuse(self, reason: str, peer: object) -> dict[str, Any]:
        with self.lock:
            self.refused[reason] += 1
        sys.stderr.write(json.dumps({"event": "replica_refused", "reason": reason, "peer": str(peer)}) + "\n")
        sys.stderr.flush()
        return {"op": "refused", "reason": reason}

    def _auth(self, conn: socket.socket, peer: object) -> tuple[str, int] | None:
        nonce = os.urandom(16).hex()
        conn.sendall(p.encode_frame({"op": "hello", "job": self.job, "nonce": nonce}))
        h = p.recv_header(conn)
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
                conn.sendall(p.encode_frame({"op": "ok", "mac": p.mac(key, "s", h["cnonce"], job, gen)}))
                return str(role), gen
        conn.sendall(p.encode_frame(reply))
        return None

    def serve(self, conn: socket.socket, peer: object) -> None:
        """One connection, until it closes or breaks the protocol (then it is closed)."""
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.settimeout(HANDSHAKE_TIMEOUT_S)
            who = self._auth(conn, peer)
            conn.settimeout(None)  # a rank's connection idles between its replicas
            while who is not None:
                try:
                    h = p.recv_header(conn)
                except ConnectionResetError:
                    break  # a rank that exited (os._exit) between requests: not a fault
                except p.ProtocolError as e:
                    if "closed after 0 of" in str(e):
                        break  # a clean close between requests
                    raise
                reply, lent = self._op(h, who, conn, peer)
                try:
                    conn.sendall(p.encode_frame(reply))
                    if lent is not None:
                        conn.sendall(lent.body)
                finally:
                    if lent is not None:
                        with self.lock:
                            self.lent[id(lent.buf)] -= 1
                            if not self.lent[id(lent.buf)]:
                                del self.lent[id(lent.buf)]
        except p.ProtocolError as e:
            reply = self.refuse(f"protocol: {str(e)[:60]}", peer)
            _say_and_close(conn, reply)
        except OSError as e:  # the peer went away (a rank's exit, a vanished node): what it was putting is absent
            with self.lock:
                self.dropped += 1
            sys.stderr.write(json.dumps({"event": "replica_connection_lost", "error": type(e).__name__,
                                         "peer": str(peer)}) + "\n")
        finally:
            conn.close()
            self.connections.release()

    def _op(self, h: dict[str, Any], who: tuple[str, int], conn: socket.socket,
            peer: object) -> tuple[dict[str, Any], Replica | None]:
        role, gen = who
        op = h["op"]
        if role == p.ROLE_RANK and gen != self.generation:  # the agent moved on while this connection stayed
            raise p.ProtocolError("stale_generation")
        if op == "put":
            return self._put(h, gen, conn, peer), None
        if op == "commit":
            step, ws = p.int_field(h, "step"), p.int_field(h, "world_size", 1, 1 << 20)
            with self.lock:
                dropped = self.store.certify(step, ws)
                self._drop(dropped)
            return {"op": "committed", "step": step, "freed": sum(x.size for x in dropped)}, None
        if op == "get":
            with self.lock:
                r = self.store.get(p.int_field(h, "rank"), p.int_field(h, "step"))
                if r is not None:
                    self.served += 1
                    self.lent[id(r.buf)] += 1  # until serve() sent it (``_sent``)
            if r is None:
                return {"op": "absent"}, None
            return {"op": "data", "nbytes": r.size, "crc": r.crc, "world_size": r.world_size,
                    "generation": r.generation, "rank": r.rank, "step": r.step}, r
        if op == "list":
            with self.lock:
                return {"op": "inventory", "replicas": self.store.inventory(), "generation": self.generation}, None
        if op == "stats":
            with self.lock:
                return {"op": "stats", "bytes": self.store.nbytes(), "peak_bytes": self.peak_bytes,
                        "spare_bytes": sum(len(x) for x in self.spares),
                        "stored": self.stored, "served": self.served, "refused": dict(self.refused),
                        "dropped": self.dropped,
                        "generation": self.generation}, None
        if role == p.ROLE_AGENT and op == "generation":
            with self.lock:
                self.generation = max(self.generation, p.int_field(h, "generation"))
                return {"op": "generation", "generation": self.generation}, None
        if role == p.ROLE_AGENT and op == "corrupt" and self.allow_debug:  # test hook: a bit flip in memory
            with self.lock:
                r = self.store.get(p.int_field(h, "rank"), p.int_field(h, "step"))
                if r is not None:
                    flipped = bytearray(r.body)
                    flipped[len(flipped) // 2] ^= 0x40
                    self.store.by_rank[r.rank][r.step] = Replica(r.rank, r.step, r.world_size, r.generation, r.crc,
                                                                 bytes(flipped), r.size)
            return {"op": "corrupted", "found": r is not None}, None
        return self.refuse(f"bad_op:{str(op)[:20]}", peer), None

    def _put(self, h: dict[str, Any], gen: int, conn: socket.socket, peer: object) -> dict[str, Any]:
        n = p.int_field(h, "nbytes", 1, self.max_bytes)
        rank, step = p.int_field(h, "rank", 0, 1 << 20), p.int_field(h, "step")
        ws, crc = p.int_field(h, "world_size", 1, 1 << 20), p.int_field(h, "crc", 0, (1 << 32) - 1)
        certified = p.int_field(h, "certified") if "certified" in h else 0
        if rank >= ws:
            raise p.ProtocolError("rank >= world_size")
        with self.lock:
            if certified:  # before the bytes arrive: at most 2 versions of this rank
                self._drop(self.store.certify(certified, ws))
            buf = self._buffer(n)
            self.receiving += n
            self.peak_bytes = max(self.peak_bytes, self.store.nbytes() + self.receiving)
        ok = False
        try:
            body = _recv_body(conn, buf, n)  # a peer that vanishes here leaves nothing behind
            ok = crc32c.crc32c(memoryview(body)[:n]) == crc
        finally:
            with self.lock:
                self.receiving -= n
                if not ok and len(self.spares) < max(len(self.store.by_rank), 1):
                    self.spares.append(buf)  # nothing of it was kept
        if not ok:
            return self.refuse("checksum", peer)
        with self.lock:
            self._drop(self.store.put(Replica(rank, step, ws, gen, crc, body, n)))
            self.stored += 1
        return {"op": "stored", "rank": rank, "step": step}

    def accept_forever(self, server: socket.socket) -> None:
        while True:
            try:
                conn, peer = server.accept()
            except OSError:
                return  # the listening socket was closed: the holder is stopping
            if not self.connections.acquire(blocking=False):
                conn.close()
                self.refuse("too_many_connections", peer)
                continue
            threading.Thread(target=self.serve, args=(conn, peer), daemon=True).start()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m trainer.replicas.holder")
    ap.add_argument("--bind", default="0.0.0.0")
    ap.add_argument("--advertise", default="")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--keep", type=int, default=2)
    ap.add_argument("--allow-debug", action="store_true")
    args = ap.parse_args(argv)
    cfg = json.loads(sys.stdin.readline() or "{}")
    if not isinstance(cfg.get("job"), str) or not isinstance(cfg.get("secret"), str) or len(cfg["secret"]) < 16:
        raise SystemExit("holder: stdin must start with {\"job\": ..., \"secret\": (>= 16 chars), \"generation\": ...}")
    holder = Holder(cfg["job"], cfg["secret"], int(cfg.get("generation", 0)), keep=args.keep,
                    allow_debug=args.allow_debug)
    server = socket.create_server((args.bind, args.port), backlog=128)
    host, port = server.getsockname()[:2]
    print(json.dumps({"listening": f"{args.advertise or host}:{port}", "pid": os.getpid()}), flush=True)
    threading.Thread(target=holder.accept_forever, args=(server,), daemon=True).start()
    for _ in sys.stdin:  # stdin EOF: the agent is gone, so is the holder
        pass
    server.close()


if __name__ == "__main__":
    main()
