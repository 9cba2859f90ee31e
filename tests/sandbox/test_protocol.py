"""What model code can send back to the host on the Docker backend: malformed, forged or huge
messages and unencodable text never make ``run()`` raise, and host memory stays bounded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from stare_sandbox import DockerSandbox, SandboxConfig
from stare_sandbox.kernel import MAX_SKIPPED_MESSAGES

pytestmark = pytest.mark.docker

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def sb(docker_ready):
    with DockerSandbox(SandboxConfig(max_output_chars=1000)) as sandbox:
        sandbox.run("kept = 7")
        yield sandbox


def test_display_of_a_non_string_text_is_skipped_and_counted(sb: DockerSandbox) -> None:
    result = sb.run("print('a')\ndisplay({'text/plain': ['x']}, raw=True)\nprint('b')")
    assert result.stdout == "a\nb\n" and result.skipped_messages == 1 and result.error is None
    assert "1 message(s) from the kernel were malformed" in result.stderr
    assert sb.run("kept").stdout == "7\n"


FORGE = """
ip = get_ipython()
kernel, session = ip.kernel, ip.kernel.session
parent = kernel.get_parent('shell')
socket = kernel.iopub_socket
socket.send_multipart([b'garbage'])                                      # no delimiter
socket.send_multipart([b'<IDS|MSG>', b'0' * 64, b'{}', b'{}', b'{}', b'{}'])  # bad signature
frames = [b'{"msg_id": "1"}', session.pack(parent), b'{}', b'[1, 2]']  # header lacks msg_type
socket.send_multipart([b'<IDS|MSG>', session.sign(frames)] + frames)
frames = [json.dumps({'msg_id': 'x', 'msg_type': 'error', 'session': 's', 'username': 'u', 'date': '',
          'version': '5.3'}).encode(), session.pack(parent), b'{}', b'{"ename": 1, "traceback": [2]}']
socket.send_multipart([b'<IDS|MSG>', session.sign(frames)] + frames)  # signed, wrong types
session.send(socket, 'stream', {'name': 'stdout', 'text': {'a': 1}}, parent=parent)
session.send(socket, 'stream', {'name': 'stdout', 'text': 'forged\\n'}, parent=parent)
import time; time.sleep(0.2)
print('done')
"""


def test_frames_written_to_the_kernels_own_iopub_socket_are_skipped(sb: DockerSandbox) -> None:
    result = sb.run("import json\n" + FORGE)
    assert result.error is None and not result.state_lost
    assert result.skipped_messages == 5
    assert result.stdout == "forged\ndone\n"


def test_a_flood_of_malformed_messages_restarts_the_kernel(sb: DockerSandbox) -> None:
    result = sb.run(
        "s = get_ipython().kernel.iopub_socket\nimport time\n"
        f"for _ in range({MAX_SKIPPED_MESSAGES * 3}):\n    s.send_multipart([b'x'])\n    time.sleep(0.001)\n"
        "time.sleep(1)",
        timeout=20,
    )
    assert result.state_lost and result.error.type == "KernelProtocolError"
    assert result.skipped_messages > MAX_SKIPPED_MESSAGES
    assert sb.run("1 + 1").stdout == "2\n"
    sb.run("kept = 7")


def test_a_lone_surrogate_in_the_code_is_replaced_visibly(sb: DockerSandbox) -> None:
    result = sb.run("s = '\ud800'\nprint(len(s), ord(s))")  # a real lone surrogate, as JSON decodes it
    assert result.stdout == f"1 {0xFFFD}\n"
    pair = sb.run("print('\ud83d\ude00')")  # two surrogates that make one character
    assert pair.stdout == "\U0001f600\n"


SURROGATES = """
import json, time
k = get_ipython().kernel
pack, k.session.pack = k.session.pack, lambda obj: json.dumps(obj, default=str).encode()  # ASCII JSON: \\ud800 escapes
k.session.send(k.iopub_socket, 'stream', {'name': 'stdout', 'text': 'a\\ud800b'}, parent=k.get_parent('shell'))
k.session.send(k.iopub_socket, 'error', {'ename': 'E\\udfff', 'evalue': 'v', 'traceback': ['t\\ud800']},
               parent=k.get_parent('shell'))
time.sleep(0.2)
k.session.pack = pack
"""


def test_surrogates_forged_into_output_come_back_encodable(sb: DockerSandbox) -> None:
    result = sb.run(SURROGATES)
    assert result.stdout == "a\ufffdb" and result.error.type == "E\ufffd"
    for text in (result.stdout, result.stderr, result.error.type, result.error.traceback):
        text.encode("utf-8")


def test_an_oversized_message_is_refused_without_hanging(sb: DockerSandbox) -> None:
    # Signed and addressed to the call, but over MAX_MESSAGE_BYTES: the kernel's socket is dropped,
    # and with it possibly the "idle"; the call still ends, long before its timeout.
    code = (
        "k = get_ipython().kernel\n"
        "k.session.send(k.iopub_socket, 'stream', {'name': 'stdout', 'text': 'x' * 2**23}, parent=k.get_parent('shell'))\n"
        "import time; time.sleep(0.3)\nprint('after')"
    )
    result = sb.run(code, timeout=20)
    assert not result.timed_out and result.duration_s < 5 and "x" * 100 not in result.stdout
    assert sb.run("kept").stdout == "7\n"


def test_an_oversized_message_on_the_shell_channel_never_makes_run_raise(sb: DockerSandbox) -> None:
    # zmq drops the connection for good after a protocol error; the host must notice and renew it.
    code = (
        "k = get_ipython().kernel\n"
        "k.session.send(k.shell_stream, 'x', {'t': 'x' * 2**23}, ident=k._parent_ident['shell'])"
    )
    sb.run(code, timeout=5)
    for _ in range(3):  # the break is noticed at the latest at a timeout, which restarts the kernel
        sb.run("1", timeout=2)
    assert sb.run("1 + 1").stdout == "2\n"
    sb.run("kept = 7")


def test_big_output_still_arrives_cut_with_the_exact_count(sb: DockerSandbox) -> None:
    printed = sb.run("print('a' * (3 * 2**20))")
    assert printed.stdout.startswith("a" * 500) and printed.stdout.endswith("a" * 499 + "\n")
    assert f"[{3 * 2**20 + 1 - 1000} characters truncated]" in printed.stdout
    shown = sb.run("'b' * (3 * 2**20)")  # a value's repr is cut in the kernel already
    assert shown.stdout.startswith("'" + "b" * 499) and shown.stdout.endswith("b" * 400 + "'\n")
    assert printed.skipped_messages == shown.skipped_messages == 0


HOST_MEMORY_CHILD = """
import json, sys
from stare_sandbox import DockerSandbox, SandboxConfig
from stare_sandbox.usage import ProcessUsage

me = ProcessUsage(__import__('os').getpid())
with DockerSandbox(SandboxConfig(memory_mb=2048, max_output_chars=1000)) as sb:
    sb.run("import sys\\nchunk = 'x' * 2**20")
    me.reset_peak()
    before = me.peak_bytes()
    result = sb.run("for _ in range(500):\\n    sys.stdout.write(chunk)", timeout=120)
    print(json.dumps([me.peak_bytes() - before, result.stdout[-60:], result.truncated, result.duration_s]))
"""


def test_printing_500_mb_keeps_host_memory_bounded(docker_ready) -> None:
    child = subprocess.run(
        [sys.executable, "-c", HOST_MEMORY_CHILD],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert child.returncode == 0, child.stderr[-2000:]
    growth, tail, truncated, duration = json.loads(child.stdout.splitlines()[-1])
    assert truncated and tail.endswith("x" * 20), tail
    assert growth < 100 * 2**20, f"host peak RSS grew by {growth / 2**20:.0f} MiB reading 500 MB"


# One message of 4,000 parts of 64 KiB (250 MiB) from the kernel to the host, zero-copy (the kernel
# holds one part): on its iopub socket, sent from its IOPub thread; on its shell socket (a ROUTER: the
# host's routing id first). zmq on the host would hold every part.
FLOODS = {
    "iopub": (
        "import threading, zmq\n"
        "thread, done = get_ipython().kernel.iopub_thread, threading.Event()\n"
        "def flood(part=b'x' * 2**16):\n"
        "    for _ in range(4000):\n"
        "        thread.socket.send(part, zmq.SNDMORE, copy=False)\n"
        "    thread.socket.send(b'')\n"
        "    done.set()\n"
        "thread.schedule(flood)\n"
        "done.wait(60)\n"
        "print('sent')"
    ),
    "shell": (
        "import zmq\n"
        "k = get_ipython().kernel\n"
        "s, ident = k.shell_stream.socket, k._parent_ident['shell']\n"
        "for frame in (ident if isinstance(ident, list) else [ident]):\n"
        "    s.send(frame, zmq.SNDMORE)\n"
        "part = b'x' * 2**16\n"
        "for _ in range(4000):\n"
        "    s.send(part, zmq.SNDMORE, copy=False)\n"
        "s.send(b'')\n"
        "print('sent')"
    ),
}
MANY_PARTS_CHILD = """
import json, sys, time
from stare_sandbox import DockerSandbox, SandboxConfig
from stare_sandbox.usage import ProcessUsage

me = ProcessUsage(__import__('os').getpid())
with DockerSandbox(SandboxConfig(max_output_chars=1000)) as sb:
    sb.run("kept = 7")
    me.reset_peak()
    before = me.peak_bytes()
    result = sb.run({flood!r}, timeout=120)
    time.sleep(3)  # zmq's I/O thread would have taken it all in by now
    after = [sb.run("print(kept)").stdout for _ in range(3)]
    print(json.dumps([me.peak_bytes() - before, result.stdout, result.skipped_messages, after]))
"""


@pytest.mark.parametrize("channel", sorted(FLOODS))
def test_a_message_of_many_parts_keeps_host_memory_bounded(channel, docker_ready) -> None:
    child = subprocess.run(
        [sys.executable, "-c", MANY_PARTS_CHILD.format(flood=FLOODS[channel])],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert child.returncode == 0, child.stderr[-2000:]
    growth, stdout, skipped, after = json.loads(child.stdout.splitlines()[-1])
    assert growth < 100 * 2**20, (
        f"host peak RSS grew by {growth / 2**20:.0f} MiB on a 250 MiB {channel} message"
    )
    assert stdout.startswith("sent\n"), stdout
    assert skipped >= 1 or channel == "shell"  # the shell channel is read for replies only
    assert after == ["7\n"] * 3  # the connection and the kernel's state survive
