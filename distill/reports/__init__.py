"""Reports: what a calibration run found, for a reader long after the run, maybe offline.

- ``calibration_report``: one self-contained HTML page, and the same figures as JSON.
- ``templates``: the page's jinja2 template (package data), rendered with autoescape.
- ``figures``: its plots, drawn by matplotlib (the ``report`` extra) to base64 PNGs, each with the
  numbers it was drawn from.
"""
