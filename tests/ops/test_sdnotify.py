"""sd_notify against a real AF_UNIX datagram socket, path and abstract (@) forms."""

from __future__ import annotations

import os
import socket
import uuid

import pytest

from wire import sdnotify


def _recv(sock: socket.socket) -> str:
    sock.settimeout(2)
    return sock.recv(4096).decode()


@pytest.fixture
def path_socket(tmp_path, monkeypatch):
    path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    yield sock
    sock.close()


def test_ready_status_watchdog_stopping_reach_the_socket(path_socket):
    assert sdnotify.notify_ready("leader rev=3")
    assert _recv(path_socket) == "READY=1\nSTATUS=leader rev=3"
    assert sdnotify.notify_status("standby\nrev=4")
    assert _recv(path_socket) == "STATUS=standby rev=4"
    assert sdnotify.notify_watchdog()
    assert _recv(path_socket) == "WATCHDOG=1"
    assert sdnotify.notify_stopping("draining")
    assert _recv(path_socket) == "STOPPING=1\nSTATUS=draining"


def test_abstract_socket(monkeypatch):
    name = f"orch-test-{uuid.uuid4().hex}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + name)
    try:
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        assert sdnotify.notify_watchdog()
        assert _recv(sock) == "WATCHDOG=1"
    finally:
        sock.close()


def test_noop_without_socket_and_false_on_dead_socket(monkeypatch, tmp_path):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert sdnotify.notify_ready() is False
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "nobody-listens"))
    assert sdnotify.notify_watchdog() is False


def test_watchdog_interval_is_half_and_only_for_this_pid():
    pid = str(os.getpid())
    assert sdnotify.watchdog_interval_s({"WATCHDOG_USEC": "20000000", "WATCHDOG_PID": pid}) == 10.0
    assert sdnotify.watchdog_interval_s({"WATCHDOG_USEC": "20000000"}) == 10.0
    assert sdnotify.watchdog_interval_s({"WATCHDOG_USEC": "20000000", "WATCHDOG_PID": "1"}) is None
    assert sdnotify.watchdog_interval_s({}) is None
