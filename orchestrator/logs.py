"""structlog configuration: JSON when not on a terminal (journald), a console renderer on a terminal.

Configured once per process by ``configure``. Context (job, node) is bound per message with
``structlog.contextvars.bound_contextvars`` in the shell, never with a bare ``bind_contextvars`` inside
a NATS callback (nats-py runs one subscription's callbacks in one task: the binding would leak).
"""

from __future__ import annotations

import logging
import sys

import structlog

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}
_SECRET_KEYS = frozenset({"password", "token", "credential", "creds", "secret", "seed", "authorization"})


def _redact(_logger: object, _name: str, event: dict) -> dict:
    """No secret reaches a log line: values of secret-looking keys are replaced."""
    for key in list(event):
        if any(s in key.lower() for s in _SECRET_KEYS):
            event[key] = "***"
    return event


def configure(level: str = "info", fmt: str = "auto", stream=None) -> None:
    stream = stream or sys.stderr
    console = fmt == "console" or (fmt == "auto" and stream.isatty())
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
        logger_factory=structlog.PrintLoggerFactory(file=stream),
        cache_logger_on_first_use=False,
    )
