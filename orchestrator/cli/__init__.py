"""orchctl: a thin CLI over orchd's admin service (``orchestrator.cli.main``), and the local demo."""
