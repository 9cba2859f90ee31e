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


def test_a_token_dripped_a_byte_at_a_time_meets_one_deadline(server, monkeypatch) -> None:
    """The handshake's deadline is for the whole token: a peer sending a byte every 0.4 s (each read
    within a per-read timeout of 1 s) is cut off at 1 s, not held for the 16 bytes' 6.4 s."""
    from stare_sandbox.ray_fleet import wire

    monkeypatch.setattr(wire, "AUTH_TIMEOUT_S", 1.0)
    with socket.create_connection(server.address) as sock:
        started = time.monotonic()
        try:
            for _ in range(16):
                sock.sendall(b"x")
                time.sleep(0.4)
            closed_after = None
        except OSError:  # the host closed it while we were still dripping
            closed_after = time.monotonic() - started
        if closed_after is None:
            sock.settimeout(5)
            assert sock.recv(1) == b"", "the host kept the connection"
            closed_after = time.monotonic() - started
    assert closed_after < 3.0, closed_after


def test_connections_without_a_token_are_capped(server) -> None:
    """200 idle connections take at most MAX_UNAUTHENTICATED threads (each waits for its token); the rest
    are closed at once, and a lease with a real token still connects."""
    from stare_sandbox.ray_fleet.wire import MAX_UNAUTHENTICATED

    before = sum(t.name == "lease-conn" for t in threading.enumerate())
    idle = [socket.create_connection(server.address) for _ in range(200)]
    try:
        time.sleep(1.0)
        serving = sum(t.name == "lease-conn" for t in threading.enumerate()) - before
        assert serving <= MAX_UNAUTHENTICATED, serving
        closed = 0
        for sock in idle:
            sock.settimeout(0.05)
            try:
                closed += sock.recv(1) == b""
            except (TimeoutError, OSError):
                pass
        assert closed >= 200 - MAX_UNAUTHENTICATED, closed
    finally:
        for sock in idle:
            sock.close()
    time.sleep(0.5)  # the waiting ones see their peer gone and give their slot back
    connection = LeaseConnection(server.address, server.admit("lease-1"), timeout_s=10)
    try:
        assert connection.call(["ping", 1], timeout_s=10) == ("ok", [1])
    finally:
        connection.close()


def test_lease_servers_listen_on_the_configured_port_range() -> None:
    """``sandbox.ray.lease_ports``: a host takes the first free port of the range (a firewall that
    opens only fixed ports), and a range with none free is an error that names it."""
    from stare_sandbox.ray_fleet import RayFleetConfig

    with pytest.raises(ValueError, match="lease_ports must be 'FIRST-LAST'"):
        RayFleetConfig(lease_ports="20010-20000")
    with pytest.raises(ValueError, match="lease_ports"):
        RayFleetConfig(lease_ports="80-90")
    ports = RayFleetConfig(lease_ports="23200-23201").port_range()
    assert ports == range(23200, 23202)
    with socket.create_server(("127.0.0.1", 23200)):  # the first is taken
        first = LeaseServer("127.0.0.1", lambda lease, request: ("ok",), ports=ports)
        try:
            assert first.address == ("127.0.0.1", 23201)
            with pytest.raises(OSError, match="no free port in sandbox.ray.lease_ports 23200-23201"):
                LeaseServer("127.0.0.1", lambda lease, request: ("ok",), ports=ports)
        finally:
            first.close()
