"""Erasure requests: the durable store, the state machine, credentials and the gRPC service
(with its limits, stream caps and record of refused calls: ``limits``, ``guard``, ``refusals``).

A silo (or an admin) submits a request to forget a whole silo or some of its samples; the
request is written to SQLite before it is acknowledged, and the training server moves it
through ``queued -> erasing -> calibrating -> verified | unverified`` (or ``failed``) with
``ErasureStore.transition``. See ``proto/fedasync/erasure/v1/erasure.proto``.

A request's erasure certificate, for a data-protection officer, is made from the store and the
run's event log alone (``certificate``: its data; ``certificate_checks``, ``certificate_gaps``:
what was verified and what was not; ``readings``: each figure's reading, the tolerances and
the verdict, which the lifecycle uses too; ``certificate_events``: what it reads of the event log;
``certificate_html``: the page).
"""
