"""Tiered cascade decision router."""
