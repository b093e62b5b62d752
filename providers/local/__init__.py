"""The local provider: nodes are orch-agent processes on this machine with fake metadata services."""

from providers.local.provider import LocalConfig, LocalProvider, from_settings

__all__ = ["LocalConfig", "LocalProvider", "from_settings"]
