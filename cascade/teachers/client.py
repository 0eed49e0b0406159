"""One pooled HTTP client for an upstream System One server (a URL teacher), on httpx.

Every call has a deadline (``UpstreamSettings.deadline``, below the 10 s System One SDKs wait by
default, so that the cascade answers before its own client gives up) and ends in the answer or in
an ``UpstreamError`` whose status a server can pass on (``cascade.errors``):

- refused or dropped connection, or none taken within the connect timeout (a busy upstream's
  full accept queue drops the connect): retried with a short backoff while the deadline allows (a
  System One call is a pure function of its body, so a resend changes no answer), then 502;
- an answer that is not HTTP this client reads (a head over httpcore's 100 KiB, a broken status
  line): 502, never retried (the upstream computed it, and would send it alike);
- no answer within the read timeout: 504, never retried (the upstream is computing; a resend
  would double its load);
- 502, 503, 504 and 429: retried after their ``Retry-After`` (or the backoff) where that fits the
  deadline, then passed on: 429 as 429 with the upstream's Retry-After, 503 with its Retry-After,
  the others as 502;
- a 429 also pauses every call with that key until its Retry-After: none is sent before;
- any other 4xx is passed back (status and body, the key sent hidden where the body quotes it),
  never retried; a 401 or 403 revokes the key (``AcceptedKeys``), and for ``reject_for`` seconds
  every call with it gets that same refusal at once, without an upstream call or slot
  (``RejectedKeys``); a refusal of the server's own key (not a forwarded one) is a 502 saying so;
- at most ``max_in_flight`` calls are upstream at once; one that finds no slot before its
  deadline is refused with 503.

The key is the caller's ``Authorization`` with ``forward_auth``, else the cascade's own from a
``KeySource``. A key bound for a plain ``http://`` URL that is not this machine's gets one
warning (a line on the ``cascade.upstream`` log, once per URL): it crosses the network in the
clear. ``vouch`` checks a caller's key for a route that sends nothing upstream (the upstream's
``/v1/models`` is asked). Bodies go gzip or zstd compressed where asked; "auto" tries zstd
(gzip without the zstandard package) and falls back to gzip, then to none, at the first 415 (or,
until the upstream took a compressed body, a 400/422 that the same body uncompressed does not
get), and remembers what the upstream takes.
"""

from __future__ import annotations

import email.utils
import gzip
import importlib.util
import json
import logging
import math
import random
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import h11
import httpx

from cascade.errors import (
    CascadeError,
    UpstreamAnswerError,
    UpstreamError,
    UpstreamFailed,
    UpstreamRateLimited,
    UpstreamRefused,
    UpstreamTimeout,
    UpstreamUnreachable,
)
from cascade.private import redact_url
from cascade.teachers.call_deadline import DeadlineBackend, until
from cascade.teachers.keys import AcceptedKeys, Clock, Pauses, Refusal, RejectedKeys, is_loopback
from cascade.teachers.sendable import header_value, scrubbed
from cascade.teachers.settings import UPSTREAM_EXTRA, UpstreamSettings

COMPRESS_FROM = 1024
"""Bodies shorter than this go uncompressed: the bytes saved would not pay for the work."""
_RETRIED = (502, 503, 504, 429)
MAX_RETRY_AFTER = 300.0
"""Seconds of the longest ``Retry-After`` taken from an upstream: a longer one (``inf``, or
``1e300``, which would pause a key for good) is taken as this."""
MAX_REPLY_BYTES = 32 * 1024 * 1024
"""Bytes of the largest answer read from an upstream (after inflating): a System One answer is a
few KB per question, and an upstream must not hold this server's memory (502 past it)."""
_FALLBACK = {"zstd": "gzip", "gzip": "identity"}
_INFLATED = {"identity", "gzip", "deflate", ""}
"""Answer encodings taken: httpx inflates a zstd answer a whole chunk at once, so 32 KB of one
took a server to 2.3 GB before the size bound saw it; gzip inflates at most about 1,000-fold."""
_REREAD = ("content-encoding", "content-length")
"""Headers of an answer that no longer describe its body once it is read and inflated."""
log = logging.getLogger("cascade.upstream")
_WARNED: set[str] = set()  # the URLs whose keys in the clear were warned of, once per process
_WARNED_LOCK = threading.Lock()


@dataclass
class UpstreamReply:
    """A 2xx answer: its JSON, headers and the seconds the call took (retries and waits included);
    ``content`` and ``status`` as the upstream sent them (a pass-through returns them unchanged)."""

    data: Any
    headers: dict[str, str]
    seconds: float
    tries: int = 1
    content: bytes = b""
    status: int = 200


@dataclass
class _Call:
    """One call in progress: its body, the key it goes with, its deadline and tries so far."""

    payload: bytes
    authorization: str | None
    ends: float
    headers: dict[str, str]
    encoding: str = "identity"
    declined: str | None = None  # the encoding this call fell back from (auto), to restore
    tries: int = 0
    started: float = field(default_factory=time.monotonic)

    def left(self) -> float:
        return self.ends - time.monotonic()


class UpstreamClient:
    """The pooled client of one upstream; thread-safe, shared by every call to it."""

    def __init__(self, settings: UpstreamSettings, clock: Clock = time.monotonic) -> None:
        """``clock`` times the key tables (``time.monotonic`` unless a test drives another)."""
        self.settings = settings
        self.accepted = AcceptedKeys(settings.remember, clock)
        self.rejected = RejectedKeys(settings.reject_for, clock)
        self.pauses = Pauses(clock)
        self._slots = threading.BoundedSemaphore(settings.max_in_flight)
        self._encoding: str = settings.compress
        self._taken = False  # whether the upstream answered a body in ``_encoding`` (auto: settled)
        if settings.compress == "auto":
            self._encoding = "zstd" if importlib.util.find_spec("zstandard") is not None else "gzip"
        if settings.key is not None:
            settings.key.check()
        parts = urlsplit(settings.url)
        self._in_clear = parts.scheme == "http" and not is_loopback(parts.hostname)
        if settings.forward_auth or (settings.key is not None and self._in_clear and settings.key.read()):
            self._warn_in_clear()
        if settings.credentials_clash():
            log.warning("WARNING: the upstream URL %s carries a user and password, which go as Basic auth "
                        "in place of the key: the key is not sent; give the key alone, or the URL's "
                        "password alone", settings.shown)
        limits = httpx.Limits(max_connections=settings.max_in_flight,
                              max_keepalive_connections=settings.max_in_flight)
        self._http = httpx.Client(limits=limits, follow_redirects=False,
                                  headers={"Content-Type": "application/json", "Accept-Encoding": "gzip"})
        mounts = getattr(self._http, "_mounts", {})  # env proxies' pools too; tests catch a rename
        for transport in (getattr(self._http, "_transport", None), *mounts.values()):
            pool = getattr(transport, "_pool", None)
            if pool is not None:  # the call's deadline over its status line and headers too
                pool._network_backend = DeadlineBackend()

    def close(self) -> None:
        self._http.close()

    def post(self, body: dict[str, Any], authorization: str | None = None, deadline: float | None = None,
             headers: dict[str, str] | None = None) -> UpstreamReply:
        """POST ``body`` to the upstream; the 2xx answer, or the ``UpstreamError`` to pass on.

        ``authorization``: the caller's header, sent on with ``forward_auth``; ``deadline``:
        seconds for the whole call (default the settings'); ``headers``: more to send (a request id).
        """
        return self.send(json.dumps(body, ensure_ascii=False).encode(), authorization, deadline, headers)

    def send(self, payload: bytes, authorization: str | None = None, deadline: float | None = None,
             headers: dict[str, str] | None = None) -> UpstreamReply:
        """``post`` of a body already serialised (a pass-through forwards the client's bytes)."""
        authorization = self._authorization(authorization)
        self.refuse_rejected(authorization)
        seconds = self.settings.deadline if deadline is None else min(deadline, self.settings.deadline)
        call = _Call(payload, authorization, time.monotonic() + seconds,
                     {name: header_value(value) for name, value in (headers or {}).items()})
        if not self._slots.acquire(timeout=max(0.0, call.left())):
            raise UpstreamFailed(f"{self.settings.max_in_flight} calls to the upstream {self.settings.shown} "
                                 f"were in flight for the whole {seconds:g} s deadline; retry shortly",
                                 retry_after=1, status=503)
        try:
            return self._run(call)
        finally:
            self._slots.release()

    def get(self, url: str, authorization: str | None = None) -> tuple[int, bytes, str | None]:
        """One GET beside the System One route (the upstream's ``/v1/models``), not retried: its
        status, body and content type, or ``UpstreamUnreachable`` / ``UpstreamTimeout`` (or, as
        ``send``, the refusal of a key refused lately; a 401 or 403 is remembered as ``send``'s)."""
        authorization = self._authorization(authorization)
        self.refuse_rejected(authorization)
        if authorization:
            self._warn_in_clear()
        call = _Call(b"", authorization, time.monotonic() + self.settings.deadline, {})
        timeout = httpx.Timeout(connect=self.settings.connect_timeout, read=self.settings.read_timeout,
                                write=self.settings.deadline, pool=self.settings.deadline)
        try:
            response = self._read("GET", url, call, timeout,
                                  headers={"Authorization": authorization} if authorization else {})
        except httpx.TimeoutException as exc:
            raise self._timed_out(exc, call) from None
        except httpx.TransportError as exc:
            raise UpstreamUnreachable(f"the upstream {redact_url(url)} is unreachable ({type(exc).__name__}: "
                                      f"{exc}); check that it runs", retry_after=1) from None
        if response.status_code in (401, 403):
            self._refused(authorization, response)
        return response.status_code, response.content, response.headers.get("content-type")

    @property
    def models_url(self) -> str:
        """The upstream's ``/v1/models``, beside its System One route, with the route's query (a
        key there goes along): "/models" was put after the query, so the upstream read it as part
        of the key."""
        parts = urlsplit(self.settings.url)
        path = parts.path.rstrip("/").removesuffix("/systemone") + "/models"
        return urlunsplit(parts._replace(path=path))

    def refuse_rejected(self, authorization: str | None) -> None:
        """Raise the upstream's refusal of this key where it refused it within ``reject_for``
        seconds (``UpstreamRefused``, its status and body): no call, no slot."""
        refusal = self.rejected.refusal(authorization)
        if refusal is not None and not self.settings.forward_auth:
            raise self._own_key_refused(refusal.status, f"within the last {self.settings.reject_for:g} s",
                                        authorization)
        if refusal is not None:
            raise UpstreamRefused(f"the upstream {self.settings.shown} refused this key "
                                  f"({refusal.status}) within the last {self.settings.reject_for:g} s",
                                  status=refusal.status, body=refusal.body, content_type=refusal.content_type)

    def vouch(self, authorization: str | None) -> None:
        """Check a caller's key, with forwarded auth, for a route that sends nothing upstream (a
        cascade's ``/v1/models`` and ``/metrics``): it passes where the upstream answered it
        within ``remember`` seconds, or where the upstream's ``/v1/models`` answers it with a 2xx
        now (that answer does not count as an acceptance: some servers answer /v1/models to
        anyone). Raises the upstream's refusal (``UpstreamRefused``), or ``UpstreamFailed`` (502)
        where its /v1/models cannot say."""
        if self.accepted.accepted(authorization):
            return
        status, content, kind = self.get(self.models_url, authorization)
        if 200 <= status < 300:
            return
        if status in (401, 403):
            raise UpstreamRefused(f"the upstream {self.settings.shown} refused this key: {status}",
                                  status=status, body=content, content_type=kind)
        raise UpstreamFailed(f"cannot check this key: the upstream's /v1/models beside {self.settings.shown} "
                             f"answered {status}; a key counts as checked once the upstream has answered a "
                             "/v1/systemone request sent with it")

    def _authorization(self, caller: str | None) -> str | None:
        """What a call sends: the caller's Authorization with ``forward_auth``, else this server's key."""
        if self.settings.forward_auth:
            return caller
        key = self.settings.key.read() if self.settings.key is not None else None
        return f"Bearer {key}" if key else None

    def _own_key_refused(self, status: int, what: str, authorization: str | None) -> UpstreamFailed:
        """A 401 or 403 of the key this server sends on its own behalf (or of a call it sent with
        none): the operator's to fix, so a 502 saying so. Passed on as the upstream's 401/403, a
        client's SDK reported its own, valid key as refused."""
        sent = "this server's own upstream key" if authorization else "a call this server sent with no key"
        return UpstreamFailed(f"the upstream {self.settings.shown} refused {sent} ({status} {what}); its "
                              "operator must check the key given by --upstream-key-env or "
                              "--upstream-key-file", status=502)

    def _refused(self, authorization: str | None, response: httpx.Response) -> None:
        """A 401 or 403: the key is no longer accepted, and is refused here for ``reject_for`` s."""
        self.accepted.revoke(authorization)
        self.rejected.reject(authorization, Refusal(response.status_code, response.content,
                                                    response.headers.get("content-type")))

    def _warn_in_clear(self) -> None:
        """One warning per URL, the first time keys would cross the network over plain http://."""
        if not self._in_clear:
            return
        with _WARNED_LOCK:
            if self.settings.url in _WARNED:
                return
            _WARNED.add(self.settings.url)
        what = "callers' keys (forwarded auth)" if self.settings.forward_auth else "the upstream key"
        log.warning("WARNING: %s go to %s over plain http://, readable by anyone on the network between; "
                    "give the upstream as an https:// URL (or reach it through a tunnel on this machine)",
                    what, self.settings.shown)

    def _run(self, call: _Call) -> UpstreamReply:
        """Try, and retry where safe, until an answer, an error to pass on, or the deadline."""
        while True:
            self._wait_out_pause(call)
            call.tries += 1
            try:
                response = self._send(call)
            except httpx.ConnectTimeout:  # nothing was sent: as safe to send again as a refusal
                self._backoff_or_raise(call, None, self._unreachable(call))
                continue
            except httpx.TimeoutException as exc:
                raise self._timed_out(exc, call) from None
            except httpx.DecodingError as exc:  # an answer whose compressed body does not inflate
                raise UpstreamAnswerError(f"the upstream {self.settings.shown} answered with a body that "
                                          f"does not decode ({exc}); check its Content-Encoding") from None
            except httpx.TransportError as exc:  # refused, reset, dropped: safe to send again
                if _unreadable(exc):
                    raise UpstreamAnswerError(f"the upstream {self.settings.shown} answered with HTTP this "
                                              f"client cannot read ({exc}: a head over 100 KiB, or not "
                                              "HTTP/1.1); check what it serves at this URL") from None
                self._backoff_or_raise(call, None, UpstreamUnreachable(
                    f"the upstream {self.settings.shown} is unreachable ({type(exc).__name__}: {exc}) "
                    f"after {call.tries} tr{'y' if call.tries == 1 else 'ies'}; check that it runs",
                    retry_after=1))
                continue
            reply = self._outcome(response, call)
            if reply is not None:
                return reply

    def _send(self, call: _Call) -> httpx.Response:
        """One try, its answer read whole within the call's deadline: the read timeout bounds each
        wait for bytes, so an upstream that drips its body would outlast it otherwise."""
        left = max(0.001, call.left())
        timeout = httpx.Timeout(connect=min(self.settings.connect_timeout, left),
                                read=min(self.settings.read_timeout, left), write=left, pool=left)
        call.encoding = self._encoding if len(call.payload) >= COMPRESS_FROM else "identity"
        headers = dict(call.headers)
        if call.authorization:
            headers["Authorization"] = call.authorization
            self._warn_in_clear()
        if call.encoding != "identity":
            headers["Content-Encoding"] = call.encoding
        content = _compressed(call.payload, call.encoding)
        return self._read("POST", self.settings.url, call, timeout, content=content, headers=headers)

    def _read(self, method: str, url: str, call: _Call, timeout: httpx.Timeout,
              **request: Any) -> httpx.Response:
        """One request, its answer read whole (``_body``) and returned as an answer in hand."""
        with until(call.ends), self._http.stream(method, url, timeout=timeout, **request) as response:
            body = self._body(response, call)
        kept = [(k, scrubbed(v.encode(), call.authorization).decode("utf-8", "replace"))
                for k, v in response.headers.multi_items() if k.lower() not in _REREAD]
        return httpx.Response(response.status_code, headers=kept, content=body, request=response.request)

    def _body(self, response: httpx.Response, call: _Call) -> bytes:
        """The answer's body, inflated, as it comes: past the call's deadline a read timeout (504),
        past ``MAX_REPLY_BYTES`` a 502."""
        coding = response.headers.get("content-encoding", "identity").lower()
        if any(part.strip() not in _INFLATED for part in coding.split(",")):
            raise UpstreamAnswerError(f"the upstream {self.settings.shown} answered {response.status_code} "
                                      f"with a body in {coding!r}, which this client never asks for "
                                      "(it takes gzip, deflate or none); check what it serves at this URL")
        chunks, size = [], 0
        for chunk in response.iter_bytes():
            size += len(chunk)
            if size > MAX_REPLY_BYTES:
                mib, status = MAX_REPLY_BYTES // 2 ** 20, response.status_code
                raise UpstreamAnswerError(f"the upstream {self.settings.shown} answered {status} with a "
                                          f"body over {mib} MiB; check what it serves at this URL")
            if call.left() <= 0:
                raise httpx.ReadTimeout("the answer's body outlasted the call's deadline")
            chunks.append(chunk)
        return b"".join(chunks)

    def _outcome(self, response: httpx.Response, call: _Call) -> UpstreamReply | None:
        """The reply of a 2xx; None to send again; else the error to pass on, raised."""
        status, url = response.status_code, self.settings.shown
        if 200 <= status < 300:
            self._taken = self._taken or call.encoding != "identity"
            self.accepted.accept(call.authorization)
            self.rejected.clear(call.authorization)
            return UpstreamReply(_json(response, url), dict(response.headers),
                                 time.monotonic() - call.started, call.tries, response.content, status)
        if call.encoding != "identity" and self._declined_encoding(response, call):
            return None
        quoted = _snippet(response, call.authorization)
        wait = retry_after(response.headers.get("retry-after"))
        if status == 429:
            self.pauses.pause(call.authorization, wait if wait is not None else 1.0)
            self._backoff_or_raise(call, wait, UpstreamRateLimited(
                f"the upstream {url} is rate-limiting this key (429); retry after "
                f"{_whole(wait)} s", retry_after=_whole(wait), passed=passed_headers(response.headers)))
            return None
        if status in _RETRIED:
            passed = 503 if status == 503 and wait is not None else 502
            self._backoff_or_raise(call, wait, UpstreamFailed(
                f"the upstream {url} answered {status} {quoted} after {call.tries} "
                f"tr{'y' if call.tries == 1 else 'ies'}", retry_after=_whole(wait) if wait else 1,
                status=passed))
            return None
        if status in (404, 405):  # the route is not there: the URL given is wrong, not the request
            raise UpstreamFailed(f"the upstream {url} has no System One route there ({status} {quoted}); "
                                 "its operator must check the URL given (--teacher)", status=502)
        if status in (401, 403):
            self._refused(call.authorization, response)
            if not self.settings.forward_auth:
                raise self._own_key_refused(status, quoted, call.authorization)
        if call.declined is not None and status in (400, 422):  # plain got it too: the body's fault
            self._encoding = call.declined
        if 400 <= status < 500:
            raise UpstreamRefused(f"the upstream {url} refused the request: {status} {quoted}",
                                  status=status, body=scrubbed(response.content, call.authorization),
                                  content_type=response.headers.get("content-type"),
                                  retry_after=_whole(wait) if wait is not None else None,
                                  passed=passed_headers(response.headers))
        where = f" (redirected to {response.headers.get('location')}; give that URL)" if 300 <= status < 400 \
            else ""
        raise UpstreamFailed(f"the upstream {url} answered {status} {quoted}{where}",
                             retry_after=1 if status >= 500 else None)

    def _declined_encoding(self, response: httpx.Response, call: _Call) -> bool:
        """Whether the upstream does not take the compressed body: a 415, or (``auto``, before it
        took a compressed body) a 400/422, which may be the body's own fault: the encodings
        after it are tried, and where the plain body gets a 400/422 too, the encoding is restored
        (``_outcome``). Falls back one encoding if so."""
        status = response.status_code
        guess = self.settings.compress == "auto" and status in (400, 422) and not self._taken
        if status != 415 and not guess:
            return False
        call.declined = call.declined or (call.encoding if guess else None)
        self._encoding = _FALLBACK.get(call.encoding, "identity")
        call.tries -= 1  # a resend in another encoding is not a retry
        return True

    def _wait_out_pause(self, call: _Call) -> None:
        """Sleep out a 429's pause on this key, or refuse at once when it outlasts the deadline."""
        pause = self.pauses.left(call.authorization)
        if pause <= 0:
            return
        if pause > call.left():
            raise UpstreamRateLimited(f"the upstream {self.settings.shown} asked this key to wait "
                                      f"{pause:.1f} s more (429 Retry-After); retry after "
                                      f"{math.ceil(pause)} s", retry_after=math.ceil(pause))
        time.sleep(pause)

    def _backoff_or_raise(self, call: _Call, wait: float | None, error: UpstreamError) -> None:
        """Sleep before the next try (``wait``, else an exponential backoff), or raise ``error``
        when no try is left or the sleep and a try would not fit the deadline."""
        pause = wait if wait is not None else 0.05 * 2 ** call.tries * random.uniform(0.5, 1.0)
        if call.tries > self.settings.retries or pause >= call.left():
            raise error
        time.sleep(pause)

    def _unreachable(self, call: _Call) -> UpstreamUnreachable:
        tries = f" (each of {call.tries} tries)" if call.tries > 1 else ""
        return UpstreamUnreachable(f"the upstream {self.settings.shown} took no connection within "
                                   f"{self.settings.connect_timeout:g} s{tries}; check that it runs",
                                   retry_after=1)

    def _timed_out(self, exc: httpx.TimeoutException, call: _Call) -> UpstreamError:
        if isinstance(exc, httpx.ConnectTimeout | httpx.PoolTimeout):
            return self._unreachable(call)
        return UpstreamTimeout(f"the upstream {self.settings.shown} did not answer within "
                               f"{self._limit_hit(call)} ({type(exc).__name__}); retry later, or raise "
                               "its timeout", retry_after=1)

    def _limit_hit(self, call: _Call) -> str:
        """The limit a timed-out try ran into: a read's wait, or the whole call's deadline (an
        upstream dripping its answer waits less than a read's timeout each time, and said the read's
        2 s where the call had run its 9 s)."""
        settings = self.settings
        if call.left() > 0.01 and settings.read_timeout < settings.deadline:
            return f"{settings.read_timeout:g} s"
        spent = time.monotonic() - call.started
        return f"the call's deadline of {settings.deadline:g} s ({spent:.1f} s spent)"



def _unreadable(exc: BaseException) -> bool:
    """Whether a transport error is h11 refusing the bytes the upstream sent, not a connection
    lost: those were retried three times and said "unreachable; check that it runs"."""
    cause = exc.__cause__ or exc.__context__  # httpx chains httpcore's by cause, httpcore h11's by context
    return isinstance(cause, h11.RemoteProtocolError) or (cause is not None and _unreadable(cause))


def retry_after(value: str | None) -> float | None:
    """Seconds a ``Retry-After`` header asks for, a number of seconds or an HTTP date, at most
    ``MAX_RETRY_AFTER``; None where it says nothing readable (NaN too)."""
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            seconds = email.utils.parsedate_to_datetime(value).timestamp() - time.time()
        except (TypeError, ValueError, OverflowError):
            return None
    return None if math.isnan(seconds) else min(MAX_RETRY_AFTER, max(0.0, seconds))


def _whole(seconds: float | None) -> int:
    return max(0, math.ceil(seconds)) if seconds is not None else 1


def _json(response: httpx.Response, url: str) -> Any:
    try:
        return json.loads(response.content)
    except (ValueError, RecursionError):  # RecursionError: nested past what a parser can read
        raise UpstreamAnswerError(f"the upstream {url} answered {response.status_code} with a body that "
                                  f"is not JSON: {response.content[:80]!r}") from None


def passed_headers(headers: Mapping[str, str], also: tuple[str, ...] = ()) -> dict[str, str]:
    """The upstream's headers a server passes back to its caller, on a refusal as on a 2xx: its
    ``x-`` ones (its request id), its ``RateLimit`` ones, and the lower-case names in ``also``.
    One filter, so a refusal and an answer carry the same ones."""
    return {name: value for name, value in headers.items()
            if name in also or name.startswith(("x-", "ratelimit"))}


def _snippet(response: httpx.Response, authorization: str | None) -> str:
    """The start of an upstream's refusal, quoted in a message, the key it was sent with hidden
    (an upstream that echoes the request's headers handed it to the client)."""
    text = scrubbed(response.content, authorization).decode("utf-8", "replace").strip().replace("\n", " ")
    return text[:200] + ("..." if len(text) > 200 else "")


def _compressed(payload: bytes, encoding: str) -> bytes:
    if encoding == "gzip":
        return gzip.compress(payload, compresslevel=5)
    if encoding == "zstd":
        try:
            import zstandard
        except ImportError:
            raise CascadeError(f"zstd bodies need the zstandard package: {UPSTREAM_EXTRA}") from None
        return zstandard.ZstdCompressor(level=3).compress(payload)
    return payload
