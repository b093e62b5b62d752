"""orchd, the daemon shell around the pure core: ingestion, the decide pipeline, persistence, the
executor, the admin service, metrics, the HA lease, price feeds and the provider registry.
Entry point: ``orchestrator.daemon.run`` (``orchd``, ``python -m orchestrator.daemon``)."""
