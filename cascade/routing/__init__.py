"""Routing a call: the router (``Cascade``), its budget, and the cost forecast a budget spends."""
