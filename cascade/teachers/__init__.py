"""Where a teacher answers: here, an upstream System One URL.

- ``settings``: an upstream's URL and the limits its client keeps (timeouts, in-flight bound);
- ``client``: one pooled httpx client per upstream, with its timeouts, retries, rate-limit
  pauses, keys and compressed bodies (needs the ``upstream`` extra: httpx);
- ``wire``: an upstream's answers read as the teacher's distributions, wrong shapes refused;
- ``identity``: who answers at the URL (model, audit hashes) and the watch that catches a change;
- ``keys``: the upstream key from the environment or a file, the keys it accepted and refused,
  429 pauses (bounded tables), and whether a host is loopback;
- ``admission``: a top tier's queue admits a request only while its expected wait fits.

Only ``client`` imports httpx, and nothing imports ``client`` until an upstream is opened
(``connect.open_client``), so ``import cascade`` and a bundle with a GGUF teacher need none of it.
"""
