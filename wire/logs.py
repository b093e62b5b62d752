"""structlog configuration: JSON when not on a terminal (journald), a console renderer on a terminal.

Configured once per process by ``configure``. Context (job, node) is bound per message with
``structlog.contextvars.bound_contextvars`` in the shell, never with a bare ``bind_contextvars`` inside
a NATS callback (nats-py runs one subscription's callbacks in one task: the binding would leak).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
from typing import TextIO, cast

import structlog
from structlog.typing import EventDict, WrappedLogger

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}
_SECRET_KEYS = frozenset({"password", "token", "credential", "creds", "secret", "seed", "authorization"})
_NOT_SECRET = frozenset({"fencing_token", "idempotency_token"})  # identifiers, not credentials


@functools.lru_cache(maxsize=4096)
def _secret_key(key: str) -> bool:
    """Whether a log line's value under ``key`` is redacted (keys are few and repeat: remembered)."""
    return key not in _NOT_SECRET and any(s in key.lower() for s in _SECRET_KEYS)


def _redact(_logger: WrappedLogger, _name: str, event: EventDict) -> EventDict:
    """No secret reaches a log line: values of secret-looking keys are replaced."""
    for key in [k for k in event if _secret_key(k)]:
        event[key] = "***"
    return event


class _Stream:
    """The log sink. A log line must never crash the process: when the configured stream is gone
    (closed by whoever owned it, e.g. an embedding program or a test harness), lines go to the
    process's original stderr instead. ``None`` means "sys.stderr as it is at write time"."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self._stream = stream

    def _target(self) -> TextIO:
        return self._stream if self._stream is not None else sys.stderr

    def write(self, text: str) -> None:
        try:
            self._target().write(text)
        except (ValueError, OSError):
            if sys.__stderr__ is not None:  # None only in a process started without any stderr
                sys.__stderr__.write(text)

    def flush(self) -> None:
        with contextlib.suppress(ValueError, OSError):
            self._target().flush()

    def isatty(self) -> bool:
        try:
            return self._target().isatty()
        except (ValueError, OSError):
            return False


class _SslEofNoise(logging.Filter):
    """Drops asyncio's "returning true from eof_received() has no effect when using ssl". nats-py upgrades
    its connection to TLS with ``loop.start_tls``, after which asyncio's stream protocol still takes the
    transport for plain TCP and answers the server's TLS close with True; asyncio then wrote that line,
    raw, to stderr (orchd's and the agent's JSON log, orchctl's output) whenever a TLS connection to NATS
    was closed by the server, although nothing is wrong."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "eof_received() has no effect when using ssl" not in record.getMessage()


SSL_EOF_NOISE = _SslEofNoise()
"""On the ``asyncio`` logger once ``quiet_asyncio_ssl_eof`` ran (``configure`` runs it; ``addFilter`` keeps
one copy)."""


def quiet_asyncio_ssl_eof() -> None:
    logging.getLogger("asyncio").addFilter(SSL_EOF_NOISE)


def configure(level: str = "info", fmt: str = "auto", stream: TextIO | None = None) -> None:
    quiet_asyncio_ssl_eof()
    sink = _Stream(stream)
    console = fmt == "console" or (fmt == "auto" and sink.isatty())
    renderer = structlog.dev.ConsoleRenderer() if console else structlog.processors.JSONRenderer()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            _redact,
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS.get(level, logging.INFO)),
        # PrintLogger only calls write/flush (and isatty): _Stream is all the file it needs
        logger_factory=structlog.PrintLoggerFactory(file=cast(TextIO, sink)),
        cache_logger_on_first_use=False,
    )
