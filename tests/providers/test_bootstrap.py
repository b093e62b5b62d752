"""User data rendering and the enrolment broker (single-use, short-lived tokens; no secret in user data)."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from providers.base import NodeBootstrap
from providers.bootstrap import CredentialIssuer, EnrolmentBroker, EnrolmentError, render_user_data


class Issuer:
    def __init__(self) -> None:
        self.issued: list[str] = []
        self.revoked: list[str] = []

    def issue(self, node_id: str) -> str:
        self.issued.append(node_id)
        return f"-----BEGIN NATS USER JWT-----\nfor {node_id}\n"

    def revoke(self, node_id: str) -> None:
        self.revoked.append(node_id)


def test_token_is_single_use_and_expires() -> None:
    now = [0.0]
    issuer = Issuer()
    assert isinstance(issuer, CredentialIssuer)
    b = EnrolmentBroker(issuer, ttl_s=60, clock=lambda: now[0])
    t = b.mint("n1")
    with pytest.raises(EnrolmentError, match="wrong_token"):
        b.redeem("n1", t + "x")
    with pytest.raises(EnrolmentError, match="unknown"):
        b.redeem("n2", t)
    assert "for n1" in b.redeem("n1", t)
    with pytest.raises(EnrolmentError, match="reused"):  # someone else read the user data
        b.redeem("n1", t)
    t2 = b.mint("n2")
    now[0] = 61
    with pytest.raises(EnrolmentError, match="expired"):
        b.redeem("n2", t2)
    b.mint("n3")
    now[0] = 200
    assert b.expire() == 1
    b.forget("n1")
    assert issuer.issued == ["n1"] and issuer.revoked == ["n1"]


def test_retried_launch_any_live_token_enrols_once() -> None:
    b = EnrolmentBroker(Issuer())
    first, second = b.mint("n1"), b.mint("n1")  # launch retried under the same idempotency token
    assert "for n1" in b.redeem("n1", first)  # the VM of the first attempt came back
    for t in (first, second):
        with pytest.raises(EnrolmentError, match="reused"):
            b.redeem("n1", t)


def test_user_data_carries_only_the_enrolment_token() -> None:
    issuer = Issuer()
    b = EnrolmentBroker(issuer)
    boot = b.mint_for(NodeBootstrap(nats_urls=("nats://a:4222", "nats://b:4222"), credential="LONG-LIVED",
                                    agent_args=("--log", "json; rm -rf /")), ("n1", "n2"))
    script = render_user_data("n1", boot, cloud="aws")
    assert "LONG-LIVED" not in script and issuer.issued == []  # nothing issued until the node enrols
    assert f"ORCH_AGENT_ENROL_TOKEN={boot.node_credentials['n1']}" in script
    assert boot.node_credentials["n2"] not in script
    assert "ORCH_AGENT_NATS_URLS=nats://a:4222,nats://b:4222" in script
    assert "'json; rm -rf /'" in script  # every value is shell-quoted
    bash = shutil.which("bash")
    if bash:
        assert subprocess.run([bash, "-n"], input=script, text=True).returncode == 0
