"""Commands from orchd on ``orch.cmd.<node>`` (request/reply): decode, deduplicate, fence, execute, ack.

Role: commands are idempotent: an already seen ``cmd_id`` gets the very same ``CommandAck`` again and no
second effect (the last ``remember`` acks are kept), if it names the same command (kind, job and
generation): a ``cmd_id`` that comes back naming another command is executed as a new one and logged
(``command_id_reused``: an orchd that crashed after sending a command it had not yet stored numbers its
next command to this node the same), both acks kept under that id; a command whose ``fencing_token`` is lower than the
highest seen is refused with ``stale_fencing_token`` (a deposed orchd leader cannot act). Other errors
in the ack: ``bad_command:<reason>``, ``wrong_node``, ``unknown_command``, ``internal:<type>`` and what the
generation runner answers (``unknown_generation``, ``stale_generation``, ``draining``, ``spawn_failed``).

Concurrency contract: ``on_msg`` is the NATS subscription callback: it runs in nats-py's subscription
task and does quick work (a generation start waits for the ranks to be spawned, nothing longer).
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable

import structlog
from nats.aio.msg import Msg

from agent.generations import GenerationRunner
from wire import (
    AbandonGenerationCmd,
    AgentCommand,
    CheckpointCmd,
    CommandAck,
    DrainCmd,
    NodeId,
    StartGenerationCmd,
    StopCmd,
    WireError,
    decode,
    encode,
)

log = structlog.get_logger("agent")

_COMMANDS = (CheckpointCmd, StartGenerationCmd, StopCmd, AbandonGenerationCmd, DrainCmd)  # = AgentCommand


class AckCache:
    """The acks of the last ``remember`` cmd_ids, each kept per command it named (kind, job, generation):
    a retry of a command gets its ack (``get``); another command under a known id (``named``: the kinds
    seen under it) is not one, and its ack is kept beside the first's (``put``), so a retry of either is
    answered, never run again. The simulated agents of the chaos drills keep theirs in one too."""

    def __init__(self, remember: int = 1000) -> None:
        self.remember = remember
        self._acks: collections.OrderedDict[str, dict[tuple[str, str | None, int], CommandAck]] = \
            collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._acks)

    @staticmethod
    def _what(cmd: AgentCommand) -> tuple[str, str | None, int]:
        return type(cmd).__name__, cmd.job_id, cmd.generation

    def get(self, cmd: AgentCommand) -> CommandAck | None:
        return self._acks.get(cmd.cmd_id, {}).get(self._what(cmd))

    def named(self, cmd_id: str) -> list[str]:
        return [kind for kind, _job, _gen in self._acks.get(cmd_id, {})]

    def put(self, cmd: AgentCommand, ack: CommandAck) -> None:
        self._acks.setdefault(cmd.cmd_id, {})[self._what(cmd)] = ack
        self._acks.move_to_end(cmd.cmd_id)
        while len(self._acks) > self.remember:
            self._acks.popitem(last=False)


class CommandHandler:
    def __init__(self, node_id: NodeId, generations: GenerationRunner, request_shutdown: Callable[[str], None], *,
                 remember: int = 1000) -> None:
        self.node_id = node_id
        self.generations = generations
        self.request_shutdown = request_shutdown
        self.fencing_token = 0  # the highest seen
        self._acks = AckCache(remember)

    async def on_msg(self, msg: Msg) -> None:
        ack = await self.handle(msg.data)
        if msg.reply:
            try:
                await msg.respond(encode(ack))
            except Exception as e:  # any failure: orchd retries with the same cmd_id
                log.warning("command_reply_failed", cmd_id=ack.cmd_id, error=repr(e))

    def _ack(self, cmd_id: str, error: str | None) -> CommandAck:
        return CommandAck(cmd_id=cmd_id, node_id=self.node_id, ok=error is None, error=error, ts=time.time())

    async def handle(self, data: bytes) -> CommandAck:
        try:
            cmd = decode(data, AgentCommand)  # checks the union at run time; typed AnyWire
        except WireError as e:
            log.warning("command_rejected", reason=e.reason)
            return self._ack("", f"bad_command:{e.reason}")
        if not isinstance(cmd, _COMMANDS):  # narrows for the type checker; decode has refused others
            return self._ack("", "bad_command:not_a_command")
        if cmd.node_id != self.node_id:
            return self._ack(cmd.cmd_id, "wrong_node")
        cached = self._acks.get(cmd)
        if cached is not None:  # a retry of a command already executed: same answer, no second effect
            # its token counts all the same: a new leader re-executing its predecessor's outbox fences it
            self.fencing_token = max(self.fencing_token, cmd.fencing_token)
            return cached
        if named := self._acks.named(cmd.cmd_id):
            log.warning("command_id_reused", cmd_id=cmd.cmd_id, was=named[0], now=type(cmd).__name__,
                        generation=cmd.generation)
        if cmd.fencing_token < self.fencing_token:
            log.warning("command_stale_fencing_token", cmd_id=cmd.cmd_id, token=cmd.fencing_token,
                        highest=self.fencing_token)
            return self._ack(cmd.cmd_id, "stale_fencing_token")
        self.fencing_token = cmd.fencing_token
        try:
            error = await self._execute(cmd)
        except Exception as e:  # any failure: reported to orchd in the ack, not a crash of the agent
            log.exception("command_failed", cmd_id=cmd.cmd_id)
            error = f"internal:{type(e).__name__}"
        ack = self._ack(cmd.cmd_id, error)
        self._acks.put(cmd, ack)
        log.info("command_handled", kind=type(cmd).__name__, cmd_id=cmd.cmd_id, generation=cmd.generation,
                 ok=ack.ok, error=error)
        return ack

    async def _execute(self, cmd: AgentCommand) -> str | None:
        g = self.generations
        match cmd:
            case StartGenerationCmd():
                return await g.start(cmd)
            case CheckpointCmd():
                return g.checkpoint(cmd)
            case StopCmd():
                g.stop(cmd)
                return None
            case AbandonGenerationCmd():
                return g.abandon(cmd)
            case DrainCmd():
                self.request_shutdown(f"drain:{cmd.reason}")
                return None
        return "unknown_command"
