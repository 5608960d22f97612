"""What every call of ``rmqtx serve``'s ``MessagingService`` shares: the signature check and
refusals with a status (:func:`signed`), the calls it does not serve (:func:`unsupported`), and
awaiting a group committer's result on the event loop (:func:`result`)."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc

from rmq_spark.group_commit import Slot
from rmq_spark.serve.auth import authenticate
from rmq_spark.serve.protocol import Code, RequestError, status

log = logging.getLogger("rmq_spark.serve.service")

R = TypeVar("R")
Handler = Callable[..., Awaitable[Any]]


def signed(response: Callable[..., Any]) -> Callable[[Handler], Handler]:
    """A handler of signed requests, called with the account that signed it (None on a server
    without accounts): one whose signature is refused (see
    :func:`rmq_spark.serve.auth.authenticate`), or whose handling raises
    :class:`RequestError`, is answered ``response(status=...)`` with the reason."""

    def wrap(handler: Handler) -> Handler:
        @functools.wraps(handler)
        async def answer(self: Any, request: Any, context: Any) -> Any:
            try:
                account = authenticate(metadata(context), self.accounts)
            except RequestError as exc:
                log.warning("refused a request from %s: %s", context.peer(), exc.message)
                return response(status=status(exc.code, exc.message))
            try:
                return await handler(self, request, context, account)
            except RequestError as exc:
                log.info("%s refused: %s", handler.__name__, exc.message)
                return response(status=status(exc.code, exc.message))

        return answer

    return wrap


def unsupported(response: Callable[..., Any], why: str, *, stream: bool = False) -> Handler:
    """A handler that answers a signed call ``UNSUPPORTED`` with ``why`` (once, on a stream),
    as RocketMQ's proxy answers what it does not serve: no gRPC error, no traceback."""

    async def unary(self: Any, request: Any, context: Any, account: Any) -> Any:
        raise RequestError(Code.UNSUPPORTED, why)

    unary.__name__ = response.__name__.removesuffix("Response")  # named in the log
    answer = signed(response)(unary)
    if not stream:
        return answer

    async def streamed(self: Any, request: Any, context: Any) -> AsyncIterator[Any]:
        yield await answer(self, request, context)

    return streamed


def metadata(context: grpc.aio.ServicerContext) -> dict[str, str]:
    """A call's gRPC metadata (header names in lower case)."""
    return {k: v for k, v in context.invocation_metadata() or () if isinstance(v, str)}


async def result(slot: Slot[R]) -> R:
    """Await a group committer's result without holding a thread."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[R] = loop.create_future()

    def settle(done: Slot[R]) -> None:
        if future.cancelled():
            return
        error = done.exception()
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(done.result())

    def on_done(done: Slot[R]) -> None:
        loop.call_soon_threadsafe(settle, done)

    slot.add_done_callback(on_done)
    return await future
