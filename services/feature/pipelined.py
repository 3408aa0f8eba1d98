"""The read path's Redis connection: every MGET pipelined on one connection.

redis-py takes a connection from its pool for each command, wraps each write in a task of
its own (wait_for) and each read in a timeout, and carries one command per round trip on
a connection: about 100 µs of CPU per read on the development machine, as much as the
rest of a single-entity GetFeatures. Here each read is queued on one connection as it
comes (the reads of one event-loop turn leave in one send), and the replies, which Redis
sends in the order of the commands, are parsed by hiredis and handed to the waiting reads
in that order.

- A connection that fails fails every read in flight with redis.exceptions.ConnectionError
  (the service answers UNAVAILABLE and its health probe checks Redis at once); the next
  read connects again.
- A read whose caller stopped waiting (its deadline) keeps its place in the queue: its
  reply is read and dropped, so the replies after it still meet their own reads.
- More than MAX_IN_FLIGHT reads waiting means Redis stopped answering: the connection is
  dropped (failing them) rather than queueing without bound.

Only plain TCP URLs (redis://); `PipelinedReads.for_url` answers None for others (TLS,
unix sockets) and the store keeps reading through redis-py.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import hiredis
import redis.exceptions
from redis.asyncio.connection import parse_url

# Reads waiting for a reply on one connection before it is deemed stalled.
MAX_IN_FLIGHT = 4096
CONNECT_TIMEOUT_S = 1.0
_AUTH_REFUSALS = ("WRONGPASS", "NOAUTH", "ERR invalid password", "ERR AUTH")


class _Replies(asyncio.Protocol):
    """One connection: commands out in order, replies handed to their waiters in order."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.reader = hiredis.Reader()
        self.waiting: deque[asyncio.Future[Any]] = deque()
        self.transport: asyncio.Transport | None = None
        # Set when the connection is gone: every later call fails with it.
        self.lost: redis.exceptions.ConnectionError | None = None
        self._out: list[bytes] = []
        self._flushing = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.reader.feed(data)
        while True:
            try:
                reply = self.reader.gets()
            except hiredis.ProtocolError as exc:
                self._drop(f"unreadable reply: {exc}")
                return
            if reply is False:
                return
            if not self.waiting:
                self._drop("a reply nobody asked for")
                return
            waiter = self.waiting.popleft()
            if waiter.done():  # its caller stopped waiting: the reply is dropped
                continue
            if isinstance(reply, hiredis.ReplyError):
                waiter.set_exception(redis.exceptions.ResponseError(str(reply)))
            else:
                waiter.set_result(reply)

    def connection_lost(self, exc: Exception | None) -> None:
        why = f": {exc}" if exc else " by Redis"
        self._fail(redis.exceptions.ConnectionError(f"connection to {self.where} closed{why}"))

    def call(self, command: bytes) -> asyncio.Future[Any]:
        """Queue one packed command; the future answers its reply."""
        if self.lost is not None:
            raise self.lost
        if len(self.waiting) >= MAX_IN_FLIGHT:
            self._drop(f"{len(self.waiting)} reads waiting: Redis stopped answering")
            assert self.lost is not None
            raise self.lost
        waiter = asyncio.get_running_loop().create_future()
        self.waiting.append(waiter)
        self._out.append(command)
        if not self._flushing:
            self._flushing = True
            asyncio.get_running_loop().call_soon(self._flush)
        return waiter

    def _flush(self) -> None:
        self._flushing = False
        if self.transport is None or self.lost is not None or not self._out:
            return
        out, self._out = self._out, []
        self.transport.write(out[0] if len(out) == 1 else b"".join(out))

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def _drop(self, why: str) -> None:
        self._fail(redis.exceptions.ConnectionError(f"{self.where}: {why}"))
        self.close()

    def _fail(self, error: redis.exceptions.ConnectionError) -> None:
        if self.lost is None:
            self.lost = error
        self._out.clear()
        while self.waiting:
            waiter = self.waiting.popleft()
            if not waiter.done():
                waiter.set_exception(self.lost)


class PipelinedReads:
    """MGETs pipelined on one Redis connection, connected on first use and again after a
    failure."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        db: int = 0,
        username: str | None = None,
        password: str | None = None,
        connect_timeout_s: float = CONNECT_TIMEOUT_S,
    ) -> None:
        self.host = host
        self.port = port
        self.db = db
        self.username = username
        self.password = password
        self.connect_timeout_s = connect_timeout_s
        self._replies: _Replies | None = None
        self._connecting = asyncio.Lock()
        self._closed = False

    @classmethod
    def for_url(
        cls, url: str, password: str | None = None, **options: Any
    ) -> PipelinedReads | None:
        """For a redis:// URL (the password given here wins over the URL's); None for a
        URL this does not speak (TLS, a unix socket)."""
        parts = parse_url(url)
        if "path" in parts or "connection_class" in parts:
            return None
        return cls(
            parts.get("host", "localhost"),
            int(parts.get("port", 6379)),
            db=int(parts.get("db", 0) or 0),
            username=parts.get("username"),
            password=password if password is not None else parts.get("password"),
            **options,
        )

    @property
    def where(self) -> str:
        return f"Redis at {self.host}:{self.port}"

    async def mget(self, keys: Sequence[str]) -> list[bytes | None]:
        """The values of `keys` (None where a key is absent), in one MGET."""
        replies = self._replies
        if replies is None or replies.lost is not None:
            replies = await self._connection()
        answer: list[bytes | None] = await replies.call(_pack(("MGET", *keys)))
        return answer

    async def _connection(self) -> _Replies:
        async with self._connecting:  # reads that find it down wait for one connect
            replies = self._replies
            if replies is None or replies.lost is not None:
                if self._closed:
                    raise redis.exceptions.ConnectionError(f"{self.where}: closed")
                replies = self._replies = await self._connect()
            return replies

    async def _connect(self) -> _Replies:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, replies = await loop.create_connection(
                    _factory(self.where), self.host, self.port
                )
        except (OSError, TimeoutError) as exc:
            raise redis.exceptions.ConnectionError(
                f"Error connecting to {self.where}: {exc or 'timed out'}"
            ) from None
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                for command in self._handshake():
                    await replies.call(command)
        except redis.exceptions.ResponseError as exc:
            replies.close()
            if str(exc).startswith(_AUTH_REFUSALS):
                raise redis.exceptions.AuthenticationError(f"{self.where}: {exc}") from None
            raise redis.exceptions.ConnectionError(f"{self.where}: {exc}") from None
        except TimeoutError:
            replies.close()
            raise redis.exceptions.ConnectionError(
                f"{self.where}: no answer to the connection's set-up in time"
            ) from None
        except BaseException:  # the caller's deadline, or the connection lost meanwhile
            replies.close()
            raise
        return replies

    def _handshake(self) -> list[bytes]:
        commands = []
        if self.password:  # as redis-py: an empty password sends no AUTH
            auth = (
                ("AUTH", self.username, self.password) if self.username else ("AUTH", self.password)
            )
            commands.append(_pack(auth))
        if self.db:
            commands.append(_pack(("SELECT", str(self.db))))
        return commands

    async def aclose(self) -> None:
        """Close the connection; reads in flight fail, later ones are refused."""
        self._closed = True
        if self._replies is not None:
            self._replies.close()


def _pack(args: tuple[str, ...]) -> bytes:
    """One command in Redis's protocol, encoded in C."""
    # hiredis' stub types the argument as a tuple of one element; any length is accepted.
    packed: bytes = hiredis.pack_command(args)  # type: ignore[arg-type]
    return packed


def _factory(where: str) -> Callable[[], _Replies]:
    return lambda: _Replies(where)
