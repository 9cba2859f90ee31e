"""A leased fleet sandbox's connection to its host (``stare_sandbox.ray_fleet.wire``), without Ray: the token
that binds a connection to its lease, the frames, and a call that gets no answer."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from tests.conftest import require_module

require_module("ray", "msgpack", "pip install 'stare-agent[ray]'")

from stare_sandbox.ray_fleet.wire import (  # noqa: E402
    HEADER,
    MAX_FRAME_BYTES,
    LeaseConnection,
    LeaseServer,
    recv_frame,
    send_frame,
)


@pytest.fixture
def server():
    seen: list[tuple[str, list]] = []
    release = threading.Event()

    def handle(lease_id: str, request: list) -> tuple:
        seen.append((lease_id, request))
        if request[0] == "slow":
            release.wait(10)
        if request[0] == "vanish":
            raise ConnectionResetError("the host went away")
        return ("ok", request[1:])

    server = LeaseServer("127.0.0.1", handle)
    server.seen = seen
    try:
        yield server
    finally:
        release.set()
        server.close()


def test_a_connection_serves_only_the_lease_its_token_names(server) -> None:
    token = server.admit("lease-1")
    other = server.admit("lease-2")
    with pytest.raises(PermissionError, match="refused the lease's token"):
        LeaseConnection(server.address, bytes([token[0] ^ 1]) + token[1:], 5.0)
    connection = LeaseConnection(server.address, token, 5.0)
    try:
        assert connection.call(["run", "x = 1", None], 5.0) == ("ok", ["x = 1", None])
        assert server.seen == [("lease-1", ["run", "x = 1", None])]
    finally:
        connection.close()
    with pytest.raises(PermissionError):  # a token is good for one connection
        LeaseConnection(server.address, token, 5.0)
    server.revoke("lease-2")  # its lease ended before it connected
    with pytest.raises(PermissionError):
        LeaseConnection(server.address, other, 5.0)


def test_a_call_without_an_answer_times_out_and_breaks_the_connection(server) -> None:
    connection = LeaseConnection(server.address, server.admit("lease"), 5.0)
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        connection.call(["slow"], 0.3)
    assert time.monotonic() - start < 2 and connection.broken
    with pytest.raises(ConnectionError, match="broken by an earlier call"):  # answers would not pair
        connection.call(["ping"], 5.0)


def test_a_host_that_goes_away_mid_call_is_a_connection_error(server) -> None:
    connection = LeaseConnection(server.address, server.admit("lease"), 5.0)
    with pytest.raises(ConnectionError, match="closed by its other end"):
        connection.call(["vanish"], 5.0)
    assert connection.broken


def test_frames_carry_any_text_and_refuse_a_size_over_the_bound() -> None:
    a, b = socket.socketpair()
    with a, b:
        send_frame(a, ["run", "print('\ud800 é')", 1.5, None])  # a lone surrogate, as kernels may send
        assert recv_frame(b) == ["run", "print('\ud800 é')", 1.5, None]
        a.sendall(HEADER.pack(MAX_FRAME_BYTES + 1))
        with pytest.raises(ConnectionError, match="over the"):
            recv_frame(b)
