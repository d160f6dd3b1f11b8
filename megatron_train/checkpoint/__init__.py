"""Distributed checkpoints: on-disk format (files), state (state), safe loading, save/resume."""
