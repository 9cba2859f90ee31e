"""Connections to a kernel's channels that hold at most one bounded message in memory.

libzmq bounds each *frame* of a message (``MAXMSGSIZE``) and the number of *messages* queued
(``RCVHWM``), but not the number of frames in one message: it hands a multipart message over
only once its last frame has arrived, and holds every frame until then. Code in a sandbox can send
its iopub socket a message of millions of frames (zero-copy: it holds one), and a host reading
that channel with libzmq holds them all.

``BoundedSocket`` speaks ZMTP 3.0 (the wire protocol of zmq, NULL security) over the channel's
unix socket itself, as a SUB socket (the output channel, iopub) or a DEALER socket (the request
channel, shell, whose kernel side is a ROUTER), and reads it frame by frame: a message is kept only while
its frames add up to at most ``max_message_bytes`` and ``max_frames``; past that, its frames are
dropped as they arrive and the message is reported as dropped (``DroppedMessage``), also once
for every ``DROP_REPORT_BYTES`` or ``DROP_REPORT_FRAMES`` of a message that does not end, so a
reader that counts them can give up on the kernel. The host holds at most one message, one read
of ``READ_BYTES`` and a frame header, whatever the kernel sends.

It offers the part of a zmq socket's interface that ``stare_sandbox.kernel`` and jupyter-client's
``Session.send`` use: ``poll``, ``recv_multipart``, ``send_multipart`` (DEALER) and ``close``. When
the kernel goes away (a reset, a restart) the connection is made again at the next ``poll`` or
send, as zmq reconnects; a send that finds no connection within ``SEND_TIMEOUT_S`` raises
``zmq.Again``, as a zmq socket with ``SNDTIMEO`` does.
"""

from __future__ import annotations

import collections
import errno
import select
import socket
import struct
import time

import zmq

READ_BYTES = 2**18
"""Most bytes taken from the connection at once."""
DROP_REPORT_BYTES = 4 * 2**20
DROP_REPORT_FRAMES = 2**10
"""A message being dropped is reported once more each time this many bytes or frames of it went by: a
never-ending message of empty frames written by code in the sandbox reaches the driver's
``MAX_SKIPPED_MESSAGES`` after about 100,000 frames (well under a tenth of a host CPU second), not
millions."""
RECONNECT_S = 0.01
"""Pause before connecting again after the kernel closed the connection or refused it."""
SEND_TIMEOUT_S = 1.0
"""Most seconds a send waits for a connection, or for room to write, before ``zmq.Again``."""

GREETING = b"\xff" + bytes(8) + b"\x7f" + bytes([3, 0]) + b"NULL".ljust(20, b"\0") + b"\0" + bytes(31)
"""ZMTP 3.0 greeting: signature, version 3.0, the NULL mechanism, not the server."""
FLAG_MORE, FLAG_LONG, FLAG_COMMAND = 1, 2, 4


class NotSent(zmq.Again):
    """A send found no connection, or no room to write, in time (a ``zmq.Again`` with its cause)."""

    def __init__(self, message: str) -> None:
        super().__init__(errno.EAGAIN)
        self.strerror = message


class DroppedMessage(Exception):
    """A message over the bounds (or a stretch of one that does not end) went by unread."""


def _command(name: bytes, properties: dict[bytes, bytes]) -> bytes:
    body = bytes([len(name)]) + name
    for key, value in properties.items():
        body += bytes([len(key)]) + key + struct.pack(">I", len(value)) + value
    return bytes([FLAG_COMMAND, len(body)]) + body


SOCKET_TYPES = ("SUB", "DEALER")
HANDSHAKES = {kind: GREETING + _command(b"READY", {b"Socket-Type": kind.encode()}) for kind in SOCKET_TYPES}
"""What this side sends first: the greeting, and READY as a socket of its type."""
SUBSCRIBE_ALL = b"\x00\x01\x01"
"""A subscription to every topic, sent once the peer's READY came (before it, libzmq takes the
frame for a handshake command): a message frame ``\\x01`` + the empty topic, ZMTP 3.0's form."""


def encode_frames(frames: list[bytes]) -> bytes:
    """One message in ZMTP 3.0 framing: each frame's flags (more, long) and size, then its body.

    >>> encode_frames([b"ab", b""])
    b'\\x01\\x02ab\\x00\\x00'
    """
    out = bytearray()
    for i, frame in enumerate(frames):
        size = memoryview(frame).nbytes
        more = FLAG_MORE if i < len(frames) - 1 else 0
        if size > 255:
            out += bytes([more | FLAG_LONG]) + struct.pack(">Q", size)
        else:
            out += bytes([more, size])
        out += frame
    return bytes(out)


class BoundedSocket:
    """A SUB or DEALER connection to the ZMTP peer listening at unix socket ``path``.

    Args:
        path: The unix socket the kernel's PUB (iopub) or ROUTER (shell) socket serves on.
        socket_type: ``SUB`` (receives everything published) or ``DEALER`` (sends requests too).
        max_message_bytes: Largest message (all frames together) that is kept.
        max_frames: Most frames of a kept message.
    """

    def __init__(
        self, path: str, *, socket_type: str = "SUB", max_message_bytes: int, max_frames: int = 64
    ) -> None:
        if socket_type not in SOCKET_TYPES:
            raise ValueError(f"socket_type={socket_type!r}: use one of {', '.join(SOCKET_TYPES)}")
        self.path = path
        self.socket_type = socket_type
        self.max_message_bytes, self.max_frames = max_message_bytes, max_frames
        self.dropped = 0  # messages (and stretches of unending ones) dropped so far
        self._sock: socket.socket | None = None
        self._retry_at = 0.0
        self._ready: collections.deque[list[bytes] | None] = collections.deque()  # None: a drop
        self._closed = False
        self._connect()

    # -- the zmq-like interface ------------------------------------------------------------

    def poll(self, timeout_ms: int = 0) -> bool:
        """True when a message (or a drop report) is ready within ``timeout_ms``."""
        deadline = time.monotonic() + timeout_ms / 1000
        while not self._ready:
            if self._closed:
                return False
            remaining = deadline - time.monotonic()
            if self._sock is None:
                if time.monotonic() >= self._retry_at:
                    self._connect()
                if self._sock is None:
                    if remaining <= 0:
                        return False
                    time.sleep(min(remaining, max(0.0, self._retry_at - time.monotonic())))
                    continue
            assert self._sock is not None
            if not select.select([self._sock], [], [], max(0.0, remaining))[0]:
                return False
            self._read()
            if remaining <= 0 and not self._ready:
                return False
        return True

    def recv_multipart(self) -> list[bytes]:
        """The next message's frames (waiting for one).

        Raises:
            DroppedMessage: what came next was a message over the bounds (already discarded).
        """
        while not self.poll(1000):
            pass
        message = self._ready.popleft()
        if message is None:
            raise DroppedMessage(
                f"a message over {self.max_message_bytes} bytes or {self.max_frames} frames was dropped"
            )
        return message

    def send_multipart(self, frames: list[bytes], copy: bool = True, **_: object) -> None:
        """Send one message (DEALER), connecting first if needed.

        Raises:
            zmq.Again: no connection, or no room to write, within ``SEND_TIMEOUT_S`` (the connection is
                then dropped: a message sent in part would corrupt the stream).
        """
        if self.socket_type != "DEALER":
            raise TypeError(f"a {self.socket_type} socket does not send messages")
        data = memoryview(encode_frames(frames))
        deadline = time.monotonic() + SEND_TIMEOUT_S
        # Messages only after the peer's READY: before it, libzmq takes a frame for a handshake command.
        while self._sock is None or not self._peer_ready:
            remaining = deadline - time.monotonic()
            if self._closed or remaining <= 0:
                raise NotSent(f"no connection to {self.path} within {SEND_TIMEOUT_S:g} s")
            if self._sock is None:
                self._connect()
                if self._sock is None:
                    time.sleep(RECONNECT_S)
            elif select.select([self._sock], [], [], remaining)[0]:
                self._read()
        while data:
            try:
                data = data[self._sock.send(data) :]
            except BlockingIOError:
                pass
            except OSError as exc:
                self._disconnect()
                raise NotSent(f"the connection to {self.path} broke while sending: {exc}") from None
            if data:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self._disconnect()
                    raise NotSent(f"could not send to {self.path} within {SEND_TIMEOUT_S:g} s")
                select.select([], [self._sock], [], remaining)

    def close(self, linger: int | None = None) -> None:
        self._closed = True
        self._disconnect()
        self._ready.clear()

    @property
    def closed(self) -> bool:
        return self._closed

    # -- the connection ----------------------------------------------------------------------

    def _connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(self.path)
            sock.sendall(HANDSHAKES[self.socket_type])  # a few dozen bytes: always fits the socket's buffer
        except OSError:
            sock.close()
            self._retry_at = time.monotonic() + RECONNECT_S
            return
        sock.setblocking(False)
        self._sock = sock
        self._buffer = bytearray()
        self._greeted = self._peer_ready = False
        self._frames: list[bytes] = []
        self._kept = 0  # bytes of the message being kept
        self._dropping = False
        self._drop_bytes = self._drop_frames = 0
        self._skip = 0  # bytes of the current frame's body still to discard
        self._skip_more = False  # the frame being discarded has more after it

    def _disconnect(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
            self._retry_at = time.monotonic() + RECONNECT_S

    def _read(self) -> None:
        assert self._sock is not None
        try:
            data = self._sock.recv(READ_BYTES)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:  # the kernel went away: a message in flight is lost with it
            self._disconnect()
            return
        self._buffer += data
        self._parse()

    def _parse(self) -> None:
        buffer = self._buffer
        while True:
            if self._skip:
                n = min(self._skip, len(buffer))
                del buffer[:n]
                self._skip -= n
                self._note_dropped(n, 0)
                if self._skip:
                    return
                self._end_frame_dropped(self._skip_more)
                continue
            if not self._greeted:
                if len(buffer) < 64:
                    return
                if buffer[0] != 0xFF or buffer[9] != 0x7F or buffer[10] < 3:
                    self._protocol_error()
                    return
                del buffer[:64]
                self._greeted = True
                continue
            if len(buffer) < 2:
                return
            flags = buffer[0]
            head = 9 if flags & FLAG_LONG else 2
            if len(buffer) < head:
                return
            size = struct.unpack(">Q", buffer[1:9])[0] if flags & FLAG_LONG else buffer[1]
            more = bool(flags & FLAG_MORE)
            if flags & FLAG_COMMAND:  # READY (then we subscribe), PING, ...: nothing else needed
                if size > READ_BYTES:
                    self._protocol_error()
                    return
                if len(buffer) < head + size:
                    return
                del buffer[: head + size]
                if not self._peer_ready:  # its READY: the handshake is done
                    self._peer_ready = True
                    if self.socket_type != "SUB":
                        continue
                    try:
                        self._sock.send(SUBSCRIBE_ALL)  # type: ignore[union-attr]  # 3 bytes: fits
                    except OSError:
                        self._disconnect()
                        return
                continue
            keep = (
                not self._dropping
                and self._kept + size <= self.max_message_bytes
                and len(self._frames) < self.max_frames
            )
            if not keep:
                del buffer[:head]
                self._start_dropping()
                self._skip, self._skip_more = size, more
                if not size:
                    self._end_frame_dropped(more)
                continue
            if len(buffer) < head + size:
                return
            self._frames.append(bytes(buffer[head : head + size]))
            self._kept += size
            del buffer[: head + size]
            if not more:
                self._ready.append(self._frames)
                self._frames, self._kept = [], 0

    def _start_dropping(self) -> None:
        if not self._dropping:
            self._dropping = True
            self._note_dropped(self._kept, len(self._frames))
            self._frames, self._kept = [], 0

    def _note_dropped(self, n_bytes: int, n_frames: int) -> None:
        self._drop_bytes += n_bytes
        self._drop_frames += n_frames
        if self._drop_bytes >= DROP_REPORT_BYTES or self._drop_frames >= DROP_REPORT_FRAMES:
            self._report_drop()
            self._drop_bytes = self._drop_frames = 0

    def _end_frame_dropped(self, more: bool) -> None:
        self._note_dropped(0, 1)
        if not more:
            self._dropping = False
            self._drop_bytes = self._drop_frames = 0
            self._report_drop()

    def _report_drop(self) -> None:
        self.dropped += 1
        self._ready.append(None)

    def _protocol_error(self) -> None:
        """Not ZMTP 3: drop the connection (and report it), as zmq does with a bad peer."""
        self._report_drop()
        self._disconnect()
