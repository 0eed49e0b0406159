"""Calibrating a bundle: the run, and the maths it rests on, one concern per module.

- ``run``: ``calibrate_bundle``, the calibration run that ties the others together.
- ``inputs``: the teacher's labels of the calibration items, and their states from the corpus.
- ``scoring``: running a cheap tier on those items, timed, and the fit of its cost.
- ``fits``: temperature, threshold and curves per (question, tier); the cascade replayed.
- ``manifest``: the thresholds, temperatures and facts written back into the bundle.
- ``results``: the schemas of what a run returns (and the report draws).
- ``maths``: temperature scaling and certified thresholds on plain arrays (no bundle, no I/O).
"""
