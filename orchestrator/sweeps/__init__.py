"""Hyperparameter sweeps: Optuna trials run as orchd jobs (docs/sweeps.md).

``spec`` reads sweep files (no Optuna needed), ``store`` keeps sweeps in an Optuna storage (the
``[sweeps]`` extra), ``controller`` reconciles them with orchd's jobs through the admin API. The service
that runs the controller (``orch-sweep`` = ``orchctl sweep run``) and the ``orchctl sweep`` commands
live in ``orchestrator.cli.sweep``; orchd itself only carries a sweep id on each trial's job.
"""
