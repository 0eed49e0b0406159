"""The cascade as a Ray Serve application: what places ``cascade serve``'s own app on Ray.

- ``plan``: the Ray Serve config that ``cascade ray-config`` writes, for ``serve run`` or
  ``serve deploy`` (or a KubeRay RayService): the cheap tiers in replicas that Ray autoscales on
  their queue, a GGUF teacher in a deployment of its own (on a GPU where one is given), reached
  by URL through Ray's proxy.
- ``proxy``: the middleware Ray's HTTP proxy runs so that a request whose replica died is sent
  again, not lost.

The replicas themselves are ``cascade serve`` run by Ray, so they live with that command
(``distill.cli.serve.replicas``): each parses the same flags and opens ``--audit-store`` as the
command does (one PostgreSQL store: one drift watch for all). Ray is the ``ray-serve`` extra and
is imported only where Ray runs these modules. See docs/ray-serve.md.
"""
