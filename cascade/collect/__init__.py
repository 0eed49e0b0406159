"""What a server keeps of the traffic it serves, to train the next cascade from.

- ``record``: one request a pass-through forwarded (``CollectedItem``: state, questions, the
  upstream's distributions and the identity it stated);
- ``labelled``: a state the teacher answered (``LabelledState``), what an escalation and an
  audit record (``cascade.audit.record``) share;
- ``escalation``: one request a cascade escalated (``EscalationRecord``: state, and the
  teacher's distribution for each bundle question it answered);
- ``collector``: which requests are kept (a seeded share, up to a size), where they go (a
  ``Sink``) and the thread that writes them, so that a slow store never slows a request.

``cascade`` never writes a store itself: ``distill.loop.collected.StoreTraffic`` and
``distill.loop.escalations.StoreEscalations`` are the sinks the command line passes (a label store,
SQLite or PostgreSQL), and ``distill.loop.evidence`` reads both back for a retrain.
"""
