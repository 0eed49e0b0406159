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
      +-- ServiceError            a call a client may retry or pass on: its HTTP status, Retry-After
           +-- QueueFullError     a top tier's expected wait is past its deadline (503)
           |    +-- WorkTooLargeError   one request's own work is past it (413)
           +-- UpstreamError      an upstream System One server failed a call (502-class)
                +-- UpstreamUnreachable   no connection, or it dropped every time (502)
                +-- UpstreamTimeout       no answer within the timeout or deadline (504)
                +-- UpstreamRateLimited   429, with the upstream's Retry-After (429)
                +-- UpstreamRefused       another 4xx: its status and body, passed back unchanged
                +-- UpstreamFailed        a 5xx, or a 3xx, that retries did not cure (502 or 503)
                +-- UpstreamAnswerError   a 200 that is not the answers asked for (502; ValueError)
                +-- TeacherChangedError   the upstream's identity is not the teacher's (502)
```
Each also inherits the built-in it refines, so callers that only know ``ValueError`` still catch
it. The offline package's errors (``distill``: StoreError, TrainError, CalibrationError, ...)
derive from ``CascadeError`` too.

A ``ServiceError``'s message is what a server answers with: it is redacted as it is made (every
URL's password, every ``password=`` pair: ``cascade.private``), whoever wrote it.
"""

from collections.abc import Mapping

from cascade.private import redact_text


class CascadeError(Exception):
    """Base of every error this package raises for a user to fix."""


class OpenPortError(CascadeError):
    """A server would listen beyond this machine with no key checked."""


class StoreUnavailable(CascadeError):
    """A store that cannot be reached now (a database server restarting, a session it ended, a
    lock held past the wait): what was being written is whole and may be written again, since the
    store's writes are idempotent. A writer keeps it and retries; nothing about the item is wrong."""


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


class ServiceError(CascadeError):
    """A call that failed in a way its client can act on: ``status`` is the HTTP status a server
    answers it with, ``retry_after`` (whole seconds) when waiting would help, ``body`` and
    ``content_type`` an upstream's own error body where it is passed back unchanged, and
    ``passed`` the headers of that answer passed back with it (its ``x-`` ones, its request id
    among them, and its ``RateLimit`` ones). The message is kept without secrets
    (``cascade.private.redact_text``)."""

    status = 502

    def __init__(self, message: str, retry_after: int | None = None, status: int | None = None,
                 body: bytes | None = None, content_type: str | None = None,
                 passed: Mapping[str, str] | None = None) -> None:
        super().__init__(redact_text(message))
        self.retry_after = retry_after
        self.status = status if status is not None else type(self).status
        self.body, self.content_type = body, content_type
        self.passed = dict(passed or {})

    @property
    def headers(self) -> dict[str, str]:
        """The headers its answer carries: those passed on, and ``Retry-After`` where waiting helps."""
        wait = {"Retry-After": str(self.retry_after)} if self.retry_after is not None else {}
        return {**self.passed, **wait}


class QueueFullError(ServiceError):
    """A top tier's queue would keep this request past its deadline: refused at once (503)."""

    status = 503


class WorkTooLargeError(QueueFullError):
    """One request's own work would keep a top tier past the deadline, however short its queue:
    refused at once (413); waiting would not help, a smaller request would."""

    status = 413


class UpstreamError(ServiceError):
    """An upstream System One server (a URL teacher) failed a call."""


class UpstreamUnreachable(UpstreamError):
    """The upstream refused or dropped the connection on every try (502)."""


class UpstreamTimeout(UpstreamError):
    """The upstream did not answer within the read timeout or the call's deadline (504)."""

    status = 504


class UpstreamRateLimited(UpstreamError):
    """The upstream answered 429; ``retry_after`` is its Retry-After (429)."""

    status = 429


class UpstreamRefused(UpstreamError):
    """The upstream refused the request with a 4xx other than 429: passed back unchanged."""


class UpstreamFailed(UpstreamError):
    """The upstream answered 5xx (or redirected) and retries did not cure it (502, or 503 with
    the upstream's Retry-After)."""


class UpstreamAnswerError(UpstreamError, ValueError):
    """The upstream answered 200 with something that is not the answers asked for (502)."""


class TeacherChangedError(UpstreamError):
    """The upstream's identity (model, hashes) is not the teacher's this cascade or store holds;
    ``changes`` says what changed, one phrase per field."""

    changes: tuple[str, ...] = ()
