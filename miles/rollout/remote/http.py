"""HTTP to one inference server: timeouts, bounded retries, and one error that names the URL.

A connection error, a timeout or a 5xx is retried (`retries` attempts in all, with a short
backoff); a 4xx is the server refusing the request and is never retried. Whatever finally fails
raises `EngineError` (exit 1, one `error:` line naming the server and what it answered), so a down,
slow or garbage-speaking server stops the run before anything is trained on its output.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx

from miles.errors import RunFailed


class EngineError(RunFailed):
    """An inference server is down, too slow, refused a request, or answered something unusable.

    `status` is the HTTP status of a refusal (a 4xx, never retried) or of the last 5xx answered;
    None when no answer came (refused connection, timeout) or the answer was unusable."""

    def __init__(self, message: str, *, status: int | None = None):
        super().__init__(message)
        self.status = status


class ServerClient:
    """Requests to the server at `url`; `api_key` is sent as `Authorization: Bearer KEY`."""

    def __init__(self, url: str, *, flag: str, timeout: float, retries: int, api_key: str | None = None):
        self.url, self.flag = url.rstrip("/"), flag
        self.timeout, self.retries = timeout, retries
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def fail(self, what: str, *, status: int | None = None) -> EngineError:
        return EngineError(f"{self.flag} {self.url}: {what}", status=status)

    def request(self, method: str, path: str, body: Any = None, *, params: dict | None = None,
                timeout: float | None = None) -> Any:
        """One call from synchronous code (weight updates, health): the parsed JSON, or the text."""
        return asyncio.run(self._once(method, path, body, params, timeout))

    async def _once(self, method, path, body, params, timeout):
        async with self.session() as session:
            return await self.call(session, method, path, body, params=params, timeout=timeout)

    def session(self, connections: int = 8) -> httpx.AsyncClient:
        limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
        return httpx.AsyncClient(headers=self.headers, limits=limits, timeout=self.timeout)

    async def call(self, session: httpx.AsyncClient, method: str, path: str, body: Any = None, *,
                   params: dict | None = None, timeout: float | None = None) -> Any:
        last, status = "", None
        for attempt in range(self.retries):
            if attempt:
                await asyncio.sleep(min(0.5 * 2 ** (attempt - 1), 4.0))
            try:
                r = await session.request(method, self.url + path, json=body, params=params,
                                          timeout=timeout or self.timeout)
            except httpx.TimeoutException:
                last, status = f"no answer within {timeout or self.timeout:g} s (--rollout-request-timeout)", None
                continue
            except httpx.TransportError as e:
                status = None
                last = f"cannot connect ({type(e).__name__}: {e or 'connection failed'}); is the server up?"
                continue
            if r.status_code >= 500:
                last, status = f"{method} {path} answered {r.status_code}: {_message(r)}", r.status_code
                continue
            if r.status_code >= 400:
                raise self.fail(f"{method} {path} was refused with {r.status_code}: {_message(r)}",
                                status=r.status_code)
            return _body(r)
        raise self.fail(f"{method} {path} failed {self.retries} time(s); last: {last}", status=status)


def _body(r: httpx.Response) -> Any:
    if "json" in r.headers.get("content-type", ""):
        try:
            return r.json()
        except json.JSONDecodeError:
            return r.text
    return r.text


def _message(r: httpx.Response) -> str:
    """The error message of SGLang's and vLLM's error bodies, else the start of the body."""
    body = _body(r)
    if isinstance(body, dict):
        error = body.get("error", body.get("message", body))
        if isinstance(error, dict):
            error = error.get("message", error)
        return str(error)[:300]
    return str(body).strip()[:300] or "(empty body)"
