"""``python -m runkit.sinks``: print the tag table of docs/metrics.md (runkit.sinks.tags)."""

from runkit.sinks.tags import markdown

print(markdown(), end="")
