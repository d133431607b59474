"""Asynchronous RL for small language-model policies (issue 10).

:mod:`trainers.rl.tasks` holds the character vocabulary and the procedural tasks with exact
rewards and long-tailed answer lengths; :mod:`trainers.rl.policy` holds the tiny decoder-only
transformer, batched sampling with behaviour log-probs, differentiable sequence log-probs and
the supervised warm start.
"""
