"""The wire protocol between the ServerApp and the ClientApp, defined once for both sides.

- ``keys``: message types and record keys (train, evaluate, unlearn, privacy).
- ``wire``: the packed-array codec every model travels in, decoded strictly.
- ``config``: the typed setup every message carries (local training, data, DP: ``Setup``) and
  what an unlearn request asks of a silo (``SiloErasure``).
- ``messages`` (with ``erasure_messages``): one dataclass per message, with ``to_message`` and
  a ``from_message`` that validates once; ``reading``: its two errors (``Malformed``,
  ``ErrorReply``) and the strict readers.

No module here imports ``server/`` or ``clients/``; both import this package, and ``deploy``
packages it into the Flower app bundle with them.
"""
