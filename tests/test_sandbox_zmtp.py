"""``sandbox.zmtp.BoundedSubscriber`` against a real libzmq PUB socket: messages arrive whole,
messages over the bounds are dropped as they stream by and reported, and the host holds at most
one bounded message (the Docker-level test is in ``test_sandbox_protocol.py``)."""

from __future__ import annotations

import pytest
import zmq

from sandbox import zmtp
from sandbox.zmtp import BoundedSubscriber, DroppedMessage


@pytest.fixture
def pub(tmp_path):
    context = zmq.Context()
    socket = context.socket(zmq.PUB)
    socket.setsockopt(zmq.SNDHWM, 0)
    path = str(tmp_path / "iopub")
    socket.bind(f"ipc://{path}")
    yield socket, path
    context.destroy(linger=0)


def subscribed(socket, path: str, **bounds) -> BoundedSubscriber:
    """A subscriber that has received a first message (PUB drops what comes before that)."""
    sub = BoundedSubscriber(path, **{"max_message_bytes": 1000, "max_frames": 8, **bounds})
    for _ in range(200):
        socket.send_multipart([b"hello"])
        if sub.poll(10):
            break
    while sub.poll(10):
        assert sub.recv_multipart() == [b"hello"]
    return sub


def receive(sub: BoundedSubscriber) -> list[bytes] | str:
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
    sub = BoundedSubscriber(path, max_message_bytes=1000)  # nobody listens yet: retried at poll
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
