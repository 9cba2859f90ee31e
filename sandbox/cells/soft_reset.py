"""A soft reset, run outside the user namespace (``stare_sandbox.kernel.reset_code``, the local backend's
``reset()``): the kernel's interpreter stays, its state goes.

``reset`` clears the user namespace and output cache (like ``%reset -f``), restores ``os.environ``
and ``sys.path`` to their values at kernel start (``boot_snapshot``), resets signal handlers and
alarms, SIGKILLs stray processes (every process but PID 1 and the kernel when ``kill_all``, else
the kernel's descendants), empties the ``scratch`` dirs (except the paths in ``keep``) and changes
into the first.
"""

import os
import shutil
import signal
import sys
import time
from typing import Any

from IPython import get_ipython


def clear_namespace() -> None:
    """What ``%reset -f`` does, without its two full gc.collect() passes (~150 ms): drop user names,
    the output cache and the input history; cyclic garbage is left to the automatic collector. Also
    what ``%reset -f`` keeps: the last inputs (``_i``), IPython 9's record of each cell's printed
    output and error, and the cell count (``Cell In[n]`` in tracebacks), so that an episode can read
    nothing of the one before and sees the same kernel whichever went before it, as in a fresh one."""
    shell: Any = get_ipython()
    for name in [name for name in shell.user_ns if name not in shell.user_ns_hidden]:
        del shell.user_ns[name]
    history = shell.history_manager
    history.output_hist.clear()
    for record in ("outputs", "exceptions"):  # IPython 9
        getattr(history, record, {}).clear()
    del history.input_hist_parsed[1:], history.input_hist_raw[1:], history.dir_hist[1:]
    history._i00 = history._i = history._ii = history._iii = ""
    shell.execution_count = 1
    for name in ("_", "__", "___"):
        shell.user_ns[name] = ""
        setattr(shell.displayhook, name, "")


def restore_process() -> None:
    """``os.environ`` and ``sys.path`` as the kernel started with them, default signal handlers,
    no alarm."""
    boot: Any = sys.modules.get("_stare_boot")
    if boot is not None:
        os.environ.clear()
        os.environ.update(boot.environ)
        sys.path[:] = boot.path
    for sig in (
        signal.SIGTERM,
        signal.SIGHUP,
        signal.SIGALRM,
        signal.SIGUSR1,
        signal.SIGUSR2,
        signal.SIGCHLD,
    ):
        signal.signal(sig, signal.SIG_DFL)
    signal.setitimer(signal.ITIMER_REAL, 0)


def kill_strays(kill_all: bool) -> None:
    """SIGKILL every process but PID 1 and the kernel (``kill_all``), else the kernel's
    descendants; reap the kernel's children for up to a second."""
    me = os.getpid()
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    if kill_all:
        victims = [pid for pid in parents if pid not in (1, me)]
    else:
        victims, frontier = [], [me]
        while frontier:
            children = [pid for pid, ppid in parents.items() if ppid in frontier and pid != me]
            victims += children
            frontier = children
    for pid in victims:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    reap_until = time.monotonic() + 1.0
    try:
        while time.monotonic() < reap_until:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                time.sleep(0.002)
    except ChildProcessError:
        pass


def empty_scratch(scratch: list[str], keep: list[str]) -> None:
    """Remove everything in the ``scratch`` dirs but the paths in ``keep``."""
    for folder in scratch:
        for entry in os.listdir(folder):
            path = os.path.join(folder, entry)
            if path in keep:
                continue
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                try:
                    os.unlink(path)
                except OSError:
                    pass


def reset(scratch: list[str], kill_all: bool, keep: list[str]) -> None:
    clear_namespace()
    restore_process()
    kill_strays(kill_all)
    empty_scratch(scratch, keep)
    os.chdir(scratch[0])
