"""The run kit: what every run command shares, beneath the trainers and the simulations.

``fedasync simulate``, ``fedasync rl``, ``fedasync pipeline`` and ``fedasync market`` each solve
the same run problems here, once: the config loader (`runkit.configload`), the run section's
common keys, the run folder (event log, summary, truncate on resume, config-compatibility
check) and the run shape every trainer follows (`runkit.recipe`). It imports the core
(``fedasync``) and omegaconf, never ``server``, ``clients``, ``simulations`` or ``trainers``.
docs/architecture.md shows where it sits.
"""
