"""Hyperparameter sweeps: Optuna trials run as orchd jobs (docs/sweeps.md).

``spec`` reads sweep files (no Optuna needed), ``store`` keeps sweeps in an Optuna storage (the
``[sweeps]`` extra), ``controller`` reconciles them with orchd's jobs through the admin API. The service
that runs the controller (``orch-sweep`` = ``orchctl sweep run``) and the ``orchctl sweep`` commands
live in ``orchestrator.cli.sweep``, the controllers' lease in ``lease``. orchd only sees each trial's
job, which carries the sweep's id, total budget and deadline (orchd enforces those: core/sweeps.py).
"""
