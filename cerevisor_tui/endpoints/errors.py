"""Errors a model server can give us, each phrased for the operator and marked retryable or not."""

from __future__ import annotations

import errno
from collections.abc import Callable


class EndpointError(Exception):
    """A request to an endpoint failed; `str()` names the endpoint and the problem."""

    retryable: bool = False

    def __init__(self, endpoint: str, problem: str, *, status: int | None = None,
                 retry_after_s: float | None = None, retryable: bool | None = None) -> None:
        self.endpoint = endpoint
        self.problem = problem
        self.status = status
        self.retry_after_s = retry_after_s
        if retryable is not None:
            self.retryable = retryable
        super().__init__(f"endpoint {endpoint}: {problem}")

    def scrub(self, scrub: Callable[[str], str]) -> EndpointError:
        """Take every API key out of the problem text (a server may echo the Authorization header back);
        returns the same error, for `raise exc.scrub(...)`."""
        problem = scrub(self.problem)
        if problem != self.problem:
            self.problem = problem
            self.args = (f"endpoint {self.endpoint}: {problem}",)
        return self


class EndpointUnreachable(EndpointError):
    """No connection could be made (refused, unknown host, TLS failure)."""

    retryable = True


class OutOfDescriptors(EndpointError):
    """This process could not open a socket: it has as many files open as it may (EMFILE) or the system has
    (ENFILE). The server never saw the request: it is not loading, and not down."""

    retryable = True


def descriptors_exhausted(exc: BaseException) -> bool:
    """Whether `exc` (an httpx error, through the errors it was raised from) is EMFILE or ENFILE of ours."""
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, OSError) and cause.errno in (errno.EMFILE, errno.ENFILE):
            return True
        cause = cause.__cause__ or cause.__context__
    return False


def out_of_descriptors(endpoint: str, url: str) -> OutOfDescriptors:
    return OutOfDescriptors(endpoint, f"cannot connect to {url}: this process is out of file descriptors (too "
                                      "many open files); the server was not reached")


class EndpointHTTPError(EndpointError):
    """The server answered with an HTTP error status; `problem` carries the server's own message."""


class StreamBroken(EndpointError):
    """The stream broke off: connection reset, or it ended without [DONE] and without a finish reason."""

    retryable = True


class ProtocolError(EndpointError):
    """The server sent something that is not an OpenAI-compatible event stream."""

    retryable = True


class MissingApiKey(EndpointError):
    """The environment variable named by api_key_env is not set."""


RETRYABLE_STATUS = frozenset({408, 409, 429, 500, 502, 503, 504})
