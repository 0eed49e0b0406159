"""Calibrating a bundle: the certificates, the maths they rest on, and what they are checked
against, one concern per module.

- ``run``: ``calibrate_bundle``, the calibration run that ties the others together.
- ``inputs``: the teacher's labels of the calibration items, and their states from the corpus.
- ``teacher_check``: is a question's teacher reading the inputs at all, before anything is certified.
- ``scoring``: running a cheap tier on those items, timed, and the fit of its cost.
- ``fits``: temperature, threshold and curves per (question, tier); the cascade replayed.
- ``joint``: one certificate for a chain of cheap tiers, their thresholds certified together.
- ``traffic``: certificates from served traffic (escalations and audits, weighted by how each
  was chosen).
- ``payoff``: whether a middle tier pays its way; ``teacher_traffic``: what a teacher behind a URL
  is sent, counted on labelled items.
- ``manifest``: the thresholds, temperatures and facts written back into the bundle.
- ``results``: the schemas of what a run returns (and the report draws).
- ``maths``: temperature scaling and certified thresholds on plain arrays (no bundle, no I/O).
- ``evaluate``: the calibrated cascade replayed on the held-out evaluation items: agreement with
  the teacher, which tier answered what, and the cost (``cascade evaluate``).
"""
