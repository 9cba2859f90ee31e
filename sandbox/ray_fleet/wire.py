"""The data path of a leased fleet sandbox: one TCP connection between the client and its host.

Ray places the leases, caps them, rate-limits container starts and notices lost nodes
(``stare_sandbox.ray_fleet``); a lease's calls (``run``, ``reset``, ``is_alive``) and their results do
not go through Ray. A Ray actor call costs two processes' hops through Ray's core worker and
raylet machinery (about 0.8 ms for a no-op on the loopback, before any argument); a request on a
connection already open costs one write and one read in each process.

When a host grants a lease it returns its address (the node's IP, a port it listens on) and a
random token of ``TOKEN_BYTES`` for that lease (:meth:`LeaseServer.admit`). The client connects
and sends the token as the first bytes of the connection; a token the host did not issue, or one
already used, is refused (a frame ``("refused", why)``, then the connection closes); a good one is
answered ``("ok",)`` and binds the connection to its lease for the connection's life. Then each
request is a frame ``[method, *args]`` and its answer one frame: ``("ok", value)``, ``("raised",
type_name, message)`` (the sandbox failed as a local one would raise it), or ``("failed", why)``
(the host itself failed). A frame is a 4-byte big-endian length and a msgpack body.

The sandboxes cannot reach the port: their containers have no network (``network: none``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import secrets
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

from stare_sandbox.errors import PoolExhausted, SandboxClosed, SandboxError, SandboxUnavailable
from stare_sandbox.result import ExecError, ExecResult

logger = logging.getLogger(__name__)

TOKEN_BYTES = 16
HEADER = struct.Struct("!I")
MAX_FRAME_BYTES = 256 * 2**20
"""Largest frame either side reads (a request's code, a result's output): past it the connection
is dropped."""
AUTH_TIMEOUT_S = 10.0
"""How long a host waits for a new connection's whole token: one deadline, however the bytes arrive."""
MAX_UNAUTHENTICATED = 32
"""Connections a host serves at once before their token is read; one more is closed at once, so that
connections that never send a token cannot take a thread each (leases connect once, right after their
token is issued, so a host has at most a few in this state)."""
KEEPALIVE = {"TCP_KEEPIDLE": 10, "TCP_KEEPINTVL": 5, "TCP_KEEPCNT": 3}
"""A peer whose machine vanished without closing the connection (no FIN, no RST) is noticed by
keepalive probes within about 25 s, even during a long call."""


def send_frame(sock: socket.socket, value: Any) -> None:
    import msgpack  # the [ray] extra: imported when a lease connects

    body = msgpack.packb(value, use_bin_type=True, unicode_errors="surrogatepass")
    sock.sendall(HEADER.pack(len(body)) + body)


def recv_frame(sock: socket.socket) -> Any:
    """The next frame's value. Raises ``ConnectionError`` when the peer closed the connection or
    sent a frame over ``MAX_FRAME_BYTES``, ``TimeoutError`` when the socket's timeout ran out."""
    (size,) = HEADER.unpack(_recv_exactly(sock, HEADER.size))
    if size > MAX_FRAME_BYTES:
        raise ConnectionError(f"a frame of {size} bytes, over the {MAX_FRAME_BYTES} allowed")
    import msgpack

    return msgpack.unpackb(_recv_exactly(sock, size), raw=False, unicode_errors="surrogatepass")


def _recv_exactly(sock: socket.socket, size: int, deadline: float | None = None) -> bytes:
    """``size`` bytes; with ``deadline`` (``time.monotonic``) all of them by then, or ``TimeoutError``."""
    buffer = bytearray(size)
    view, got = memoryview(buffer), 0
    while got < size:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{got} of {size} bytes by the deadline")
            sock.settimeout(left)
        n = sock.recv_into(view[got:])
        if not n:
            raise ConnectionError("the connection was closed by its other end")
        got += n
    return bytes(buffer)


def _listen(host: str, ports: range | None) -> socket.socket:
    if ports is None:
        return socket.create_server((host, 0))
    for port in ports:
        try:
            return socket.create_server((host, port))
        except OSError:
            continue
    raise OSError(
        f"no free port in sandbox.ray.lease_ports {ports.start}-{ports.stop - 1} on {host}: widen the "
        "range (one port per sandbox host on the node)"
    )


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # a request is one write: send it now
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in KEEPALIVE.items():
        if hasattr(socket, name):  # Linux; elsewhere the system's keepalive times hold
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


Handler = Callable[[str, list[Any]], tuple[Any, ...]]
"""``handle(lease_id, [method, *args])``: the answer frame of a request on that lease."""


class LeaseServer:
    """A host's listening socket: a thread accepts connections, and one thread per connection
    serves the requests of the lease its token names, one at a time, with ``handle``.

    Args:
        host: The address to listen on (the node's IP, which the cluster's other nodes reach).
        handle: Answers a request (see :data:`Handler`); it must not raise.
        ports: The ports to try, in order (the first free one is taken), or None for any.

    Raises:
        OSError: no port of ``ports`` is free (the message names the range and the fix).
    """

    def __init__(self, host: str, handle: Handler, ports: range | None = None) -> None:
        self._handle = handle
        self._listener = _listen(host, ports)
        self.address: tuple[str, int] = (host, self._listener.getsockname()[1])
        self._tokens: dict[bytes, str] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._unauthenticated = threading.BoundedSemaphore(MAX_UNAUTHENTICATED)
        threading.Thread(target=self._accept_loop, name="lease-accept", daemon=True).start()

    def admit(self, lease_id: str) -> bytes:
        """A new token for ``lease_id``: good for one connection."""
        token = secrets.token_bytes(TOKEN_BYTES)
        with self._lock:
            self._tokens[token] = lease_id
        return token

    def revoke(self, lease_id: str) -> None:
        """Forget ``lease_id``'s unused tokens (its lease ended before it connected)."""
        with self._lock:
            for token in [t for t, lease in self._tokens.items() if lease == lease_id]:
                del self._tokens[token]

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._listener.close()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                if self._closed:
                    return
                continue
            if not self._unauthenticated.acquire(blocking=False):
                logger.warning(
                    "lease server: %d connections without a token already; one more closed",
                    MAX_UNAUTHENTICATED,
                )
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn,), name="lease-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        authenticating = True
        with conn:
            try:
                _tune(conn)
                token = _recv_exactly(conn, TOKEN_BYTES, deadline=time.monotonic() + AUTH_TIMEOUT_S)
                with self._lock:
                    lease_id = self._tokens.pop(token, None)
                self._unauthenticated.release()
                authenticating = False
                if lease_id is None:
                    send_frame(conn, ("refused", "the host issued no such lease token, or it was used"))
                    return
                send_frame(conn, ("ok",))
                conn.settimeout(None)  # a lease waits between calls for as long as a model turn takes
                while not self._closed:
                    send_frame(conn, self._handle(lease_id, recv_frame(conn)))
            except (OSError, ValueError) as exc:  # the client left (or sent garbage): its lease stays
                logger.debug("lease connection ended: %s", exc)
            finally:
                if authenticating:
                    self._unauthenticated.release()


class LeaseConnection:
    """The client's end: a connection to a host, bound to one lease by its token.

    Raises (from the constructor):
        PermissionError: The host refused the token.
        OSError: The host could not be reached in ``timeout_s``.
    """

    def __init__(self, address: tuple[str, int], token: bytes, timeout_s: float) -> None:
        self._sock = socket.create_connection(address, timeout=timeout_s)
        try:
            _tune(self._sock)
            self._sock.sendall(token)
            answer = recv_frame(self._sock)
        except BaseException:
            self._sock.close()
            raise
        if answer[0] != "ok":
            self._sock.close()
            raise PermissionError(f"the sandbox host refused the lease's token: {answer[1]}")
        self._lock = threading.Lock()
        self.broken = False

    def call(self, request: list[Any], timeout_s: float) -> tuple[Any, ...]:
        """Send ``request`` and wait up to ``timeout_s`` for its answer frame.

        Raises:
            TimeoutError: No answer in time.
            OSError: The connection is lost (``ConnectionError``) or was broken before.
        A connection whose call did not end with its answer (a timeout, a lost connection, an
        interrupt) is closed and ``broken``: its requests and answers would no longer pair.
        """
        with self._lock:
            if self.broken:
                raise ConnectionError("this lease's connection was broken by an earlier call")
            try:
                self._sock.settimeout(timeout_s)
                send_frame(self._sock, request)
                return tuple(recv_frame(self._sock))
            except BaseException:
                self.close()
                raise

    def close(self) -> None:
        """Close the connection (a call waiting on it in another thread ends with ``OSError``)."""
        self.broken = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self._sock.close()


# ------------------------------------------------------------------- results and errors as plain values

_RESULT_FIELDS = tuple(f.name for f in dataclasses.fields(ExecResult))


def pack_result(result: ExecResult) -> tuple[Any, ...]:
    """``result`` as a tuple of plain values, the form a host sends it in (msgpack, on the lease's
    connection: ``stare_sandbox.ray_fleet.wire``)."""
    values = [getattr(result, name) for name in _RESULT_FIELDS]
    error = result.error
    values[_RESULT_FIELDS.index("error")] = (
        None if error is None else (error.type, error.message, error.traceback)
    )
    return tuple(values)


def unpack_result(values: tuple[Any, ...]) -> ExecResult:
    """The ``ExecResult`` that :func:`pack_result` packed."""
    fields = dict(zip(_RESULT_FIELDS, values, strict=True))
    if fields["error"] is not None:
        fields["error"] = ExecError(*fields["error"])
    return ExecResult(**fields)


_ERRORS: dict[str, type[SandboxError]] = {
    cls.__name__: cls for cls in (SandboxError, SandboxUnavailable, SandboxClosed, PoolExhausted)
}


def raised_answer(exc: SandboxError | OSError) -> tuple[str, str, str]:
    """The answer that carries a host's sandbox's failure: its nearest class in ``_ERRORS``, or
    ``OSError``, and its message."""
    name = next((c.__name__ for c in type(exc).__mro__ if c.__name__ in _ERRORS), "OSError")
    return ("raised", name, str(exc))


def raised_error(type_name: str, message: str) -> Exception:
    """The exception that :func:`raised_answer` sent, as a local pool would raise it."""
    return _ERRORS[type_name](message) if type_name in _ERRORS else OSError(message)
