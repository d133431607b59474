"""The wire protocol between the ServerApp and the ClientApp, defined once for both sides.

- ``keys``: message types and record keys (train, evaluate, unlearn, privacy).
- ``wire``: the packed-array codec every model travels in, decoded strictly.
- ``config``: the typed setup every train message carries (local training, data, DP).

No module here imports ``server/`` or ``clients/``; both import this package, and ``deploy``
packages it into the Flower app bundle with them.
"""
