"""The bus's own figures, for ``benchmarks/control_plane.py`` to print beside orchd's: plain nats-py
clients doing the least that orchd's path does, each in a process of its own (as orchd is).

    python benchmarks/raw_nats.py probe URL STREAM   # a raw JetStream consumer that replies
    python benchmarks/raw_nats.py count URL          # a raw core-NATS subscriber that counts

``probe``: a durable pull consumer on STREAM (which the caller created, with the same storage as
orchd's event stream), fetching one message at a time; each message
``bench.probe.<i>`` is acked and answered with a publish on ``bench.probe_ack.<i>`` (payload: the
message's data). The caller's publish-to-answer time is the bus's own notice-to-command latency.

``count``: a subscriber on ``bench.rawhb.*.hb`` with orchd's heartbeat subscription limits, whose
callback only counts; ``bench.rawctl`` answers ``{"count", "first_ts", "last_ts"}`` (wall-clock times
of the first and the last message received).

Both print ``ready`` on stdout once subscribed, and run until stdin closes or SIGTERM.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import time

import nats
from nats.aio.msg import Msg

PROBE_SUBJECT = "bench.probe"
PROBE_ACK = "bench.probe_ack"
RAW_HB = "bench.rawhb"
RAW_CTL = "bench.rawctl"


async def _until_stopped() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    reader = asyncio.StreamReader()  # stdin closing (the parent died) also stops us
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)

    async def eof() -> None:
        await reader.read()
        stop.set()

    task = asyncio.create_task(eof())
    await stop.wait()
    task.cancel()


async def probe(url: str, stream: str) -> None:
    nc = await nats.connect(url, max_reconnect_attempts=-1)
    js = nc.jetstream()
    sub = await js.pull_subscribe(f"{PROBE_SUBJECT}.>", durable="bench_probe", stream=stream)
    prefix_len = len(PROBE_SUBJECT) + 1

    async def serve() -> None:
        while True:
            try:
                msgs = await sub.fetch(1, timeout=5.0)  # returns as soon as one message is there
            except nats.errors.TimeoutError:
                continue
            for msg in msgs:
                await msg.ack()
                await nc.publish(f"{PROBE_ACK}.{msg.subject[prefix_len:]}", msg.data)

    task = asyncio.create_task(serve())
    print("ready", flush=True)
    await _until_stopped()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await nc.close()


async def count(url: str) -> None:
    nc = await nats.connect(url, max_reconnect_attempts=-1)
    seen = {"count": 0, "first_ts": 0.0, "last_ts": 0.0}
    clock = time.time

    async def on_msg(msg: object) -> None:
        n = seen["count"] = seen["count"] + 1
        t = clock()
        if n == 1:
            seen["first_ts"] = t
        seen["last_ts"] = t

    async def on_ctl(msg: Msg) -> None:
        await nc.publish(msg.reply, json.dumps(seen).encode())

    # the limits of orchd's heartbeat subscription (orchestrator/daemon/run.py)
    await nc.subscribe(f"{RAW_HB}.*.hb", cb=on_msg, pending_msgs_limit=500_000,
                       pending_bytes_limit=512 * 1024 * 1024)
    await nc.subscribe(RAW_CTL, cb=on_ctl)
    await nc.flush()
    print("ready", flush=True)
    await _until_stopped()
    await nc.close()


def main() -> None:
    role, url, *rest = sys.argv[1:]
    if role == "probe":
        asyncio.run(probe(url, rest[0]))
    elif role == "count":
        asyncio.run(count(url))
    else:
        raise SystemExit(f"raw_nats.py: unknown role {role!r} (probe | count)")


if __name__ == "__main__":
    main()
