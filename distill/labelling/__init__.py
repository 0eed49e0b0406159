"""Labelling: the teacher's answers to every corpus item, kept in a label store a rerun resumes.

- ``gguf``: a local GGUF teacher through the logit-readout scorer (``cascade label``); the loop
  the other ways share (an item's labels committed in one transaction, Ctrl-C ending cleanly).
- ``on_ray``: the same on a Ray cluster, from a pool of actors each holding one teacher.
- ``endpoint``: a System One URL as the teacher, its calls capped, retried and priced.
- ``transfer``: labels into and out of a store as JSONL (gold labels, another machine's run).
- ``selection``: which items a run takes: all of them, the first N, or a seeded sample.
- ``teachers``: real teachers that ship on PyPI as numbered parts of one GGUF, assembled and
  checked against their pinned sha256.
"""
