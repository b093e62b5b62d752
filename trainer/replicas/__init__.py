"""Shard replicas in peers' host memory: a node that vanishes without notice loses at most k + 1 steps.

``protocol`` (frames, keys, handshake), ``holder`` (the per-node process), ``client`` are torch-free;
``snapshot`` and ``replicator`` (the ranks' side, used by trainer.lib.Session) import torch.
"""
