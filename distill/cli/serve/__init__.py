"""``cascade serve``'s command line: where a reader of ``cascade/serve/`` finds it.

``cascade`` never imports ``distill``, so the server's flags live here, with the other commands.

- ``command``: the ``serve`` subcommand: its parser, and the run that picks what
  ``cascade.serve.lifecycle`` serves (a bundle, a GGUF teacher alone, a pass-through to a URL),
  with audits, escalations and collected traffic kept in a label store.
- ``limits``: the request limits' flags (``cascade.serve.limits``).
- ``upstream``: a URL teacher's flags (timeouts, retries, keys) and its price, which
  ``calibrate`` and ``evaluate`` take too.
- ``replicas``: the same server run by Ray Serve (``cascade ray-config``): each replica parses
  these flags and builds this command's app.

This package replaced the module ``distill.cli.serve``, whose public names it keeps.
"""

from distill.cli.serve.command import DESCRIPTION, EPILOG, add_parser

__all__ = ["DESCRIPTION", "EPILOG", "add_parser"]
