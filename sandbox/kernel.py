"""Drive one Jupyter kernel with jupyter-client: run a cell under a deadline, collect what it
printed, and recover the kernel when the code hangs or kills it.

Both backends share this driver. A backend owns the kernel *process* (a container or a local
subprocess) and exposes it through the small ``KernelHost`` protocol (interrupt, restart, liveness);
the driver owns the *conversation* (messages, deadlines, output caps, usage accounting).

Timeout policy of ``KernelDriver.execute``:

1. At the deadline (wall clock, or CPU seconds used by the sandbox since the call began, whichever
   comes first) the kernel is interrupted (SIGINT): a Python-level loop raises
   ``KeyboardInterrupt``, the kernel goes idle and all state survives (``timed_out=True``).
2. If it is not idle after half of ``restart_grace_s`` (a C-level loop such as
   ``sum(range(10**12))``, or code that ignores SIGINT), the kernel is killed and relaunched
   (``timed_out=True, state_lost=True``). The relaunch is not waited for here; the next call does.
3. A kernel that dies on its own (``os._exit``, SIGKILL, the OOM killer) is noticed by polling
   ``KernelHost.is_alive`` while no message arrives, relaunched, and reported as a
   ``KernelDied`` error with ``state_lost=True``. One that the backend shows was ended from outside,
   not by its code (``KernelHost.killed_from_outside``: a container killed, stopped or removed)
   raises :class:`~stare_sandbox.errors.SandboxKilled` instead: an infrastructure failure, never
   the code's crash.

Nothing the kernel sends can make ``execute`` raise: every message is checked before it is used
(signature, framing, field types), and one that fails is skipped and counted
(``ExecResult.skipped_messages``); past ``MAX_SKIPPED_MESSAGES`` in one call the kernel is restarted.
Host memory per kernel stays bounded while reading: both channels the host reads, the output
channel (iopub) and the request channel (shell), are read frame by frame
(``stare_sandbox.zmtp.BoundedSocket``), keeping one message of at most ``MAX_MESSAGE_BYTES`` and dropping
bigger ones, or ones of too many frames, as they stream by (zmq would hold a message of any number
of frames whole, since its ``MAXMSGSIZE`` bounds each frame); and the kernel sends its output in
chunks that fit (``BOUNDED_OUTPUT``). If a dropped message took the kernel's "idle" with it, the call ends once the
execute reply has come and the output channel stays quiet.

The code a kernel runs for the host, outside the user namespace (its boot: ``KERNEL_BOOT``; the local
backend's soft reset: ``reset_code``), lives in ``sandbox/cells/``: real modules, linted and
type-checked, whose source is sent to the kernel as a housekeeping cell.

CPU seconds and peak memory are read on the host (``stare_sandbox.usage``: the container's cgroup, or
``/proc`` of the local kernel), never by asking the kernel, so an execution costs one request and
the messages it sends back.
"""

from __future__ import annotations

import dataclasses
import functools
import hmac
import logging
import re
import time
from collections.abc import Sequence
from importlib import resources
from typing import Any, Protocol, cast

import zmq
from jupyter_client.blocking.client import BlockingKernelClient
from jupyter_client.connect import KernelConnectionInfo
from jupyter_client.session import DELIM

from stare_sandbox.base import Sandbox
from stare_sandbox.config import KERNEL_OUTPUT_CHARS, RANDOM_SEED
from stare_sandbox.errors import SandboxClosed, SandboxError, SandboxKilled
from stare_sandbox.output import OutputBuffer
from stare_sandbox.result import ExecError, ExecResult
from stare_sandbox.zmtp import BoundedSocket, DroppedMessage

logger = logging.getLogger(__name__)

ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")
"""CSI escape sequences (colours, cursor moves) that IPython puts in tracebacks."""

KERNEL_ARGS = ("--HistoryManager.enabled=False", "--IPythonKernel._execute_sleep=0")
"""ipykernel options of every sandbox kernel: no sqlite history (the work dir is wiped on reset),
and no 0.5 ms sleep after each cell before the reply (ipykernel's guard for clients that stop
reading output at the reply; we read iopub until the kernel's "idle", which follows the output)."""

POLL_S = 0.2
"""How often the kernel's liveness is checked while it sends nothing."""

MAX_MESSAGE_BYTES = 4 * 2**20
"""Largest message (all frames) kept from a kernel; a bigger one is dropped as it streams by."""

OUTPUT_CHUNK_CHARS = 2**18
"""Most characters of output the kernel puts in one message (``BOUNDED_OUTPUT``): even at 6 bytes a
character in JSON (``\\u0000``), two chunks stay under ``MAX_MESSAGE_BYTES``."""


MAX_SKIPPED_MESSAGES = 100
"""Malformed messages tolerated in one call; past it the kernel is restarted."""

MAX_SHELL_BACKLOG = 64
"""Most messages read from the request channel (shell) at once. Only replies come there, one per
request, so a longer backlog is traffic the kernel was not asked for (code writing into its own end of
the connection): a protocol error that restarts the kernel, never a loop that waits for it to stop."""

SHELL_FLOODED = (
    "the kernel sent messages nobody asked for on its request channel (code writing into its own "
    "connection); it was restarted and all state is lost"
)

KERNEL_STOPPED = "the kernel stopped answering; it was restarted and all state is lost"


class UsageMeter(Protocol):
    """Host-side readings of a kernel's resource use (``stare_sandbox.usage``); None when unknown."""

    def cpu_seconds(self) -> float | None:
        """CPU seconds used so far (a counter; only differences are meaningful)."""

    def peak_bytes(self) -> int | None:
        """Peak memory since the last successful ``reset_peak`` (else since the kernel started)."""

    def reset_peak(self) -> bool:
        """Restart the peak from the current usage; False when that is not possible here."""


class KernelHost(Protocol):
    """The process side of a kernel, implemented by each backend."""

    def meter(self) -> UsageMeter | None:
        """Resource readings of the current kernel process, or None when they are unavailable."""

    def interrupt(self) -> None:
        """Send SIGINT to the kernel process."""

    def restart(self) -> None:
        """Kill the kernel (and everything it started) and launch a fresh one with the same
        connection file. Returns without waiting for the new kernel to answer."""

    def ready(self) -> None:
        """Called when a (re)started kernel has answered, before any code runs in it."""

    def is_alive(self) -> bool:
        """True while the kernel process runs."""

    def death_cause(self) -> str:
        """One line on why the kernel process ended (exit code, signal, out of memory)."""

    def killed_from_outside(self) -> bool:
        """True only when the kernel's end is known to come from outside the sandbox, so that the
        code it ran cannot have caused it (False whenever that is not certain)."""


class KernelDriver:
    """Executes cells on one kernel reached through a connection file's info.

    Args:
        connection_info: The kernel's connection info as seen from this process (for the ipc
            transport, ``ip`` is the host path prefix of the socket files).
        host: The backend's handle on the kernel process.
        max_output_chars: Cap on stdout and on stderr of one call.
        restart_grace_s: Time after a deadline to interrupt, then restart, the kernel.
        warm_tracebacks: Run ``WARM_TRACEBACKS`` in each new kernel (False when the process that
            starts kernels has warmed the traceback machinery for them, as the Docker warden does).
        boot_in_kernel: The kernel ran ``KERNEL_BOOT`` itself before serving (the Docker warden
            does), so it is not sent as a first request.
        preload: Modules each new kernel imports before ``KERNEL_BOOT`` (``SandboxConfig.preload``),
            when the driver sends the boot; where the kernel boots itself, its starter imports them.
    """

    def __init__(
        self,
        connection_info: dict[str, Any],
        host: KernelHost,
        *,
        max_output_chars: int,
        restart_grace_s: float,
        warm_tracebacks: bool = True,
        boot_in_kernel: bool = False,
        preload: Sequence[str] = (),
    ) -> None:
        self.host = host
        self.boot_in_kernel = boot_in_kernel
        self.preload = tuple(preload)
        self.max_output_chars = max_output_chars
        self.restart_grace_s = restart_grace_s
        self.warm_tracebacks = warm_tracebacks
        self._context = zmq.Context()  # jupyter-client's; no zmq socket of it reaches the kernel
        self.client = BlockingKernelClient(context=self._context)
        self.client.load_connection_info(cast(KernelConnectionInfo, connection_info))
        # Both channels read frame by frame (stare_sandbox.zmtp): zmq would hold a message of any number
        # of frames whole. jupyter-client sends its requests on the shell socket we give it.
        self._shell_path = f"{connection_info['ip']}-{connection_info['shell_port']}"
        self._iopub_path = f"{connection_info['ip']}-{connection_info['iopub_port']}"
        self.client.connect_shell = self._connect_shell  # type: ignore[method-assign,assignment]
        self.client.start_channels(shell=True, iopub=False, stdin=False, hb=False, control=False)
        # The channels themselves, not BlockingKernelClient.get_*_msg: those run each read through
        # an asyncio loop (jupyter_core.run_sync), about 0.1 ms a message.
        self._iopub = _Channel(self._connect_iopub(), self.client.session)
        self._shell = self.client.shell_channel
        self.ready = False
        self._renew = False  # True when the sockets may be dead: the next wait renews them
        self.killed: str | None = None
        """Why the sandbox was ended from outside (``SandboxKilled``'s message), until a new kernel."""
        self._warned_no_cpu = False

    # -- lifecycle ---------------------------------------------------------------------------

    def wait_ready(self, timeout: float) -> None:
        """Block until the kernel answers on shell *and* its iopub stream reaches us.

        ``iopub`` is PUB/SUB: output published before our subscription is connected is lost, so
        readiness means an iopub status message for one of our requests arrived.

        Raises:
            SandboxError: the kernel died or did not answer within ``timeout``.
        """
        deadline = time.monotonic() + timeout
        self._connect(deadline, timeout, renew=self._renew)
        self.host.ready()
        self.ready = True
        if self.warm_tracebacks:
            self.run_quiet(WARM_TRACEBACKS, max(1.0, deadline - time.monotonic()))
        if not self.boot_in_kernel:
            if self.preload and not self.run_quiet(
                preload_code(self.preload), max(10.0, deadline - time.monotonic())
            ):
                raise SandboxError(
                    f"the kernel could not import stare_sandbox.preload {list(self.preload)} (missing from its "
                    "Python?): install them there, or list fewer in sandbox.limits.preload"
                )
            error = self._run_quiet(KERNEL_BOOT, max(1.0, deadline - time.monotonic()))
            if error is not None:  # serving without it would be unbounded, unseeded, output misplaced
                raise SandboxError(
                    f"the kernel's boot code failed ({error}): the kernel's IPython or ipykernel is one "
                    "this sandbox does not support; run `stare-agent sandbox doctor`"
                )

    def _connect(self, deadline: float, timeout: float, *, renew: bool) -> None:
        """Wait until the kernel answers on shell and its iopub reaches us; with ``renew``, on
        fresh shell and iopub sockets first.

        Fresh sockets, because zmq gives up a connection for good (no reconnect) once the peer
        broke the protocol, e.g. sent a frame over ``MAX_MESSAGE_BYTES``.
        """
        resend_s = 0.05  # doubled up to 0.5 s: a kernel that just started answers within ms
        while True:
            if renew:
                self._renew = True  # until fresh sockets reached the kernel
                for channel, connect in (
                    (self._shell, self._connect_shell),
                    (self._iopub, self._connect_iopub),
                ):
                    if channel.socket is not None:
                        channel.socket.close(linger=0)
                    channel.socket = connect()
                renew = False
            try:
                msg_id = self.client.kernel_info()
            except zmq.Again:  # no connection: the kernel is not up yet, or gone
                if not self.host.is_alive():
                    raise SandboxError(
                        f"the kernel exited while starting ({self.host.death_cause()}): "
                        "run `stare-agent sandbox doctor`"
                    ) from None
                if time.monotonic() > deadline:
                    raise SandboxError(
                        f"could not send to the kernel within {timeout:g} s: run `stare-agent sandbox doctor`"
                    ) from None
                renew = True
                continue
            resend, resend_s = time.monotonic() + resend_s, min(0.5, 2 * resend_s)
            while time.monotonic() < resend:
                try:
                    msg = self._receive(self._iopub, POLL_S / 2)
                except MalformedMessage:
                    continue
                if msg is None:
                    if not self.host.is_alive():
                        raise SandboxError(
                            f"the kernel exited while starting ({self.host.death_cause()}): "
                            "run `stare-agent sandbox doctor`"
                        ) from None
                    continue
                if msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "status":
                    self._drain_shell()
                    self._renew = False
                    return
            if time.monotonic() > deadline:
                raise SandboxError(
                    f"the kernel did not answer within {timeout:g} s: the machine may be overloaded; "
                    "start fewer sandboxes at once (sandbox.pool_size) or run `stare-agent sandbox doctor`"
                )

    def _reconnect_or_restart(self, timeout: float) -> bool:
        """Fresh sockets to the kernel; if it does not answer on them, a fresh kernel (the next
        call waits for it). True when the kernel was restarted (its state is lost).

        Raises:
            SandboxKilled: the kernel is dead, ended from outside (see ``_died``).
        """
        try:
            self._connect(time.monotonic() + timeout, timeout, renew=True)
        except (SandboxError, zmq.ZMQError):
            if not self.host.is_alive():
                self._died()
            self.restart()
            return True
        return False

    def _died(self) -> str:
        """Why the dead kernel ended, for its ``KernelDied`` result.

        Raises:
            SandboxKilled: it was ended from outside, not by its code (``KernelHost.killed_from_outside``):
                the sandbox is left as it is, every later call raises the same until a reset brings
                up a new kernel (a pool or an env replaces it), and the failure counts as the
                infrastructure's.
        """
        cause = self.host.death_cause()
        if self.host.killed_from_outside():
            self.expect_new_kernel()
            self.killed = (
                f"the sandbox was ended from outside while code ran ({cause}), not by that code: its "
                "container was killed, stopped or removed (`docker kill`/`stop`/`rm`, a Docker daemon "
                "restart, the node's OOM killer); this sandbox is broken, replace it (a pool does), and if "
                "it recurs check the node's memory and the Docker daemon's log"
            )
            raise SandboxKilled(self.killed)
        return cause

    def _connect_iopub(self) -> BoundedSocket:
        return BoundedSocket(self._iopub_path, socket_type="SUB", max_message_bytes=MAX_MESSAGE_BYTES)

    def _connect_shell(self, **_: Any) -> BoundedSocket:
        return BoundedSocket(self._shell_path, socket_type="DEALER", max_message_bytes=MAX_MESSAGE_BYTES)

    def close(self) -> None:
        self._iopub.socket.close()
        self._shell.close()
        self._context.destroy(linger=0)

    def restart(self) -> None:
        """Kill and relaunch the kernel; the next ``execute`` waits for it, on fresh sockets (the
        old ones may be what made the kernel look unresponsive).

        Raises:
            SandboxError: the backend could not relaunch it (e.g. its container was removed): the
                sandbox is broken, an infrastructure failure, never a raw error of the backend's API.
        """
        self.expect_new_kernel()
        try:
            self.host.restart()
        except SandboxError:
            raise
        except Exception as exc:  # noqa: BLE001 - the Docker SDK's and the OS's errors alike
            raise SandboxError(
                f"the kernel could not be relaunched ({type(exc).__name__}: {str(exc)[:300]}): this sandbox "
                "is broken; replace it (a pool does)"
            ) from exc

    def expect_new_kernel(self) -> None:
        """The backend replaced the kernel process: the next call waits for the new one, on fresh
        sockets (connected at once, rather than after zmq's reconnect interval)."""
        self.ready = False
        self._renew = True
        self.killed = None

    # -- execution ---------------------------------------------------------------------------

    def execute(
        self, code: str, timeout: float, *, cpu_timeout: float | None = None, start_timeout: float = 60.0
    ) -> ExecResult:
        """Run ``code`` as one cell under ``timeout`` wall seconds and, when given, ``cpu_timeout``
        CPU seconds (read on the host between messages, at least every ``POLL_S``); never raises for
        anything the code does.

        Raises:
            SandboxKilled: the sandbox was ended from outside while the code ran (see ``_died``).
            SandboxError: a relaunched kernel does not come up within ``start_timeout``.
        """
        if self.killed is not None:
            raise SandboxKilled(self.killed)
        if not self.ready:
            self.wait_ready(start_timeout)
        if not self._discard_shell_replies():
            self.restart()
            return ExecResult(error=ExecError("KernelProtocolError", SHELL_FLOODED), state_lost=True)
        meter = self.host.meter()
        cpu_before = self._start_metering(meter, cpu_timeout)
        started = time.monotonic()
        msg_id = self._send(encodable(code), timeout)
        if msg_id is None:
            return ExecResult(error=ExecError("KernelDied", KERNEL_STOPPED), state_lost=True)
        chars = self.max_output_chars
        call = _Call(msg_id, OutputBuffer(chars), OutputBuffer(chars), limit=f"{timeout:g} s")
        self._collect(call, _Limits(started + timeout, cpu_timeout, cpu_before, meter))
        if call.idle_lost and not call.state_lost and self._reconnect_or_restart(min(timeout, 10.0)):
            # The iopub connection may be gone for good: renewed, or the kernel restarted.
            call.state_lost = True
            call.error = ExecError("KernelDied", KERNEL_STOPPED)
        return self._result(call, time.monotonic() - started, meter, cpu_before)

    def _start_metering(self, meter: UsageMeter | None, cpu_timeout: float | None) -> float | None:
        """Restart the peak and read the CPU counter before a call (None when unreadable); warn
        once when ``cpu_timeout`` cannot be enforced here."""
        cpu_before = None
        if meter is not None:
            meter.reset_peak()
            cpu_before = meter.cpu_seconds()
        if cpu_timeout is not None and cpu_before is None and not self._warned_no_cpu:
            self._warned_no_cpu = True
            logger.warning(
                "sandbox.cpu_timeout_s=%g is set but this sandbox's CPU time cannot be read on this host "
                "(remote Docker daemon or no cgroupfs/procfs): only the wall-clock timeout_s applies",
                cpu_timeout,
            )
        return cpu_before

    def _send(self, code: str, timeout: float) -> str | None:
        """Send ``code`` as an execute request: its msg_id, or None when the kernel stopped
        answering and was restarted (no connection to send on: see ``_connect``)."""
        try:
            return self._request(code)
        except zmq.Again:
            if self._reconnect_or_restart(min(timeout, 10.0)):
                return None
            return self._request(code)

    def _request(self, code: str) -> str:
        # stop_on_error=False: after an error ipykernel otherwise aborts every request that reaches
        # it before its event loop turns once more, which a fast next call does.
        return self.client.execute(
            code, silent=False, store_history=True, allow_stdin=False, stop_on_error=False
        )

    def _collect(self, call: _Call, limits: _Limits) -> None:
        """Read the call's messages from iopub until the kernel's "idle", or until a limit, the
        kernel's death, a lost "idle" or a flood of malformed messages ends the call."""
        while True:
            now = time.monotonic()
            if self._enforce_limits(call, limits, now):
                return
            try:
                msg = self._receive(self._iopub, limits.wait_s(call.timed_out, now))
            except MalformedMessage:
                msg = None
                call.skipped += 1
            if msg is None:
                if self._quiet(call):
                    return
            elif self._take(call, msg):
                return

    def _enforce_limits(self, call: _Call, limits: _Limits, now: float) -> bool:
        """Steps 1 and 2 of the timeout policy (module docstring): interrupt the kernel at the
        first limit reached, restart it half of ``restart_grace_s`` later. True when restarted."""
        if not call.timed_out and limits.cpu_spent():
            call.timed_out, call.limit = True, f"{limits.cpu_timeout:g} s of CPU time"
        if not call.timed_out and now >= limits.deadline:
            call.timed_out = True
        if call.timed_out and limits.give_up == float("inf"):
            self.host.interrupt()
            limits.give_up = now + self.restart_grace_s / 2
        if call.timed_out and now >= limits.give_up:
            self.restart()
            call.state_lost = True
            return True
        return False

    def _quiet(self, call: _Call) -> bool:
        """A poll that brought no usable message. True when it ends the call: too many malformed
        messages or a dead kernel (each restarts it), or an "idle" that never came after the reply."""
        if call.skipped > MAX_SKIPPED_MESSAGES:
            self.restart()
            call.state_lost = True
            call.error = ExecError(
                "KernelProtocolError",
                f"the kernel sent more than {MAX_SKIPPED_MESSAGES} malformed messages; "
                "it was restarted and all state is lost",
            )
            return True
        if call.skipped:
            return False  # a malformed message is not a quiet poll
        if not self.host.is_alive():
            cause = self._died()
            self.restart()
            call.state_lost = True
            call.error = ExecError(
                "KernelDied", f"the Python process died ({cause}); it was restarted and all state is lost"
            )
            return True
        if call.replied:  # replied, then a whole quiet poll: the "idle" was dropped
            call.skipped += 1
            call.idle_lost = True
            return True
        call.replied = self._replied(call)
        return False

    def _take(self, call: _Call, msg: dict[str, Any]) -> bool:
        """Add one iopub message to the call's output or error. True for the kernel's "idle"."""
        if msg["parent_header"].get("msg_id") != call.msg_id:
            return False
        kind, content = msg["msg_type"], msg["content"]
        if not _well_formed(kind, content):
            call.skipped += 1
            return False
        if kind == "stream":
            (call.stderr if content.get("name") == "stderr" else call.stdout).write_stream(
                content.get("text", "")
            )
        elif kind in ("execute_result", "display_data"):
            text = content.get("data", {}).get("text/plain")
            if text is not None:
                if call.stdout.total and not call.stdout.text()[0].endswith("\n"):
                    call.stdout.write("\n")
                call.stdout.write(text + "\n")
        elif kind == "error":
            call.error = self._error(content)
        elif kind == "status" and content.get("execution_state") == "idle":
            return True
        return False

    def _result(
        self, call: _Call, duration: float, meter: UsageMeter | None, cpu_before: float | None
    ) -> ExecResult:
        """The call's ``ExecResult``: its usage read on the host (unless the kernel was replaced),
        the timeout as its error, and a note on stderr of the messages skipped."""
        cpu_s, peak = 0.0, None
        if meter is not None and not call.state_lost:
            cpu_after = meter.cpu_seconds()
            if cpu_before is not None and cpu_after is not None:
                cpu_s = max(0.0, cpu_after - cpu_before)
            peak = meter.peak_bytes()
        error = call.error
        if call.timed_out:
            kept = "all state is lost" if call.state_lost else "variables are kept"
            how = "the kernel was restarted" if call.state_lost else "it was interrupted"
            error = ExecError("TimeoutError", f"the code timed out after {call.limit}; {how} and {kept}")
        if call.skipped:
            call.stderr.write(
                f"\n[{call.skipped} message(s) from the kernel were malformed or over "
                f"{MAX_MESSAGE_BYTES // 2**20} MiB and were skipped; output may be missing]\n"
            )
        out, out_cut = call.stdout.text()
        err, err_cut = call.stderr.text()
        return ExecResult(
            stdout=encodable(out),
            stderr=encodable(err),
            error=error,
            timed_out=call.timed_out,
            state_lost=call.state_lost,
            duration_s=duration,
            cpu_s=cpu_s,
            peak_memory_bytes=peak,
            truncated=out_cut or err_cut,
            skipped_messages=call.skipped,
        )

    def run_quiet(self, code: str, timeout: float) -> bool:
        """Run housekeeping code without history or output; True when it finished without error."""
        return self._run_quiet(code, timeout) is None

    def _run_quiet(self, code: str, timeout: float) -> str | None:
        """``run_quiet``'s work: None when the code finished without error, else what went wrong
        (``ename: evalue``, or that no reply came in time)."""
        if not self.ready:
            self.wait_ready(60.0)
        msg_id = self.client.execute(code, silent=True, store_history=False, allow_stdin=False)
        reply = self._shell_reply(msg_id, time.monotonic() + timeout)
        if reply is None:
            return f"no reply within {timeout:.3g} s"
        content = reply["content"]
        if content.get("status") == "ok":
            return None
        return f"{content.get('ename', 'Error')}: {content.get('evalue', '')}"[:500]

    # -- helpers -----------------------------------------------------------------------------

    def _error(self, content: dict[str, Any]) -> ExecError:
        traceback = ANSI_ESCAPE.sub("", "\n".join(content.get("traceback", [])))
        buf = OutputBuffer(self.max_output_chars)
        buf.write(traceback)
        name, message = OutputBuffer(200), OutputBuffer(self.max_output_chars)
        name.write(content.get("ename", "Error"))
        message.write(content.get("evalue", ""))
        return ExecError(encodable(name.text()[0]), encodable(message.text()[0]), encodable(buf.text()[0]))

    def _receive(self, channel: Any, timeout: float) -> dict[str, Any] | None:
        """The next message on ``channel`` within ``timeout`` seconds, or None when none came.

        Raises:
            MalformedMessage: what came is not a signed, well-framed message with a dict parent
                header, a str type and a dict content.
        """
        socket = channel.socket
        if socket is None or not socket.poll(int(timeout * 1000)):
            return None
        try:
            frames = socket.recv_multipart()
        except DroppedMessage as exc:
            raise MalformedMessage(str(exc)) from None
        try:
            return _unpack(channel.session, frames)
        except MalformedMessage:
            raise
        except Exception as exc:  # noqa: BLE001 - whatever the kernel sent, it is only skipped
            raise MalformedMessage(f"{exc.__class__.__name__}: {str(exc)[:200]}") from None

    def _replied(self, call: _Call) -> bool:
        """True when the execute reply to the call is among the shell messages received so far; reads
        at most ``MAX_SHELL_BACKLOG`` of them, malformed ones counted as the call's skipped messages
        (a flood reaches ``MAX_SKIPPED_MESSAGES``, which restarts the kernel)."""
        found = False
        for _ in range(MAX_SHELL_BACKLOG):
            try:
                msg = self._receive(self._shell, 0)
            except MalformedMessage:
                call.skipped += 1
                continue
            if msg is None:
                return found
            found = found or msg["parent_header"].get("msg_id") == call.msg_id
        call.skipped = max(call.skipped, MAX_SKIPPED_MESSAGES + 1)  # more than replies: a flood
        return found

    def _shell_reply(self, msg_id: str, deadline: float) -> dict[str, Any] | None:
        """The reply to ``msg_id`` by ``deadline``, or None (also when more than ``MAX_SHELL_BACKLOG``
        other messages come first)."""
        for _ in range(MAX_SHELL_BACKLOG):
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            try:
                msg = self._receive(self._shell, left)
            except MalformedMessage:
                continue
            if msg is None:
                return None
            if msg["parent_header"].get("msg_id") == msg_id:
                return msg
        return None

    def _drain_shell(self) -> None:
        """Drop the replies that already arrived, without waiting for late ones: every later
        read matches its own reply by msg_id (``_shell_reply``) or drops stale ones first.

        Raises:
            SandboxError: more than ``MAX_SHELL_BACKLOG`` messages wait (a flood, see there).
        """
        if not self._discard_shell_replies():
            raise SandboxError(SHELL_FLOODED)

    def _discard_shell_replies(self) -> bool:
        """Drop replies already received, unread: ``execute`` takes everything from iopub and does not
        wait for its reply, so the replies pile up here (one per call). False when more than
        ``MAX_SHELL_BACKLOG`` messages were waiting: a flood (see there), left for a restart."""
        socket = self._shell.socket
        for _ in range(MAX_SHELL_BACKLOG):
            if socket is None or not socket.poll(0):
                return True
            try:
                socket.recv_multipart()
            except DroppedMessage:
                continue
        return socket is None or not socket.poll(0)


@dataclasses.dataclass
class _Call:
    """What one ``execute`` gathers from the kernel's messages."""

    msg_id: str
    stdout: OutputBuffer
    stderr: OutputBuffer
    limit: str
    """The limit that a timeout reached, as its error message names it."""
    error: ExecError | None = None
    timed_out: bool = False
    state_lost: bool = False
    replied: bool = False
    """The execute reply has come (on shell): the "idle" on iopub follows or was dropped."""
    idle_lost: bool = False
    skipped: int = 0


@dataclasses.dataclass
class _Limits:
    """The deadlines of one ``execute``: wall clock, CPU seconds, and when to give up on an interrupt."""

    deadline: float
    cpu_timeout: float | None
    cpu_before: float | None
    meter: UsageMeter | None
    give_up: float = float("inf")
    """Set at the interrupt: the time to restart a kernel that has not gone idle."""
    wait: float = POLL_S
    """Longest wait for a message before the next check of the limits."""

    def cpu_spent(self) -> bool:
        """True when the call used up its CPU seconds; else the next check is due soon after the
        budget could be spent (at most one core a second)."""
        if self.cpu_timeout is None or self.cpu_before is None or self.meter is None:
            return False
        used = self.meter.cpu_seconds()
        if used is None:
            return False
        if used - self.cpu_before >= self.cpu_timeout:
            self.wait = POLL_S
            return True
        self.wait = min(POLL_S, max(0.01, self.cpu_timeout - (used - self.cpu_before)))
        return False

    def wait_s(self, timed_out: bool, now: float) -> float:
        """How long the next read may wait: until the next check, the deadline, or the give-up."""
        return max(0.0, min(self.wait, (self.give_up if timed_out else self.deadline) - now))


class _Channel:
    """A channel as ``_receive`` reads it: a socket and the session that checks its messages."""

    def __init__(self, socket: Any, session: Any) -> None:
        self.socket, self.session = socket, session


class MalformedMessage(Exception):
    """A message from the kernel that cannot be used (skipped and counted, never raised to callers)."""


def _unpack(session: Any, frames: list[bytes]) -> dict[str, Any]:
    """A kernel's message from its frames: signature checked, JSON parts parsed.

    What ``Session.deserialize`` does, less what the driver does not need and costs a third of
    its CPU per call: parsing every date of the headers (kept as strings here) and the replay
    check of signatures (the kernel holds the key: it can sign anything it wants to send).

    Raises:
        MalformedMessage: no delimiter, too few parts, a bad signature, or fields of wrong types.
    """
    try:
        frames = frames[frames.index(DELIM) + 1 :]
    except ValueError:
        raise MalformedMessage("no delimiter") from None
    if len(frames) < 5:
        raise MalformedMessage("too few parts")
    if session.auth is not None and not hmac.compare_digest(frames[0], session.sign(frames[1:5])):
        raise MalformedMessage("invalid signature")
    header, parent, metadata, content = (session.unpack(frame) for frame in frames[1:5])
    if not (
        isinstance(header, dict)
        and isinstance(header.get("msg_type"), str)
        and isinstance(parent, dict)
        and isinstance(content, dict)
    ):
        raise MalformedMessage("wrong field types")
    return {
        "header": header,
        "msg_id": header.get("msg_id"),
        "msg_type": header["msg_type"],
        "parent_header": parent,
        "metadata": metadata,
        "content": content,
    }


def encodable(text: str) -> str:
    """``text`` with each lone surrogate (from a JSON escape such as ``\\ud800``; not encodable as
    UTF-8) replaced by U+FFFD, and surrogate pairs joined into their character.

    >>> encodable("a\\ud800b") == "a\\ufffdb"
    True
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    return text


def _well_formed(kind: str, content: dict[str, Any]) -> bool:
    """True when the fields the driver reads from a message of type ``kind`` have their types."""
    if kind == "stream":
        return isinstance(content.get("text", ""), str) and isinstance(content.get("name", ""), str)
    if kind in ("execute_result", "display_data"):
        data = content.get("data", {})
        return isinstance(data, dict) and isinstance(data.get("text/plain", ""), str)
    if kind == "error":
        traceback = content.get("traceback", [])
        return (
            isinstance(content.get("ename", ""), str)
            and isinstance(content.get("evalue", ""), str)
            and isinstance(traceback, list)
            and all(isinstance(line, str) for line in traceback)
        )
    return True


@functools.cache
def _cell_source(module: str) -> str:
    return resources.files("stare_sandbox.cells").joinpath(f"{module}.py").read_text()


def _cell(module: str, call: str) -> str:
    """A housekeeping cell that runs the source of ``sandbox/cells/<module>.py``, then ``call``, in
    a namespace of their own (outside the user namespace)."""
    text = f"{_cell_source(module)}{call}\n"
    return f"exec({text!r}, {{}})"


BOUNDED_OUTPUT = _cell("bounded_output", f"bound_output({OUTPUT_CHUNK_CHARS})")
"""Run once after each kernel start, like ``BOOT_SNAPSHOT``: displayed values as ``text/plain`` only,
cut to ``OUTPUT_CHUNK_CHARS`` characters (``sandbox/cells/bounded_output.py``)."""

STREAMS = _cell("streams", f"capture_streams({OUTPUT_CHUNK_CHARS}, {KERNEL_OUTPUT_CHARS})")
"""Run once after each kernel start: stdout and stderr send messages of at most ``OUTPUT_CHUNK_CHARS``
characters, and what the file descriptors 1 and 2 receive (child processes, ``os.write``, C code)
reaches the output of the cell that wrote it, whole and in order with its ``print``
(``sandbox/cells/streams.py``). Code in the sandbox can undo this; then only its own output suffers
(oversized messages are dropped: ``MAX_MESSAGE_BYTES``)."""

BOOT_SNAPSHOT = _cell("boot_snapshot", "snapshot()")
"""Run once after each kernel start (``sandbox/cells/boot_snapshot.py``): records what ``reset_code``
restores, and forgets the error of ``WARM_TRACEBACKS`` (``sys.last_*``)."""

SEED_RANDOM = _cell("seed_random", f"seed_random({RANDOM_SEED})")
"""Run after each kernel start and at each soft reset: ``random``, and ``numpy.random``'s global
generator where numpy is imported, start from ``RANDOM_SEED`` (``sandbox/cells/seed_random.py``)."""


def preload_code(modules: Sequence[str]) -> str:
    """Housekeeping cell that imports ``modules`` (``SandboxConfig.preload``) outside the user
    namespace: what a local kernel runs once at its start (the Docker warden imports them itself)."""
    return _cell("preload", f"preload({list(modules)!r})")


KERNEL_BOOT = f"{BOOT_SNAPSHOT}\n{BOUNDED_OUTPUT}\n{SEED_RANDOM}\n{STREAMS}"
"""What each new kernel runs before the first call: sent as a request by the driver, or run by
the Docker warden in the kernel process before it serves (one round trip less per reset)."""

WARM_TRACEBACKS = "1/0"
"""Run once after each kernel start, and fails on purpose: the first error in a kernel pays for
the lazy imports of IPython's traceback machinery (~100-150 ms here), so it is paid before the
sandbox is handed out. ``BOOT_SNAPSHOT``, run next, forgets it (``sys.last_*``)."""


def reset_code(scratch_dirs: list[str], *, kill_all: bool, keep: tuple[str, ...] = ()) -> str:
    """Housekeeping cell for a soft reset, run outside the user namespace (``sandbox/cells/soft_reset.py``).

    It clears the user namespace and output cache (like ``%reset -f``), restores ``os.environ`` and ``sys.path`` to
    their values at kernel start, reseeds ``random`` and a loaded ``numpy.random`` (``SEED_RANDOM``), resets signal handlers and alarms, SIGKILLs stray processes
    (every process but PID 1 and the kernel when ``kill_all``, else the kernel's descendants),
    empties ``scratch_dirs`` (except the paths in ``keep``) and changes into the first. Modules already imported stay imported
    (re-importing C extensions such as numpy in one process is unsafe), so a monkey-patch of a
    module survives; ``reset(hard=True)`` starts a fresh process when that matters.
    """
    call = f"reset({list(scratch_dirs)!r}, kill_all={kill_all!r}, keep={list(keep)!r})"
    return f"{_cell('soft_reset', call)}\n{SEED_RANDOM}"


class KernelSandbox(Sandbox):
    """What the Docker and local backends share: a :class:`KernelDriver` that runs the code.

    Subclasses set ``self._driver`` once their kernel is up, ``self._closed`` on close, and
    ``self.start_timeout``.
    """

    _driver: KernelDriver | None = None
    _closed: bool = False
    start_timeout: float = 60.0

    def _live_driver(self) -> KernelDriver:
        if self._closed or self._driver is None:
            raise SandboxClosed("this sandbox was closed: create a new one")
        return self._driver

    def run(self, code: str, timeout: float | None = None) -> ExecResult:
        driver = self._live_driver()
        return driver.execute(
            code,
            self.config.timeout_s if timeout is None else timeout,
            cpu_timeout=self.config.cpu_timeout_s,
            start_timeout=self.start_timeout,
        )
