"""The asynchronous pipeline-parallel trainer (issue 12, in progress): so far its corpus."""
