"""Moved to ``distill.demo.synthetic``: this path warns, and goes in the next release."""

from distill._moved import alias

alias(__name__)
