"""The ServerApp: the asynchronous loop and the parts it is made of, deployment glue, the erasure service."""
