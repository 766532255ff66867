"""The Docker Engine API, bounded: every call in a worker thread with a deadline.

The ``docker`` SDK is blocking and a wedged daemon can hang a call for ever, so each
call runs on this module's own small thread pool (never the event loop's default
executor, which the rest of the agent uses for file work) under
``DockerCallTimeoutSeconds``: the SDK's socket timeout, and the same deadline again
around the thread, since a call can block outside a socket read. Pulls and followed
logs are the two exceptions (docs/agent.md, "Containers"): they may take as long as
the download or the engine's life, so they use a second client without a timeout,
pulls on the same pool and each log follower on a daemon thread of its own.

Any failure to reach the daemon becomes :class:`DockerUnavailable` (503
docker_unavailable); an API refusal becomes :class:`DockerRefused` with the daemon's
explanation, which the runtime turns into a Failed instance or a 422.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
from collections.abc import Callable
from typing import Any, TypeVar

import docker
import docker.errors
import requests.exceptions

from agent._errors import DockerUnavailable

__all__ = ["DockerGateway", "DockerRefused", "NotThere"]

log = logging.getLogger("mirbad.agent.docker")

T = TypeVar("T")


class DockerRefused(Exception):
    """The daemon answered, with an error (``status``, ``explanation``)."""

    def __init__(self, status: int | None, explanation: str) -> None:
        self.status = status
        self.explanation = explanation
        super().__init__(explanation)


class NotThere(DockerRefused):
    """404 from the daemon: no such container or image."""


def _translate(exc: BaseException, endpoint: str) -> Exception:
    if isinstance(exc, docker.errors.NotFound):
        return NotThere(404, str(exc.explanation or exc))
    if isinstance(exc, docker.errors.APIError):
        return DockerRefused(exc.status_code, str(exc.explanation or exc))
    if isinstance(
        exc,
        requests.exceptions.ConnectionError
        | requests.exceptions.Timeout
        | docker.errors.DockerException
        | OSError
        | TimeoutError,
    ):
        return DockerUnavailable(f"the Docker engine at {endpoint} does not answer: {exc}")
    return exc if isinstance(exc, Exception) else RuntimeError(str(exc))


class DockerGateway:
    """One agent's way to the Docker engine (``DockerEndpoint``)."""

    def __init__(self, *, endpoint: str, call_timeout: float, workers: int = 4) -> None:
        self.endpoint = endpoint
        self._timeout = call_timeout
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=workers, thread_name_prefix="docker"
        )
        self._client: docker.DockerClient | None = None
        self._long: docker.DockerClient | None = None

    def _make(self, timeout: float | None) -> docker.DockerClient:
        # The API version is asked of the daemon (Docker 29 refuses anything below 1.44,
        # Podman 4 answers 1.41), so this call itself talks to it: only on the pool.
        # The SDK spells "no socket timeout" as None; its stub says int.
        return docker.DockerClient(base_url=self.endpoint, timeout=timeout)  # type: ignore[arg-type]  # None: no socket timeout (pulls, followed logs)

    @property
    def client(self) -> docker.DockerClient:
        """The bounded client (created lazily: the daemon may not be up yet)."""
        if self._client is None:
            self._client = self._make(self._timeout)
        return self._client

    @property
    def long_client(self) -> docker.DockerClient:
        """The client for pulls and followed logs: no socket timeout."""
        if self._long is None:
            self._long = self._make(None)
        return self._long

    async def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)`` on the pool, bounded by the call timeout."""
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))
        try:
            return await asyncio.wait_for(future, self._timeout + 5)
        except TimeoutError:
            raise DockerUnavailable(
                f"the Docker engine at {self.endpoint} did not answer within "
                f"{self._timeout:g} s (DockerCallTimeoutSeconds)"
            ) from None
        except Exception as exc:
            raise _translate(exc, self.endpoint) from exc

    async def unbounded(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """A pull: on the pool, without a deadline."""
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))
        except Exception as exc:
            raise _translate(exc, self.endpoint) from exc

    async def ping(self) -> None:
        """Raise DockerUnavailable unless the daemon answers ``/_ping``."""
        await self.call(self._ping)

    def _ping(self) -> None:
        try:
            self.client.ping()
        except Exception:
            # A client made while the socket was missing keeps a broken adapter: renew it.
            self._client = None
            raise

    def close(self) -> None:
        for client in (self._client, self._long):
            if client is not None:
                try:
                    client.close()
                except Exception:  # closing is best effort; the pool goes next
                    log.debug("closing a Docker client failed", exc_info=True)
        self._client = self._long = None
        self._pool.shutdown(wait=False, cancel_futures=True)
