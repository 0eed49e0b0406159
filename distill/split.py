"""Moved to ``distill.training.split``: this path warns, and goes in the next release."""

from distill._moved import alias

alias(__name__)
