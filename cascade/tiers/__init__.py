"""Tier kinds: each kind's manifest spec, runtime tier and builder in one module (``base`` says how)."""
