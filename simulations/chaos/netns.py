"""Real network partitions: each process in its own Linux network namespace on a private bridge.

Role: the topology of the partition drills (``partitions``). A *hub* namespace holds a bridge; every host
(a NATS server, an orchd, an agent) gets its own namespace with one veth (``eth0``, 10.x.y.N/24) whose peer
sits on the hub's bridge; the drill driver (this process, in the root namespace) gets one more veth on
the bridge (address .1), so it can reach every host without being inside any. Processes are started in
their host's namespace with ``ip netns exec`` - the product's own commands, unchanged. Faults:

    cut(host) / heal(host)        the host's link down / up on the bridge (both directions, every peer)
    block(host, "in" | "out")     iptables in the host's namespace drops what it receives / what it sends
    drop(host, share)             iptables ``-m statistic --mode random`` drops ``share`` of each direction
    clear(host)                   removes the iptables faults (``heal`` does not touch them)

    delay(host, ms)               ``tc ... netem delay`` on the host's link, where the kernel has netem

The kernel here has no ``netem`` (``tc qdisc add dev X root netem delay 100ms``: "Specified qdisc kind is
unknown"), so ``delay`` raises ``TopologyError`` with that reason (``netem_unavailable``) and no drill
delays: a cut is total loss, a drop is random loss; TCP retransmission is the only delay the drills see.

Cleanup: ``close`` (and leaving the ``with`` block, by return, exception or Ctrl-C) kills every process
it started and every process still in its namespaces (SIGTERM, then SIGKILL), and deletes the namespaces
(which deletes their veths and the bridge); SIGTERM to the driver is turned into ``KeyboardInterrupt``
while a topology is open, so it cleans up too. A driver killed with SIGKILL cannot clean up: every name
carries the creating pid (``oc<pid>-...``) and ``sweep()`` (run by every new ``Topology``) removes what a
dead pid left behind.

Concurrency contract: synchronous, one thread; call the blocking methods through ``anyio.to_thread``
from async code (they take milliseconds, processes' start waits excepted).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

PREFIX = "oc"


class TopologyError(RuntimeError):
    pass


def unavailable() -> str | None:
    """Why namespaces cannot be made here (None: they can). Tries a real ``ip netns add``."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    for tool in ("ip", "iptables"):
        if shutil.which(tool) is None:
            return f"{tool} not installed (apt-get install iproute2 iptables)"
    probe = f"{PREFIX}{os.getpid()}-probe"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode != 0:
        return f"ip netns add failed: {r.stderr.strip()}"
    try:
        r = subprocess.run(["ip", "netns", "exec", probe, "iptables", "-S"], capture_output=True, text=True)
        if r.returncode != 0:
            return f"iptables does not work in a namespace: {r.stderr.strip()}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def netem_unavailable() -> str | None:
    """Why links cannot be delayed here (None: they can). Tries a real ``tc qdisc add ... netem`` on a
    throwaway veth pair in a throwaway namespace; root only."""
    if os.geteuid() != 0:
        return "tc qdisc needs root"
    if shutil.which("tc") is None:
        return "tc not installed (apt-get install iproute2)"
    probe = f"{PREFIX}{os.getpid()}-netem"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode != 0:
        return f"ip netns add failed: {r.stderr.strip()}"
    try:
        r = subprocess.run(["ip", "netns", "exec", probe, "ip", "link", "add", "nm0", "type", "veth", "peer", "name",
                            "nm1"], capture_output=True, text=True)
        if r.returncode != 0:
            return f"cannot make a veth pair to probe netem: {r.stderr.strip()}"
        r = subprocess.run(["ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "nm0", "root", "netem", "delay",
                            "1ms"], capture_output=True, text=True)
        if r.returncode != 0:
            return (f"this kernel has no netem: `tc qdisc add dev X root netem delay 1ms` failed: "
                    f"{r.stderr.strip() or r.returncode}")
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(list(argv), capture_output=True, text=True)
    if check and r.returncode != 0:
        raise TopologyError(f"{' '.join(argv)}: {r.stderr.strip() or r.returncode}")
    return r


def _namespaces() -> list[str]:
    out = _run("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _kill_ns_pids(ns: str, sig: int) -> int:
    n = 0
    for pid in _run("ip", "netns", "pids", ns, check=False).stdout.split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), sig)
            n += 1
    return n


def _pid_alive(pid: int) -> bool:
    """Running (a zombie, dead but not yet reaped, counts as dead)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] not in ("Z", "X")


def sweep() -> list[str]:
    """Remove the namespaces (and so their veths, bridge and processes) of topologies whose creating
    process is dead; returns the names removed."""
    gone = []
    for ns in _namespaces():
        if not ns.startswith(PREFIX) or "-" not in ns:
            continue
        pid = ns[len(PREFIX):].split("-", 1)[0]
        if not pid.isdigit() or _pid_alive(int(pid)):
            continue
        _kill_ns_pids(ns, signal.SIGKILL)
        _run("ip", "netns", "del", ns, check=False)
        gone.append(ns)
    return gone


def leftovers(pid: int) -> dict[str, list[str]]:
    """What a topology made by ``pid`` left behind: namespaces, root-side links and processes in them."""
    mine = [ns for ns in _namespaces() if ns.startswith(f"{PREFIX}{pid}-")]
    links = [line.split(":")[1].strip().split("@")[0]
             for line in _run("ip", "-o", "link", check=False).stdout.splitlines()
             if f"{PREFIX}d{pid}" in line]
    procs = [p for ns in mine for p in _run("ip", "netns", "pids", ns, check=False).stdout.split()]
    return {"namespaces": mine, "links": links, "processes": procs}


@dataclass
class Host:
    name: str
    ns: str
    ip: str
    port: str  # the hub-side veth of the host's link
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)


class Topology:
    """A bridge and hosts; see the module docstring. Use as a context manager (cleanup is guaranteed)."""

    def __init__(self, subnet: int | None = None) -> None:
        self.pid = os.getpid()
        self.hub = f"{PREFIX}{self.pid}-hub"
        self.driver_link = f"{PREFIX}d{self.pid}"
        self.subnet = subnet if subnet is not None else 200 + self.pid % 50
        self.octet = 1 + (self.pid // 50) % 250
        self.hosts: dict[str, Host] = {}
        self.faults: list[tuple[float, str, str]] = []  # (time, host, what): the drill's record
        self._old_term: Any = None
        self._delayed: set[str] = set()
        self._open = False

    @property
    def driver_ip(self) -> str:
        return f"10.{self.subnet}.{self.octet}.1"

    # --- life -------------------------------------------------------------------------------------

    def open(self) -> Topology:
        reason = unavailable()
        if reason:
            raise TopologyError(reason)
        sweep()
        self._open = True
        try:
            _run("ip", "netns", "add", self.hub)
            self._in(self.hub, "ip", "link", "add", "br0", "type", "bridge")
            self._in(self.hub, "ip", "link", "set", "br0", "up")
            self._in(self.hub, "ip", "link", "set", "lo", "up")
            # the driver's own leg: root side keeps the address, hub side joins the bridge
            _run("ip", "link", "add", self.driver_link, "type", "veth", "peer", "name", "drv", "netns", self.hub)
            self._in(self.hub, "ip", "link", "set", "drv", "master", "br0", "up")
            _run("ip", "addr", "add", f"{self.driver_ip}/24", "dev", self.driver_link)
            _run("ip", "link", "set", self.driver_link, "up")
        except BaseException:
            self.close()
            raise
        if _main_thread():
            self._old_term = signal.signal(signal.SIGTERM, _term_to_interrupt)
        return self

    def __enter__(self) -> Topology:
        return self.open()

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        """Kill every process, delete every namespace and link. Idempotent; never raises."""
        if not self._open:
            return
        for host in self.hosts.values():
            for p in host.procs:
                _signal_group(p, signal.SIGTERM)
        deadline = time.monotonic() + 5.0
        for host in self.hosts.values():
            for p in host.procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(max(0.0, deadline - time.monotonic()))
        for host in self.hosts.values():
            for p in host.procs:
                _signal_group(p, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(5)
            _kill_ns_pids(host.ns, signal.SIGKILL)  # anything a process left behind in its namespace
            _run("ip", "netns", "del", host.ns, check=False)
        _run("ip", "netns", "del", self.hub, check=False)  # takes the bridge and every hub-side veth
        _run("ip", "link", "del", self.driver_link, check=False)
        self._open = False
        if self._old_term is not None and _main_thread():
            signal.signal(signal.SIGTERM, self._old_term)
            self._old_term = None

    # --- hosts and processes ------------------------------------------------------------------------

    def add_host(self, name: str) -> Host:
        if name in self.hosts:
            raise TopologyError(f"host {name!r} exists")
        idx = len(self.hosts) + 2
        if idx > 254:
            raise TopologyError("at most 253 hosts")
        host = Host(name=name, ns=f"{PREFIX}{self.pid}-{name}"[:40], ip=f"10.{self.subnet}.{self.octet}.{idx}",
                    port=f"h{idx}")
        self.hosts[name] = host
        _run("ip", "netns", "add", host.ns)
        _run("ip", "link", "add", host.port, "netns", self.hub, "type", "veth", "peer", "name", "eth0",
             "netns", host.ns)
        self._in(self.hub, "ip", "link", "set", host.port, "master", "br0", "up")
        self._in(host.ns, "ip", "addr", "add", f"{host.ip}/24", "dev", "eth0")
        self._in(host.ns, "ip", "link", "set", "eth0", "up")
        self._in(host.ns, "ip", "link", "set", "lo", "up")
        return host

    def spawn(self, host: str, argv: Sequence[str], *, log: Path, cwd: Path | None = None,
              env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        """Start ``argv`` in the host's namespace (its own process group), stdout+stderr to ``log``."""
        h = self.hosts[host]
        with open(log, "ab") as out:
            p = subprocess.Popen(["ip", "netns", "exec", h.ns, *argv], stdin=subprocess.DEVNULL, stdout=out,
                                 stderr=subprocess.STDOUT, cwd=cwd, env=env, start_new_session=True)
        h.procs.append(p)
        return p

    # --- faults -------------------------------------------------------------------------------------

    def cut(self, host: str) -> None:
        self._in(self.hub, "ip", "link", "set", self.hosts[host].port, "down")
        self._note(host, "cut")

    def heal(self, host: str) -> None:
        self._in(self.hub, "ip", "link", "set", self.hosts[host].port, "up")
        self._note(host, "heal")

    def block(self, host: str, direction: str) -> None:
        """Drop what the host receives (``in``) or what it sends (``out``) on its link."""
        if direction == "in":
            self._ipt(host, "-I", "INPUT", "-i", "eth0", "-j", "DROP")
        elif direction == "out":
            self._ipt(host, "-I", "OUTPUT", "-o", "eth0", "-j", "DROP")
        else:
            raise TopologyError(f"direction must be 'in' or 'out', not {direction!r}")
        self._note(host, f"block_{direction}")

    def drop(self, host: str, share: float) -> None:
        """Drop a random ``share`` (0 < share < 1) of the packets in each direction of the host's link."""
        if not 0.0 < share < 1.0:
            raise TopologyError(f"drop share must be in (0, 1), not {share}")
        p = f"{share:.4f}"
        self._ipt(host, "-I", "INPUT", "-i", "eth0", "-m", "statistic", "--mode", "random", "--probability", p,
                  "-j", "DROP")
        self._ipt(host, "-I", "OUTPUT", "-o", "eth0", "-m", "statistic", "--mode", "random", "--probability", p,
                  "-j", "DROP")
        self._note(host, f"drop_{share}")

    def delay(self, host: str, delay_ms: float) -> None:
        """Delay every packet of the host's link by ``delay_ms`` (``tc qdisc add ... netem delay``): only on a
        kernel with ``sch_netem``; raises ``TopologyError`` with the reason where there is none (as here)."""
        if not delay_ms > 0:
            raise TopologyError(f"delay must be > 0 ms, not {delay_ms}")
        reason = netem_unavailable()
        if reason:
            raise TopologyError(f"cannot delay {host}'s link: {reason}")
        self._in(self.hosts[host].ns, "tc", "qdisc", "replace", "dev", "eth0", "root", "netem", "delay",
                 f"{delay_ms:g}ms")
        self._delayed.add(host)
        self._note(host, f"delay_{delay_ms:g}ms")

    def clear(self, host: str) -> None:
        """Remove the host's iptables faults (and its delay, where one was set)."""
        self._ipt(host, "-F")
        if host in self._delayed:
            self._in(self.hosts[host].ns, "tc", "qdisc", "del", "dev", "eth0", "root")
            self._delayed.discard(host)
        self._note(host, "clear")

    # --- helpers --------------------------------------------------------------------------------

    def _ipt(self, host: str, *args: str) -> None:
        self._in(self.hosts[host].ns, "iptables", "-w", *args)

    def _in(self, ns: str, *argv: str) -> None:
        _run("ip", "netns", "exec", ns, *argv)

    def _note(self, host: str, what: str) -> None:
        self.faults.append((time.time(), host, what))


def _signal_group(p: subprocess.Popen[bytes], sig: int) -> None:
    if p.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, sig)


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def _term_to_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _hold(argv: list[str]) -> int:
    """``python -m simulations.chaos.netns hold N``: a topology of N hosts, each running ``sleep``; prints
    ``ready <pid>`` and waits (to test cleanup on SIGINT/SIGTERM/SIGKILL); ``fail``: raises instead."""
    import sys

    n = int(argv[1])
    with Topology() as topo:
        for i in range(n):
            topo.add_host(f"n{i}")
            topo.spawn(f"n{i}", ["sleep", "600"], log=Path(os.devnull))
        deadline = time.monotonic() + 10
        while not all(_run("ip", "netns", "pids", h.ns, check=False).stdout.split() for h in topo.hosts.values()):
            if time.monotonic() > deadline:  # `ip netns exec` enters the namespace after Popen returns
                raise TopologyError("the sleepers did not enter their namespaces in 10 s")
            time.sleep(0.01)
        print(f"ready {os.getpid()}", flush=True)
        if argv[0] == "fail":
            raise TopologyError("failing on purpose")
        sys.stdin.read()  # until EOF or a signal
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(_hold(sys.argv[1:]))
