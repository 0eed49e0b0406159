"""Every exception the runtime raises for a user to act on, in one place.

```
Exception
 +-- CascadeError                 base: the command line prints ``Type: message``, no traceback
      +-- RequestError            a malformed decision request (ValueError; the field path first)
      +-- ModelError              a model file that cannot serve decisions (ValueError)
      +-- InputTooLongError       a prompt longer than the context, with no excerpt (ValueError)
      +-- BundleError             a bundle missing or changed files, or of unknown schema (ValueError)
      +-- RouterError             a cascade that cannot be built as asked (ValueError)
      +-- CorpusError             a corpus or questions file that cannot be read (ValueError)
      +-- TemperatureError        a temperature that is not finite and > 0 (ValueError)
      +-- HttpProblem             cascade.serve: a refused HTTP request, its status and headers
```
Each also inherits the built-in it refines, so callers that only know ``ValueError`` still catch
it. The offline package's errors (``distill``: StoreError, TrainError, CalibrationError, ...)
derive from ``CascadeError`` too.
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


class RouterError(CascadeError, ValueError):
    """A cascade cannot be built as asked: a missing teacher, conflicting arguments, a model given
    for a tier that is not the one the bundle pins."""


class CorpusError(CascadeError, ValueError):
    """A corpus cannot be read, or one of its lines is not a labelling item."""


class TemperatureError(CascadeError, ValueError):
    """A temperature that is not a finite number > 0."""
