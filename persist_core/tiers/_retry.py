"""Which remote failures are worth retrying, and the retry loop with exponential backoff.

Only transport and throttling failures are transient: connection refused/reset/timed out, a
broken pipe, botocore's connection, read-timeout and closed-connection errors, HTTP 5xx and
S3's SlowDown/Throttling/RequestTimeout codes, and their aiohttp/asyncio counterparts — also
when a library re-raised them as another type (``raise ... from``: s3fs turns a 503 into an
``OSError(EBUSY)``). Anything else, a ``TypeError`` from a bug included, fails at once.
"""

from __future__ import annotations

import errno
import logging
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

from persist_core.errors import PersistError, RemoteError

log = logging.getLogger(__name__)

T = TypeVar("T")

_ERRNOS = frozenset({errno.ECONNRESET, errno.ECONNREFUSED, errno.ETIMEDOUT, errno.EPIPE, errno.ECONNABORTED,
                     errno.EHOSTUNREACH, errno.ENETUNREACH})
_THROTTLE_CODES = frozenset({"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout",
                             "RequestTimeTooSkewed", "RequestLimitExceeded", "ServiceUnavailable", "InternalError"})
#: botocore / aiohttp / asyncio transport errors, by class name (none of them need be installed)
_TRANSPORT = frozenset({"EndpointConnectionError", "ConnectTimeoutError", "ReadTimeoutError", "ConnectionClosedError",
                        "ProxyConnectionError", "ResponseStreamingError", "IncompleteReadError",
                        "ClientConnectionError", "ClientConnectorError", "ServerDisconnectedError",
                        "ClientPayloadError", "ServerTimeoutError", "ClientOSError", "IncompleteRead",
                        "RemoteDisconnected", "ProtocolError"})


def _transient_one(e: BaseException) -> bool:
    if isinstance(e, PersistError):
        return False
    if isinstance(e, (ConnectionError, TimeoutError)):  # resets, refusals, broken pipes, socket/asyncio timeouts
        return True
    names = {c.__name__ for c in type(e).__mro__}
    if names & _TRANSPORT:
        return True
    response = getattr(e, "response", None)
    if "ClientError" in names and isinstance(response, dict):
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
        code = str(response.get("Error", {}).get("Code", ""))
        return status >= 500 or code in _THROTTLE_CODES or code.startswith("5")
    return isinstance(e, OSError) and e.errno in _ERRNOS


def causes(error: BaseException) -> Iterator[BaseException]:
    """``error``, then each exception it was raised ``from``, in turn (each once, however they loop)."""
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        yield e
        seen.add(id(e))
        e = e.__cause__


def is_transient(error: BaseException) -> bool:
    """Whether retrying ``error`` can help (it, or an exception it was raised ``from``)."""
    return any(_transient_one(e) for e in causes(error))


def is_missing(error: BaseException) -> bool:
    """Whether ``error`` (a :class:`RemoteError`, say) says the object is not there: it, or an exception it was
    raised ``from``, is a ``FileNotFoundError`` (fsspec's "no such key" on every backend)."""
    return any(isinstance(e, FileNotFoundError) for e in causes(error))


def retry(what: str, where: str, fn: Callable[[], T], *, attempts: int, backoff_s: float,
          sleep: Callable[[float], None] = time.sleep) -> T:
    """Run ``fn``; retry transient failures up to ``attempts`` attempts in all, doubling the delay.

    Raises:
        RemoteError: a failure that is not transient (at once), or still failing after ``attempts``.
    """
    delay = backoff_s
    for attempt in range(1, attempts + 1):
        try:
            return fn()
        except Exception as e:
            if not is_transient(e):
                raise RemoteError(f"{what} on {where} failed: {type(e).__name__}: {e}") from e
            if attempt == attempts:
                raise RemoteError(
                    f"{what} on {where} failed after {attempt} attempts: {type(e).__name__}: {e}; "
                    "check the network and the endpoint (local checkpoints are intact)"
                ) from e
            log.warning("%s on %s failed (%s: %s); retry %d/%d in %.1f s", what, where, type(e).__name__, e,
                        attempt, attempts - 1, delay)
            sleep(delay)
            delay *= 2
    raise RemoteError(f"{what} on {where}: no attempt made (attempts={attempts})")
