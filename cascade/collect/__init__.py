"""Traffic collected by a pass-through: what clients asked an upstream teacher and what it answered.

- ``record``: one collected request (``CollectedItem``: state, questions, the upstream's
  distributions and the identity it stated) and where such records go (``TrafficSink``);
- ``collector``: which requests are kept (a seeded share, up to a size) and the thread that
  writes them, so that a slow store never slows a request.

``cascade`` never writes a store itself: ``distill.collected.StoreTraffic`` is the sink the
command line passes (a label store, SQLite or PostgreSQL), and ``distill.collected`` reads the
items back for training.
"""
