"""Trace replay of spot policies through the daemon's own decision core (docs/simulations.md).

``python -m simulations replay|explain|table|tune|world-defaults|synth``; ``simulations.chaos`` holds the chaos drills.
"""
