"""Moved to ``distill.training.onnx_export``: this path warns, and goes in the next release."""

from distill._moved import alias

alias(__name__)
