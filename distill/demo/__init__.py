"""The demo: the whole offline flow on embedded defaults, end to end and for real (``cascade demo``).

- ``run``: ``run_demo``: a generated corpus with its teacher's labels, the tiers trained,
  thresholds calibrated, a report, the evaluation items routed; every figure printed is measured.
- ``synthetic``: the seeded corpus of support messages whose answers the generator knows.
- ``teacher``: the demo's real LLM teacher, shipped as its labels (``distill/data/``) and shown live.

This package replaced the module ``distill.demo``: its names (``run_demo``, ``DemoConfig``, ...)
still import from here for one release, with a ``DeprecationWarning``; they live in
``distill.demo.run``.
"""

from __future__ import annotations

from distill._moved import moved_name


def __getattr__(name: str) -> object:
    value = moved_name(__name__, name)
    globals()[name] = value  # warned once: ``from distill.demo import X`` asks twice
    return value
