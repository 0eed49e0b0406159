"""Moved to ``distill.training.mid_layer``: this path warns, and goes in the next release."""

from distill._moved import alias

alias(__name__)
