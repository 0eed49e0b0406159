"""Offline distillation and the command line: teacher labels, fast-tier training, threshold
calibration, the traffic loop, reports. It uses ``cascade``; ``cascade`` never imports it.

Grouped by concern, each group a room (a package) with one job; a room imports only rooms below
it and the top-level modules, which import no room (``tests/test_layout.py`` checks):

- ``cli/`` (top): the ``cascade`` command, one module per subcommand (``serve/`` a package);
- ``demo/``: the whole flow on embedded defaults, and its generated corpus;
- ``loop/``, ``reports/``: what serving keeps, retraining on it, the promotion gate; the
  calibration report and its figures;
- ``calibration/``: certificates, the teacher check, the held-out evaluation;
- ``labelling/``, ``training/``: the teacher's labels of a corpus; the fast tiers trained on them;
- ``store/``: the label store, SQLite or PostgreSQL;
- top level: ``options`` (a run's corpus and options), ``stopping`` (a long run stopped cleanly).

The flat module paths of earlier releases (``distill.label``, ``distill.train``, ...) still
import for one release, with a ``DeprecationWarning`` naming the new path (``distill._moved``).
"""
