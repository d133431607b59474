"""The errors a user can fix: a config value, a missing data file, a damaged checkpoint.

No paper. One base class, :class:`UserError`, so that the ``fedasync`` command can turn every
one of them into a single line on stderr and exit code 2, while a bug still shows its
traceback. Each message names the key or file and says what to do. The subclasses also derive
from the built-in type callers caught before (``ValueError``, ``FileNotFoundError``).
"""

from __future__ import annotations


class UserError(Exception):
    """Something the user can fix; the message is one line naming the key or file."""


class ConfigError(UserError, ValueError):
    """A configuration value (or an argument taken from one) is not allowed."""


class DataError(UserError, FileNotFoundError):
    """A data file is missing, or is not the file that was pinned."""


class CheckpointError(UserError, ValueError):
    """A checkpoint file is missing, unreadable, damaged, unverifiable, or of another run."""
