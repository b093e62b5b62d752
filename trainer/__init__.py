"""Trainer: FSDP2/DDP GPT training with emergency, resharded, exactly-resumable checkpoints.

Importing the package must stay torch-free: the agent and orchd import ``trainer.contract`` on hosts
without torch. The library API lives in ``trainer.lib`` (Session), ``trainer.data`` (ExactlyOnceSampler)
and ``trainer.signals`` (install_early); the built-in trainer is ``python -m trainer``.
"""
