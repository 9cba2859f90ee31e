"""Run once after each kernel start: the kernel's stdout and stderr (1) send at most ``chunk``
characters a message, (2) carry what is written to the file descriptors 1 and 2 (a child
process, ``os.write``, C code) in the output of the cell that wrote it, whole and in order with its
``print``, and (3) send at most ``limit`` characters from the start of one cell to the start of the
next, then, at the cell's end, a line saying how many were dropped and the last ``chunk`` of them (so
the host's cut still shows the output's real end).

(3) The kernel's output socket queues what the host has not read yet, and the host reads only while
a call runs: a writer that outlives its cell (a child process printing in a loop) filled it without
bound between calls, until the kernel hit its data limit or its container's memory and died.

(4) IPython 9 records every write of every cell in ``history_manager.outputs`` (for ``%history -o``):
a loop of prints filled the kernel's data limit within one call (a MemoryError at 0.6 s), and an
episode's output stayed in memory until the kernel restarted. The kernel keeps none of it.

(1) A big write is split, each piece flushed before the next, so that no message outgrows what the
host keeps (``stare_sandbox.kernel.MAX_MESSAGE_BYTES``).

(2) ipykernel points the descriptors at a pipe that a thread of its own reads into the streams
whenever it gets to run. Under load it ran after the cell's last flush, and what it read went out
with the next cell's output, or with none; and in ipykernel 6 a UTF-8 character split between two
of its 1000-byte reads killed that thread, after which the pipe filled and the next 64 KiB written
hung the cell. Here each descriptor gets a fresh pipe whose reader decodes incrementally, and the
cell itself empties the pipe, under the reader's lock, before each write and flush of its stream
(ipykernel flushes before each displayed value and before its reply) and at its end (an IPython
``post_run_cell`` callback), after flushing C stdio's buffers. The old pipe's write end is closed,
so ipykernel's thread reads end-of-file and stops. Output that a process still running writes after
the cell ended reaches whichever cell is running when it is read, as in any Jupyter kernel.

The methods go on a subclass of the stream (``__class__``), and ``write`` is a property: IPython 9
wraps ``write`` on the instance during each cell and, at its end, puts back what it found at the
start, which for the boot cell was ipykernel's own method. Code in the sandbox can undo all this;
then only its own output suffers.
"""

import _thread
import array
import codecs
import ctypes
import fcntl
import os
import select
import stat
import sys
import termios
import threading
from typing import Any

from IPython import get_ipython

READ_BYTES = 2**16
FIONREAD, ioctl = termios.FIONREAD, fcntl.ioctl


class Pump:
    """Moves the bytes of one pipe into one stream, decoded as UTF-8 (invalid bytes become U+FFFD;
    a character split between reads waits for its end)."""

    def __init__(self, read_end: int, write: Any) -> None:
        self.read_end, self.write = read_end, write
        self.lock = threading.RLock()  # a signal handler's print may come in mid-drain
        self.busy = False  # set, under the lock, from before a read until its text is written
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.count = array.array("i", [0])

    def drain(self) -> bool:
        """Write the bytes the pipe holds now (at most those: a writer that never stops must not
        keep a print from returning); False once the pipe is closed or gone."""
        with self.lock:
            self.busy = True
            try:
                held = array.array("i", [0])  # its own: writers' catch_up runs beside the reader
                ioctl(self.read_end, FIONREAD, held)
                left = max(held[0], 1)  # 1: a read that sees end-of-file or an error
                while left > 0:
                    try:
                        data = os.read(self.read_end, min(left, READ_BYTES))
                    except BlockingIOError:
                        return True
                    if not data:
                        return False
                    left -= len(data)
                    text = self.decoder.decode(data)
                    if text:
                        self.write(text)
                return True
            except OSError:
                return False
            finally:
                self.busy = False

    def catch_up(self) -> None:
        """``drain`` when the pipe holds bytes or the reader thread holds some it read: cheaper
        than a drain on every write (an ioctl, no lock, no exception)."""
        try:
            ioctl(self.read_end, FIONREAD, self.count)
        except OSError:
            return
        if self.count[0] or self.busy:
            self.drain()


class KeepNoOutputs(dict):  # type: ignore[type-arg]
    """IPython 9's ``history_manager.outputs`` that keeps nothing: every cell's record is a new list,
    appended to and forgotten."""

    def __contains__(self, key: object) -> bool:
        return False

    def __getitem__(self, key: Any) -> list[Any]:
        return []


def read_pipes(pumps: list[Pump]) -> None:
    """The reader thread (one for both pipes): drain a pipe whenever it has bytes, until each is
    closed or gone."""
    by_fd = {pump.read_end: pump for pump in pumps}
    poller = select.poll()
    for fd in by_fd:
        poller.register(fd, select.POLLIN)
    while by_fd:
        for fd, mask in poller.poll():
            if mask & select.POLLNVAL or not by_fd[fd].drain():
                poller.unregister(fd)
                del by_fd[fd]


def close_other_write_ends(fd: int) -> None:
    """Close this process's other write ends of the pipe ``fd`` is on (ipykernel's), so that its
    reader sees end-of-file."""
    pipe = os.fstat(fd)
    if not stat.S_ISFIFO(pipe.st_mode):
        return
    for other in [int(name) for name in os.listdir("/proc/self/fd")]:
        try:
            same = os.fstat(other)
            writes = fcntl.fcntl(other, fcntl.F_GETFL) & os.O_ACCMODE == os.O_WRONLY
        except OSError:
            continue
        if other > 2 and writes and (same.st_dev, same.st_ino) == (pipe.st_dev, pipe.st_ino):
            os.close(other)


class Budget:
    """(3) for one stream: at most ``limit`` characters a cell through ``send``, then only the last
    ``chunk`` of the rest, sent behind a line with the dropped count when the cell ends (or the next
    starts): held here, before anything is serialised. ``drain`` empties the pipe into it first."""

    def __init__(self, send: Any, limit: int, chunk: int, drain: Any) -> None:
        self.send, self.limit, self.chunk, self.drain = send, limit, chunk, drain
        self.left, self.dropped, self.tail = limit, 0, ""

    def write(self, text: Any) -> Any:
        if not isinstance(text, str):
            return self.send(text)
        if len(text) <= self.left:
            self.left -= len(text)
            return self.send(text)
        if self.left > 0:
            self.send(text[: self.left])
        rest = text[max(self.left, 0) :]
        self.left = 0
        self.dropped += len(rest)
        self.tail = (self.tail + rest)[-self.chunk :]
        return len(text)

    def release(self, info: Any = None) -> None:
        if self.left <= 0:
            self.drain()  # what the pipe holds now, into the tail first
        if self.dropped:
            note = f"\n[the kernel dropped {self.dropped - len(self.tail)} characters of this output]\n"
            self.send(note + self.tail)
            self.drain()
            self.dropped, self.tail = 0, ""

    def new_cell(self, info: Any = None) -> None:
        self.release()  # what a writer left between cells, in this one
        self.left = self.limit


def shape(stream: Any, fd: int, chunk: int, limit: int, libc: Any, forked: list[bool]) -> tuple[Pump, Any]:
    """Give ``stream`` the behaviour of the module docstring, reading ``fd`` until ``forked`` holds
    an item (in a forked child, which has the pipe's read end but not its reader): its pump, for the
    reader thread to run, and the callbacks of a cell's start and end for (3)."""
    close_other_write_ends(fd)
    read_end, write_end = os.pipe()
    os.dup2(write_end, fd)
    os.close(write_end)
    os.set_blocking(read_end, False)
    base, pending = type(stream), [0]

    def chunked(text: Any) -> Any:
        if not isinstance(text, str) or len(text) + pending[0] < chunk:
            pending[0] += len(text) if isinstance(text, str) else 0
            return base.write(stream, text)
        for start in range(0, len(text), chunk):
            base.write(stream, text[start : start + chunk])
            base.flush(stream)
        pending[0] = 0
        return len(text)

    budget = Budget(chunked, limit, chunk, lambda: None if forked else stream.flush())
    bounded = budget.write
    pump = Pump(read_end, bounded)

    def write(text: Any, catch_up: Any = pump.catch_up) -> Any:
        if not forked:
            catch_up()
        return bounded(text)

    class KernelStream(base):  # type: ignore[misc, valid-type]
        @property  # type: ignore[override]
        def write(self) -> Any:
            return self.__dict__.get("_wrapped_write", write)

        @write.setter
        def write(self, value: Any) -> None:
            # IPython 9 sets a wrapper of what it read, then puts back what it read: a method of
            # this stream (ipykernel's, on the boot cell), which means "no wrapper".
            if getattr(value, "__self__", None) is self or value is write:
                self.__dict__.pop("_wrapped_write", None)
            else:
                self.__dict__["_wrapped_write"] = value

        def flush(self) -> None:
            if not forked:
                libc.fflush(None)  # C stdio's buffers: a pipe makes them block-buffered
                pump.drain()
            base.flush(self)

        def fileno(self) -> int:  # subprocess's stdout=sys.stdout: the pipe, not /dev/null
            return fd

    stream.__dict__.pop("write", None)
    stream.__class__ = KernelStream
    return pump, (budget.new_cell, budget.release)


def capture_streams(chunk: int, limit: int) -> None:
    libc, forked = ctypes.CDLL(None), []
    os.register_at_fork(after_in_child=lambda: forked.append(True))
    streams = {"stdout": sys.stdout, "stderr": sys.stderr}
    shaped = [
        shape(stream, fd, chunk, limit, libc, forked)
        for fd, stream in zip((1, 2), streams.values(), strict=True)
    ]
    pumps = [pump for pump, _ in shaped]
    for _, (new_cell, release) in shaped:
        get_ipython().events.register("pre_run_cell", new_cell)
        get_ipython().events.register("post_run_cell", release)
    history = get_ipython().history_manager
    if isinstance(getattr(history, "outputs", None), dict):  # IPython 9's record of every write: (4)
        history.outputs = KeepNoOutputs()
    # Not threading.Thread: its start waits until the thread runs, a few ms of every reset under load.
    _thread.start_new_thread(read_pipes, (pumps,))

    def after_cell(result: Any = None) -> None:
        # ipykernel flushes sys.stdout and sys.stderr after the cell; these, where the cell left
        # others in their place.
        for name, stream in streams.items():
            if getattr(sys, name) is not stream:
                stream.flush()

    get_ipython().events.register("post_run_cell", after_cell)
