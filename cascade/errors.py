"""Exceptions a user can act on.

Every error the package raises on purpose derives from ``CascadeError`` so that the command line
can catch it once and print ``Type: message`` without a traceback. Each also inherits the
built-in it refines, so callers that only know ``ValueError`` still catch it.
"""


class CascadeError(Exception):
    """Base of every error this package raises for a user to fix."""


class RequestError(CascadeError, ValueError):
    """A decision request is malformed; the message starts with the field path."""


class ModelError(CascadeError, ValueError):
    """A model file cannot serve decisions (missing, unreadable, wrong tokeniser, ...)."""


class InputTooLongError(CascadeError, ValueError):
    """A prompt does not fit the context and the caller chose no excerpt policy."""


class BundleError(CascadeError, ValueError):
    """A bundle cannot be loaded as it is: missing or changed files, or an unknown schema."""
