"""The ClientApp (``clients.app``) and what a silo runs locally: training, DP-SGD and its
privacy ledger, erasure, fault injection."""
