"""Per-node credentials on a 3-server NATS cluster through the auth callout (orchestrator/authcallout.py).

Every server has the same static config: one auth user and ``auth_callout``. Two callout services
(standing for two orchd, leader and standby) answer in one queue group from one R3 ``ORCH_CREDS``
bucket. Checked on real servers:
- static users get their role's permissions; a wrong password, an unknown user are refused;
- a token minted by "orchd A" is redeemed through "orchd B"'s enrol endpoint (a failover between
  launch and enrolment), the node's credential works on every server, with the agent's permissions
  only, scoped to the launch's job and cloud (another node's, job's or cloud's subject is a permissions
  violation); a ``feed:aws`` static user publishes aws prices only;
- a token works once; a revoked node (NodeGone) cannot connect again, on any server;
- the bucket holds only hashes, never a token or password.
"""

from __future__ import annotations

import functools
import json

import anyio
import nats
import nats.errors
import pytest

from orchestrator.natsserver import NatsServer
from orchestrator.security.authcallout import AuthCallout, CalloutCredentials, CredentialStore, StaticUser
from orchestrator.security.nats_auth import (
    User,
    auth_user_permissions,
    hash_password,
    render_callout_authorization,
    render_server_config,
)
from orchestrator.security.nkeys import KeyPair
from tests.ha_cluster import JS_NOT_READY, nats_cluster

pytestmark = pytest.mark.anyio

AUTH_PW = "auth-secret-1"
ORCHD_PW = "orchd-secret-1"
FEED_PW = "feed-secret-1"


@pytest.fixture
def callout_cluster(tmp_path):
    issuer = KeyPair.create("account")
    auth_conf = tmp_path / "auth.conf"
    auth_conf.write_text(render_callout_authorization(
        issuer.public_key, [User(name="orchd-auth", password_hash=hash_password(AUTH_PW),
                                 permissions=auth_user_permissions())]))
    with nats_cluster(tmp_path, auth_include="auth.conf") as servers:
        yield issuer, servers


async def _connect(url: str, user: str, password: str, **kw):
    return await nats.connect(url, user=user, password=password, connect_timeout=3, allow_reconnect=False,
                              max_reconnect_attempts=0, **kw)


async def _refused(url: str, user: str, password: str) -> bool:
    try:
        nc = await _connect(url, user, password)
    except (nats.errors.Error, OSError):
        return True
    await nc.close()
    return False


async def _violations(url: str, user: str, password: str, inbox_prefix: str, *, ok: list[str],
                      refused: list[str]) -> bool:
    """Publish each subject as ``user``: True when exactly the ``refused`` ones are permissions violations."""
    errors: list[str] = []

    async def on_error(e: Exception) -> None:
        errors.append(str(e))

    nc = await _connect(url, user, password, inbox_prefix=inbox_prefix, error_cb=on_error)
    for subject in [*ok, *refused]:
        await nc.publish(subject, b"{}")
    await nc.flush()
    with anyio.move_on_after(3):
        while len(errors) < len(refused):
            await anyio.sleep(0.05)
    await anyio.sleep(0.1)
    await nc.close()
    hit = sorted(s for s in [*ok, *refused] for e in errors if "permissions violation" in e.lower() and f'"{s}"' in e)
    assert hit == sorted(refused) and len(errors) == len(refused), errors
    return True


async def test_node_credentials_through_the_callout_on_a_cluster(callout_cluster) -> None:
    issuer, servers = callout_cluster
    urls = [s.url for s in servers]
    statics = [StaticUser("orchd", hash_password(ORCHD_PW), "orchd"),
               StaticUser("feed", hash_password(FEED_PW), "feed:aws")]
    conns = []
    try:
        # two "orchd", each with its callout connection (the auth user bypasses the callout)
        for url in urls[:2]:
            conns.append(await nats.connect(url, user="orchd-auth", password=AUTH_PW))
        js = conns[0].jetstream(timeout=2)
        with anyio.fail_after(30):
            while True:
                try:
                    store_a = await CredentialStore.open(js, replicas=3)
                    break
                except JS_NOT_READY:
                    await anyio.sleep(0.3)
        store_b = await CredentialStore.open(conns[1].jetstream(timeout=2), replicas=3)
        assert (await store_a.kv.status()).stream_info.config.num_replicas == 3
        for nc, store in zip(conns, (store_a, store_b), strict=True):
            await AuthCallout(issuer, store, statics).serve(nc)
        creds_a, creds_b = CalloutCredentials(store_a), CalloutCredentials(store_b)
        await creds_b.serve(conns[1])  # B leads now: its enrol endpoint

        # -- static users: right password in, wrong one and strangers out --------------------------
        orchd = await _connect(urls[2], "orchd", ORCHD_PW)
        await orchd.publish("orch.cmd.n1", b"x")
        await orchd.flush()
        await orchd.close()
        assert await _refused(urls[2], "orchd", "wrong")
        assert await _refused(urls[0], "mallory", "x")
        assert await _violations(urls[1], "feed", FEED_PW, "_INBOX.feed", ok=["orch.price.aws.r1"],
                                 refused=["orch.price.gcp.r1", "orch.node.n1.hb"])

        # -- A mints a token at launch; the agent enrols through B ------------------------------------
        token = (await anyio.to_thread.run_sync(functools.partial(creds_a.on_launch, ["n1"], job_id="j1",
                                                                  cloud="aws")))["n1"]
        assert await _refused(urls[2], "enrol-n1", "not-the-token")
        assert await _refused(urls[2], "enrol-n2", token)  # another node's enrol user
        enrol = await _connect(urls[2], "enrol-n1", token, inbox_prefix="_INBOX.n1.enrol")
        reply = json.loads((await enrol.request("orch.enrol.n1", token.encode(), timeout=5)).data)
        await enrol.close()
        assert reply["user"] == "node-n1" and len(reply["password"]) >= 40
        assert await _refused(urls[1], "enrol-n1", token)  # redeemed: the token cannot even log in again

        # -- the node's credential: every server, the agent's subjects only --------------------------
        for url in urls:  # its own job's logs and cloud's notices; not another node's, job's or cloud's
            assert await _violations(url, "node-n1", reply["password"], "_INBOX.n1",
                                     ok=["orch.node.n1.hb", "orch.logs.j1.n1", "orch.notice.aws.n1"],
                                     refused=["orch.node.n2.hb", "orch.logs.j2.n1", "orch.notice.gcp.n1"])

        # -- the bucket holds hashes only ----------------------------------------------------------------
        entry = await store_a.kv.get("node.n1")
        assert reply["password"] not in entry.value.decode() and token not in entry.value.decode()

        # -- NodeGone (on A, the old leader's object: the records are shared) revokes everywhere ------
        await anyio.to_thread.run_sync(creds_a.on_gone, "n1")
        for url in urls:
            assert await _refused(url, "node-n1", reply["password"])
    finally:
        for nc in conns:
            await nc.close()


async def test_orchd_in_callout_mode_enrols_a_real_agent_and_revokes_when_gone(tmp_path) -> None:
    """The daemon wiring (``[credentials] mode = "callout"``): orchd answers the callout for its own
    logins, a launch carries an enrolment token, the real agent enrols and heartbeats with its own
    credential, the node dies -> NodeGone -> a new login with that credential is refused."""
    import wire as ev
    from orchestrator.cli.client import AdminClient
    from orchestrator.daemon.run import run_daemon
    from orchestrator.jobspec import parse_jobspec
    from orchestrator.settings import load_settings
    from tests.integration import helpers as h
    from tests.integration.test_node_credentials import RecordingCloud

    issuer = KeyPair.create("account")
    (tmp_path / "issuer.seed").write_text(issuer.seed)
    (tmp_path / "auth.pw").write_text(AUTH_PW + "\n")
    users = tmp_path / "static-users.json"
    users.write_text(json.dumps([{"name": "orchd", "password_hash": hash_password(ORCHD_PW), "role": "orchd"}]))
    (tmp_path / "auth.conf").write_text(render_callout_authorization(
        issuer.public_key, [User(name="orchd-auth", password_hash=hash_password(AUTH_PW),
                                 permissions=auth_user_permissions())]))
    (tmp_path / "server.conf").write_text(render_server_config(host="127.0.0.1", port=-1, store_dir=None,
                                                               http_port=None, server_name="orch-callout"))
    server = NatsServer(tmp_path / "srv", config_file=str(tmp_path / "server.conf")).start()
    try:
        url = server.url
        settings = load_settings(h.write_config(tmp_path, url), env={
            "ORCH_NATS__USER": "orchd", "ORCH_NATS__PASSWORD": ORCHD_PW,
            "ORCH_CREDENTIALS__ENABLED": "true", "ORCH_CREDENTIALS__MODE": "callout",
            "ORCH_CREDENTIALS__ISSUER_SEED_FILE": str(tmp_path / "issuer.seed"),
            "ORCH_CREDENTIALS__AUTH_PASSWORD_FILE": str(tmp_path / "auth.pw"),
            "ORCH_CREDENTIALS__STATIC_USERS_FILE": str(users)})
        cloud = RecordingCloud()
        async with anyio.create_task_group() as tg:
            d = await tg.start(lambda task_status: run_daemon(settings, {"fake": cloud}, feeds=False,
                                                              task_status=task_status))
            observer = await nats.connect(url, user="orchd", password=ORCHD_PW, connect_timeout=2)
            js = observer.jetstream()
            await h.publish_js(js, ev.subject_price("fake", "r1"), h.price(h.POOL, 1.0, 3.0))
            await h.publish_js(js, ev.subject_price("fake", "r1"), h.price(h.POOL_OD, 3.0, 3.0))
            await h.wait_for(lambda: len(d.state.pools) == 2)
            admin = await AdminClient.connect([url], nats_settings=settings.nats)
            await admin.call("jobs", "submit", ev.SubmitJobRequest(spec=parse_jobspec(h.JOB_TOML.format(nodes=1))))
            await admin.close()
            (inst,) = await h.wait_for(lambda: cloud.all_instances())
            token = cloud.requests[0].bootstrap.node_credentials[inst.node_id]

            agent_scope, stored = await h.start_enrolling_agent(tg, d, inst, token, url, tmp_path / "agent")
            assert stored["user"] == f"node-{inst.node_id}"

            agent_scope.cancel()
            cloud.preempt(inst.instance_id)  # the node dies: heartbeat timeout -> CheckInstance -> NodeGone
            with anyio.fail_after(20):
                while not await _refused(url, stored["user"], stored["password"]):
                    await anyio.sleep(0.2)
            d.request_stop()
        await observer.close()
    finally:
        server.cleanup()


async def test_orchd_in_callout_mode_lists_every_bad_credential_file_at_start(tmp_path) -> None:
    from orchestrator.daemon.run import StartupError, run_daemon
    from orchestrator.settings import load_settings
    from tests.integration import helpers as h

    (tmp_path / "user.seed").write_text(KeyPair.create("user").seed)  # a seed, but not an account's
    settings = load_settings(h.write_config(tmp_path, "nats://127.0.0.1:1"), env={
        "ORCH_CREDENTIALS__ENABLED": "true", "ORCH_CREDENTIALS__MODE": "callout",
        "ORCH_CREDENTIALS__ISSUER_SEED_FILE": str(tmp_path / "user.seed"),
        "ORCH_CREDENTIALS__AUTH_PASSWORD_FILE": str(tmp_path / "missing.pw"),
        "ORCH_CREDENTIALS__STATIC_USERS_FILE": str(tmp_path / "missing.json")})
    with pytest.raises(StartupError) as err:
        await run_daemon(settings, {}, feeds=False)
    text = str(err.value)
    assert "a user seed, an account seed (SA...) is needed" in text
    assert "credentials.auth_password_file" in text and "credentials.static_users_file" in text
