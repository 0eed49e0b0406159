"""``cascade serve``: a bundle's cascade behind a System One HTTP endpoint.

A room of its own, on top of the router: ``transport`` reads request bodies (size limit, gzip and zstd,
errors in the shapes clients parse), ``matching`` finds a request's questions among the bundle's
by content, ``engine`` routes requests on one worker thread per tier (requests that arrive together
share a batch; a request the encoder answers never waits behind another's escalation; the top
tier's queue admits by expected wait), ``forward`` is a URL teacher's step (one request holding
only what the local tiers left), ``gone`` drops requests whose client went, ``swap`` takes a
promoted bundle while serving, ``metrics`` counts for Prometheus, ``app`` wires them into an ASGI
application, ``proxy`` is the pass-through to a URL (collecting its traffic), ``teacher`` a GGUF's
readout served alone, and ``lifecycle`` serves any of them on uvicorn until SIGTERM (``serve``:
what ``cascade serve`` calls). It needs the ``serve`` extra (``lifecycle`` imports without it, and
says how to install it); nothing else in ``cascade`` imports it.

Its command line (``cascade serve``'s flags, and what each starts) is ``distill/cli/serve/``:
``command``, ``limits``, ``upstream``. It lives in ``distill`` because ``cascade`` never imports
``distill``, and the command reaches the label store (audits, escalations, collected traffic).
"""
