"""The run kit: what every run command shares, beneath the trainers and the simulations.

``fedasync simulate``, ``fedasync rl``, ``fedasync pipeline`` and ``fedasync market`` each solve
the same run problems here, once: the config loader (`runkit.configload`), the run section's
common keys, the run folder (event log, summary, truncate on resume, config-compatibility
check), the run shape every trainer follows (`runkit.recipe`), and the metrics sinks that follow
every run kind's event log live into TensorBoard and MLflow (`runkit.sinks`, on the tail of a
live log, `runkit.tail`). It imports the core (``fedasync``) and omegaconf (and, where a sink
writes, tensorboard and mlflow), never ``server``, ``clients``, ``simulations`` or
``trainers``. docs/architecture.md shows where it sits.
"""
