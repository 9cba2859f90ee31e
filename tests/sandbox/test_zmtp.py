"""``stare_sandbox.zmtp.BoundedSocket`` against real libzmq PUB and ROUTER sockets: messages arrive whole,
messages over the bounds are dropped as they stream by and reported, the host holds at most one
bounded message, and a DEALER's requests reach the ROUTER (the Docker-level tests are in
``tests/sandbox/test_protocol.py``)."""

from __future__ import annotations

import pytest
import zmq

from stare_sandbox import zmtp
from stare_sandbox.zmtp import BoundedSocket, DroppedMessage


@pytest.fixture
def pub(tmp_path):
    context = zmq.Context()
    socket = context.socket(zmq.PUB)
    socket.setsockopt(zmq.SNDHWM, 0)
    path = str(tmp_path / "iopub")
    socket.bind(f"ipc://{path}")
    yield socket, path
    context.destroy(linger=0)


def subscribed(socket, path: str, **bounds) -> BoundedSocket:
    """A subscriber that has received a first message (PUB drops what comes before that)."""
    sub = BoundedSocket(path, **{"max_message_bytes": 1000, "max_frames": 8, **bounds})
    for _ in range(200):
        socket.send_multipart([b"hello"])
        if sub.poll(10):
            break
    while sub.poll(10):
        assert sub.recv_multipart() == [b"hello"]
    return sub


def receive(sub: BoundedSocket) -> list[bytes] | str:
    assert sub.poll(2000), "nothing arrived"
    try:
        return sub.recv_multipart()
    except DroppedMessage:
        return "dropped"


def test_messages_arrive_whole_and_oversized_ones_are_dropped_and_reported(pub) -> None:
    socket, path = pub
    sub = subscribed(socket, path)
    socket.send_multipart([b"topic", b"", b"x" * 300, b"y" * 2**8])  # a short and a long frame header
    socket.send_multipart([b"p"] * 9)  # one frame too many
    socket.send_multipart([b"big", b"z" * 2000])  # too many bytes
    socket.send_multipart([b"after"])
    assert receive(sub) == [b"topic", b"", b"x" * 300, b"y" * 2**8]
    assert receive(sub) == "dropped"
    assert receive(sub) == "dropped"
    assert receive(sub) == [b"after"]
    assert sub.dropped == 2
    sub.close()


def test_a_message_that_goes_on_is_reported_while_it_streams(pub, monkeypatch) -> None:
    socket, path = pub
    monkeypatch.setattr(zmtp, "DROP_REPORT_FRAMES", 100)
    sub = subscribed(socket, path)
    part = b"x" * 64
    for _ in range(450):  # never finished: libzmq would hold every frame
        socket.send(part, zmq.SNDMORE, copy=False)
    socket.send(b"end")  # libzmq sends a message's frames only once it is complete
    reports = [receive(sub) for _ in range(5)]
    assert reports == ["dropped"] * 5  # four stretches of 100 frames, then its end
    assert not sub.poll(50) and sub.dropped == 5
    assert len(sub._buffer) <= zmtp.READ_BYTES and sub._frames == []
    sub.close()


def test_it_connects_again_when_the_peer_comes_back(tmp_path) -> None:
    path = str(tmp_path / "iopub")
    sub = BoundedSocket(path, max_message_bytes=1000)  # nobody listens yet: retried at poll
    assert not sub.poll(20)
    for _ in range(2):  # a kernel, then the next one on the same path
        context = zmq.Context()
        socket = context.socket(zmq.PUB)
        socket.bind(f"ipc://{path}")
        for _ in range(300):
            socket.send_multipart([b"up"])
            if sub.poll(10):
                break
        assert sub.recv_multipart() == [b"up"]
        context.destroy(linger=0)
    sub.close()
    assert sub.closed and not sub.poll(0)


@pytest.fixture
def router(tmp_path):
    context = zmq.Context()
    socket = context.socket(zmq.ROUTER)
    path = str(tmp_path / "shell")
    socket.bind(f"ipc://{path}")
    yield socket, path
    context.destroy(linger=0)


def test_a_dealer_sends_requests_and_reads_replies_within_the_bounds(router, monkeypatch) -> None:
    socket, path = router
    monkeypatch.setattr(zmtp, "DROP_REPORT_FRAMES", 100)
    dealer = BoundedSocket(path, socket_type="DEALER", max_message_bytes=1000, max_frames=8)
    dealer.send_multipart([b"<IDS|MSG>", b"x" * 300, b""])  # a long and an empty frame
    assert socket.poll(2000)
    identity, *frames = socket.recv_multipart()
    assert frames == [b"<IDS|MSG>", b"x" * 300, b""]
    socket.send_multipart([identity, b"reply", b"y" * 256])
    assert receive(dealer) == [b"reply", b"y" * 256]
    socket.send(identity, zmq.SNDMORE)
    for _ in range(250):  # a reply of many parts: dropped as it streams, never held whole
        socket.send(b"z" * 64, zmq.SNDMORE, copy=False)
    socket.send(b"end")
    socket.send_multipart([identity, b"after"])
    assert [receive(dealer) for _ in range(3)] == ["dropped"] * 3  # two stretches of 100, then its end
    assert receive(dealer) == [b"after"]
    assert len(dealer._buffer) <= zmtp.READ_BYTES and dealer._frames == []
    dealer.close()


def test_a_dealer_without_a_peer_raises_again_and_connects_once_one_listens(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(zmtp, "SEND_TIMEOUT_S", 0.2)
    path = str(tmp_path / "shell")
    dealer = BoundedSocket(path, socket_type="DEALER", max_message_bytes=1000)
    with pytest.raises(zmq.Again, match="no connection"):
        dealer.send_multipart([b"lost"])
    context = zmq.Context()
    socket = context.socket(zmq.ROUTER)
    socket.bind(f"ipc://{path}")
    dealer.send_multipart([b"hi"])
    assert socket.poll(2000) and socket.recv_multipart()[1:] == [b"hi"]
    with pytest.raises(TypeError, match="SUB socket does not send"):
        BoundedSocket(path, max_message_bytes=10).send_multipart([b"x"])
    context.destroy(linger=0)
    dealer.close()
