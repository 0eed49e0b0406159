"""The loop a deployed cascade runs: what serving keeps, retraining on it, the promotion gate.

- ``decide``: every item of a corpus decided through a cascade into a JSONL file a rerun resumes
  (``cascade decide``).
- ``auditing``: audits kept in the bundle's label store, and what ``cascade audit`` reports.
- ``escalations``: the escalations a cascade kept (``serve``, ``decide``): the sink, the reader.
- ``collected``: the traffic a pass-through collected: the sink, the reader, the training set.
- ``evidence``: everything a store labelled, each state once, with where it came from.
- ``retrain``: a new bundle from that evidence, calibrated on held-out uniform draws
  (``cascade retrain``).
- ``promote``: the gate: a retrained bundle replaces the serving one only if it certifies at
  least as much on the same evidence (``cascade promote``); the swap and the promotions log.
- ``watch``: the loop as one command: retrain and promote every N new teacher labels,
  restart-safe, one loop per serving path (``cascade loop``).
"""
