"""Moved to ``distill.demo.teacher``: this path warns, and goes in the next release."""

from distill._moved import alias

alias(__name__)
