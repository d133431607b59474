"""Trainers built on the fedasync core: the RL trainer lives in :mod:`trainers.rl`."""
