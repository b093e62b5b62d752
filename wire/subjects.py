"""NATS subjects: tokens go from broad to narrow; values with dots (instance types) stay in payloads.

    orch.price.<cloud>.<region>        PriceTick                 JetStream ORCH_MARKET
    orch.notice.<cloud>.<node>         PreemptionNotice          JetStream ORCH_EVENTS
    orch.node.<node>.hb                Heartbeat                 core NATS
    orch.node.<node>.event             NodeEvent (union)         JetStream ORCH_EVENTS
    orch.cmd.<node>                    AgentCommand (union)      request/reply, CommandAck reply
    orch.logs.<job>.<node>             LogLine                   JetStream ORCH_LOGS
    orch.admin.v1.<resource>.<verb>    admin requests/replies    nats.micro service

Pure: no I/O.
"""

from __future__ import annotations

from typing import Final

from wire.names import check_token


def _token(value: str, field: str = "subject token") -> str:
    """A subject token from an id (``wire.names``: letters, digits, ``_``, ``-``); else ``BadName``."""
    return check_token(field, value)


def subject_price(cloud: str, region: str) -> str:
    return f"orch.price.{_token(cloud, 'cloud')}.{_token(region, 'region')}"


def subject_notice(cloud: str, node: str) -> str:
    return f"orch.notice.{_token(cloud, 'cloud')}.{_token(node, 'node id')}"


def subject_heartbeat(node: str) -> str:
    return f"orch.node.{_token(node, 'node id')}.hb"


def subject_node_event(node: str) -> str:
    return f"orch.node.{_token(node, 'node id')}.event"


def subject_command(node: str) -> str:
    return f"orch.cmd.{_token(node, 'node id')}"


def subject_logs(job: str, node: str) -> str:
    return f"orch.logs.{_token(job, 'job id')}.{_token(node, 'node id')}"


SUBJECT_ADMIN_PREFIX: Final = "orch.admin.v1"


def admin_subject(resource: str, verb: str) -> str:
    return f"{SUBJECT_ADMIN_PREFIX}.{_token(resource)}.{_token(verb)}"
