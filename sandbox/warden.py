"""The warden: the process in a sandbox container that starts each kernel and wipes up after it.

This file is a program that runs *inside* the container (its Python, stdlib and ipykernel only;
nothing from this package): ``python3 -c <this source> <connection file> <boot code> <preload as a
JSON list> <kernel args>``, as the container's PID 1 (its entrypoint: no init of the image runs,
so no process of the container outlives episodes but this one). It never runs model code, so the
reset between episodes does not depend on the good behaviour of the interpreter that ran it:

1. At start it makes itself non-dumpable (code of the same uid can neither ptrace it nor read or
   write its memory or descriptors, and its ``/proc`` files become root's; the seccomp profile
   refuses ptrace anyway), drops ``''`` from ``sys.path`` (the work dir), imports everything a
   kernel needs and the modules the host preloads (``SandboxConfig.preload``, none by default;
   with numpy and sympy an episode's ``import sympy`` costs nothing; exit 75 when one is missing),
   binds the two unix sockets the host reaches kernels through (shell and iopub; zmq ``USE_FD``:
   the kernel serves on the warden's listeners, so it never needs to write to the connection
   dir), and records its rlimits and scheduling. As PID 1 it obeys only signals from outside the
   container (the host's, ``si_pid`` 0): code in the sandbox can neither stop it (the kernel
   ignores SIGSTOP and SIGKILL from inside for a namespace's init) nor make it act.
2. It forks a kernel: signal dispositions and mask back to default, dumpable again, cwd
   ``/work``, standard streams on ``/dev/null`` (nothing the kernel holds reaches the container's
   log, which dockerd writes outside the sandbox's CPU and disk limits), listeners of its own for
   the channels the host never uses (stdin, control; none for the heartbeat), the connection key
   the host chose for it, then the rest of ipykernel's start-up and the host's boot code. Forking after the
   imports, the shell, its extensions and the first-use caches (``prepare_kernel``) makes a fresh
   kernel cost its sockets, threads and copy-on-write page faults (about 20 ms of CPU), not a new
   interpreter. What the warden built is the zygote of every kernel: a kernel changes only its
   own copy of it, and the next one forks from the untouched original.
3. On SIGUSR1 (the host's "next episode") it SIGKILLs every other process in the container until
   none is left, empties ``/work``, ``/tmp``, ``/dev/shm`` and ``/dev/mqueue`` (their roots, which
   the kernel does not own, are touched, and any extended attribute is removed), removes every
   SysV IPC object, and checks that the dirs are empty, that its rlimits, nice value, scheduler
   and CPU affinity are still what they were (a process of the same uid may lower them with
   ``prlimit``/``setpriority``, and a fork inherits them), and that it is still non-dumpable and
   untraced. Then it waits for SIGUSR2: the host, having seen that the warden is alone in the
   container, wrote the next kernel's connection key (which no process of the last episode can
   have read) and opened the connection dir. The warden closes the last kernel's listeners
   (with whatever the episode left in their queues, a connection carrying a descriptor sent with
   SCM_RIGHTS say, or set on them), binds fresh ones and forks a fresh kernel with the new key;
   the host locks the dir again before any code runs. If anything does not check out it exits,
   the container stops and the host falls back to restarting the container.
4. SIGINT is forwarded to the kernel (the host's interrupt); SIGTERM ends everything. When the
   kernel exits on its own, the warden logs it (``KERNEL_EXITED``) and exits with its status
   (128 + signal when killed), so the container stops exactly as it did when the kernel was its
   main process; before it obeys a SIGTERM it logs that too (``STOPPED_FROM_OUTSIDE``). Only the
   warden writes the container's log, so the host can tell an end the code may have caused from
   one that came from outside (``stare_sandbox.errors.SandboxKilled``).

Every other catchable signal is ignored.
"""

import ctypes
import fcntl
import gc
import json
import os
import resource
import signal
import socket
import sys
import threading
import time

PR_SET_PDEATHSIG, PR_GET_DUMPABLE, PR_SET_DUMPABLE = 1, 3, 4
IPC_RMID = 0
SCRATCH = ("/work", "/tmp", "/dev/shm", "/dev/mqueue")
"""Directories emptied between kernels (tmpfs or mqueue mounts of this container, each owned by
root with mode 1777: the kernel can fill them, not change the roots themselves)."""
KERNEL_FILE = "/tmp/.kernel.json"
"""The connection file each kernel reads (and rewrites): in the wiped tmpfs, never in /conn."""
HOST_CHANNELS = ("shell", "iopub")
"""The channels the host connects to: their listeners are the warden's, bound once."""
KERNEL_CHANNELS = ("stdin", "control")
"""Channels ipykernel serves that the host never uses: each kernel gets listeners of its own."""
RENEW, START, INTERRUPT, TERMINATE = signal.SIGUSR1, signal.SIGUSR2, signal.SIGINT, signal.SIGTERM
HANDLED = {RENEW, START, INTERRUPT, TERMINATE, signal.SIGCHLD}
START_TIMEOUT_S = 10.0
"""How long a renewal waits for the host's SIGUSR2 before the warden gives up (and exits)."""
KERNEL_EXITED = "the kernel exited with status"
"""What the warden logs (then the status) before it stops because its kernel ended, by whatever
cause: the host then knows the container did not end from outside (``stare_sandbox.docker``)."""
STOPPED_FROM_OUTSIDE = "stopped by SIGTERM from outside the container"
"""What the warden logs before it obeys a SIGTERM (``docker stop``, a Docker daemon that shuts down)."""
BOOT_FAILED = "the kernel's boot code failed"
"""What a new kernel logs (then the error) before it exits with ``BOOT_FAILED_STATUS`` instead of
serving without its boot (unbounded messages, unseeded, descriptor output in the wrong cell)."""
BOOT_FAILED_STATUS = 78

libc = ctypes.CDLL(None, use_errno=True)


log_fd = 2
"""Where ``log`` writes: the container's log. A kernel holds its own copy until its boot has run
(its descriptor 2 is /dev/null), and closes it before it serves: no code of an episode can write
a warden line."""


def log(message):
    os.write(log_fd, f"warden: {message}\n".encode())


def stop_logging():
    """In a kernel, before it serves: close its copy of the container's log."""
    global log_fd
    if log_fd != 2:
        os.close(log_fd)
        log_fd = 2


def process_state():
    """What a forked kernel inherits from the warden and code of the same uid could change."""
    limits = {
        name: resource.getrlimit(getattr(resource, name))
        for name in dir(resource)
        if name.startswith("RLIMIT_")
    }
    return {
        "rlimits": limits,
        "nice": os.getpriority(os.PRIO_PROCESS, 0),
        "scheduler": os.sched_getscheduler(0),
        "affinity": sorted(os.sched_getaffinity(0)),
    }


def kill_others(me, deadline_s=5.0):
    """SIGKILL every process but the warden (PID 1) until none is left; reap them."""
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            os.kill(-1, signal.SIGKILL)  # every process we may signal, except ourselves
        except ProcessLookupError:
            pass
        reap()
        others = [p for p in os.listdir("/proc") if p.isdigit() and int(p) not in (1, me)]
        if not others:
            return True
        if time.monotonic() > deadline:
            log(f"processes {others} outlived SIGKILL")
            return False
        time.sleep(0.001)


def reap():
    """Wait for every exited child; return {pid: wait status}."""
    done = {}
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return done
        if pid == 0:
            return done
        done[pid] = status


def empty_dir(top):
    """Remove everything below ``top`` without following symlinks, however deep or unreadable
    (directories are made searchable first). Iterative: depth costs open descriptors, not stack."""
    stack = [(os.open(top, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW), None, None)]
    while stack:
        fd, parent, name = stack[-1]
        child = None
        with os.scandir(fd) as entries:
            for entry in entries:
                if entry.is_dir(follow_symlinks=False):
                    os.chmod(entry.name, 0o700, dir_fd=fd)
                    child = (
                        os.open(entry.name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd),
                        fd,
                        entry.name,
                    )
                    break
                os.unlink(entry.name, dir_fd=fd)
        if child is not None:
            stack.append(child)
            continue
        stack.pop()
        os.close(fd)
        if parent is not None:
            os.rmdir(name, dir_fd=parent)


def remove_ipc():
    """Remove every SysV shared memory segment, message queue and semaphore set."""
    controls = {"shm": libc.shmctl, "msg": libc.msgctl, "sem": libc.semctl}
    for kind, control in controls.items():
        try:
            with open(f"/proc/sysvipc/{kind}") as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            ident = int(row.split()[1])
            if kind == "sem":
                control(ident, 0, IPC_RMID)
            else:
                control(ident, IPC_RMID, None)


def leftovers():
    """What is still there after a wipe (empty when the container is clean)."""
    found = [f"{d}/{name}" for d in SCRATCH if os.path.isdir(d) for name in os.listdir(d)]
    found += [f"{d} xattr {name}" for d in SCRATCH if os.path.isdir(d) for name in _xattrs(d)]
    for kind in ("shm", "msg", "sem"):
        try:
            with open(f"/proc/sysvipc/{kind}") as f:
                found += [f"sysv {kind} {row.split()[1]}" for row in f.read().splitlines()[1:]]
        except OSError:
            pass
    return found


def _xattrs(path):
    try:
        return os.listxattr(path)
    except OSError:
        return []


def wipe():
    for folder in SCRATCH:
        if os.path.isdir(folder):
            try:
                empty_dir(folder)
                for name in _xattrs(folder):
                    os.removexattr(folder, name)
                os.utime(folder)  # its times now, not ones the last episode chose
            except OSError as exc:
                log(f"emptying {folder}: {exc}")
    remove_ipc()


def intact():
    """True while the warden is non-dumpable and untraced (the seccomp profile refuses ptrace,
    and the kernel ignores a same-uid ptrace of a non-dumpable process: checked all the same)."""
    with open("/proc/self/status") as f:
        tracer = [line.split()[1] for line in f if line.startswith("TracerPid:")]
    return libc.prctl(PR_GET_DUMPABLE, 0, 0, 0, 0) == 0 and tracer == ["0"]


def read_key(connection_file):
    """The next kernel's connection key, which the host wrote while the warden was alone."""
    try:
        with open(connection_file) as f:
            key = json.load(f)["key"]
    except (OSError, ValueError, KeyError) as exc:
        log(f"cannot read the next kernel's key ({type(exc).__name__}: {exc})")
        return None
    return key if isinstance(key, str) and key else None


def warm_tracebacks():
    """Format tracebacks the way a kernel does, once here for every kernel: the first error in a
    process pays for parsing ``interactiveshell.py`` (the frame every cell runs under) and for
    compiling pygments' regular expressions, about 100 ms; a fork inherits both caches."""
    import json

    import IPython.core.interactiveshell
    import stack_data
    from IPython.core.ultratb import AutoFormattedTB

    stack_data.Source.for_filename(IPython.core.interactiveshell.__file__)
    for scheme in ("NoColor", "Linux", "LightBG", "Neutral"):
        try:
            json.loads("{")
        except ValueError:
            AutoFormattedTB(mode="Context", color_scheme=scheme).structured_traceback(*sys.exc_info())


def warm_cells(shell):
    """Take, once here, the first-use costs of every cell and message that a forked kernel would
    otherwise pay each time: compiling ``tokenize``'s regular expressions (IPython tokenizes every
    cell: about 15 ms), IPython's input transformers, and the date parsing of message headers."""
    from jupyter_client.jsonutil import extract_dates

    for cell in ("x = 1\n", "print(x)\nx\n"):
        shell.should_run_async(
            cell, transformed_cell=shell.transform_cell(cell), preprocessing_exc_tuple=None
        )
    extract_dates({"date": "2020-01-01T00:00:00.000000Z"})


def prepare_kernel(kernel_args, boot):
    """Do once, here, the part of a kernel's start-up that is the same for every kernel and runs
    no model code: parse its options, load its profile (read while /tmp is still fresh), and build
    its IPython shell (magics, prefilters, completer: most of the start-up). ipykernel asks for the
    shell with ``ZMQInteractiveShell.instance()``, so each forked kernel finds this pristine one.

    Returns the function a forked child calls to serve as a kernel: the rest of
    ``IPKernelApp.initialize`` (sockets, threads, streams, the kernel object) and ``start``; or,
    when the preparation fails (another ipykernel), a plain ``ipykernel_launcher``.
    """
    argv = ["-f", KERNEL_FILE, *kernel_args]

    def launch(key):  # the key is in KERNEL_FILE, which the app reads
        # ipykernel_launcher's own steps (IPKernelApp.launch_instance), with the boot before serving
        from ipykernel.kernelapp import IPKernelApp

        sys.argv = ["ipykernel_launcher", *argv]
        app = IPKernelApp.instance()
        app.initialize(argv)
        run_boot(compile_boot(boot))
        stop_logging()
        app.start()

    try:
        import ipykernel
        from ipykernel.compiler import XCachingCompiler
        from ipykernel.kernelapp import IPKernelApp
        from ipykernel.zmqshell import ZMQInteractiveShell
        from IPython.core.application import BaseIPythonApplication

        if ipykernel.version_info[0] != 6:
            raise RuntimeError(f"written for ipykernel 6, found {ipykernel.__version__}")
        # No debugger: nothing attaches to a sandbox's kernel, and making one per kernel costs
        # about a millisecond of every reset (and exposes a debug channel for nothing).
        ipykernel.ipkernel._is_debugpy_available = False
        # No execute_input broadcast (the code of each request, echoed on iopub for other
        # clients): the host is the only client and skips it; one message less per call.
        ipykernel.kernelbase.Kernel._publish_execute_input = lambda *args, **kwargs: None
        app = IPKernelApp.instance()
        app._init_asyncio_patch()
        BaseIPythonApplication.initialize(app, argv)  # what IPKernelApp.initialize does first
        app.init_pdb()
        app.init_blackhole()
        app.init_connection_file()
        shell = ZMQInteractiveShell.instance(
            parent=app, profile_dir=app.profile_dir, compiler_class=XCachingCompiler
        )
        # Also once here: IPython's default extensions (storemagic: registering its magics is
        # about 5 ms of a kernel's start), and no startup files in any kernel (the profile's are
        # under the wiped /tmp, the image has no system-wide ones: 2 ms of globbing).
        app.shell = shell
        app.init_extensions()
        app.shell = None
        app._run_startup_files = lambda: None
        warm_cells(shell)
        compiled = compile_boot(boot)
    except Exception as exc:  # noqa: BLE001 - a slower start, not a failure
        log(f"could not prepare kernels ({type(exc).__name__}: {exc}); each starts from scratch")
        return launch

    def serve(key):
        sys.argv = ["ipykernel_launcher", *argv]
        app.session.pid = os.getpid()  # made in the warden: it refuses to send "from a fork"
        app.session.key = key.encode()
        app.init_poller()
        app.init_sockets()
        # Left out, as nothing here uses them and each costs every reset: the heartbeat (a zmq
        # context and a thread; the host does not ping), rewriting the connection file (the
        # warden wrote it), and printing the connection info to the container's log.
        app._ports = {name: getattr(app, f"{name}_port") for name in (*HOST_CHANNELS, *KERNEL_CHANNELS)}
        app.init_io()
        try:
            app.init_signal()
        except Exception:  # noqa: BLE001 - as IPKernelApp.initialize: a kernel without it still works
            pass
        app.init_kernel()
        app.kernel.shell.kernel = app.kernel  # the shell was made before its kernel
        app.init_path()
        app.init_shell()
        if app.shell:
            app.init_gui_pylab()
            app.init_code()
        run_boot(compiled)
        stop_logging()
        sys.stdout.flush()
        sys.stderr.flush()
        app.start()

    return serve


def compile_boot(boot):
    """The boot's code, compiled once here, before any fork: the boot is a series of
    ``exec(<cell source>, {})`` (``stare_sandbox.kernel._cell``), and compiling it and its cells'
    sources in each kernel cost about 2 ms of every reset. Returns (the boot's code, {cell source:
    its code}), or (None, {}) when there is no boot or it does not compile."""
    if not boot:
        return None, {}
    cells = {}
    try:
        code = compile(boot, "<boot>", "exec")
        exec(
            code,
            {
                "exec": lambda source, namespace: cells.setdefault(
                    source, compile(source, "<boot cell>", "exec")
                )
            },
        )
    except Exception as exc:  # noqa: BLE001 - each kernel then compiles the boot itself
        log(f"could not compile the boot code ({type(exc).__name__}: {exc}); each kernel compiles it")
        return boot, {}
    return code, cells


def run_boot(boot):
    """Run the host's boot code (``stare_sandbox.kernel.KERNEL_BOOT``: bounded output messages,
    descriptor output read per cell, the snapshot a soft reset restores) in the new kernel before it
    serves, so the host need not send it as a first request; ``boot`` as ``compile_boot`` returns
    it. A failure is logged (``BOOT_FAILED``) and ends the kernel (``BOOT_FAILED_STATUS``): a kernel
    without its boot would serve with unbounded messages, unseeded and with descriptor output in the
    wrong cell, a silent loss the host could not see."""
    code, cells = boot
    if code is None:
        return
    from IPython import get_ipython

    def run_cell(source, namespace):
        exec(cells.get(source, source), namespace)

    try:
        exec(code, {"get_ipython": get_ipython, "exec": run_cell})
    except Exception as exc:  # noqa: BLE001 - any failure of the boot is reported alike
        log(f"{BOOT_FAILED}: {type(exc).__name__}: {exc}")
        raise SystemExit(BOOT_FAILED_STATUS) from None


def bind_listeners(info):
    """Listening unix sockets for the host's channels, bound once: {zmq address: socket}."""
    listeners = {}
    for channel in HOST_CHANNELS:
        path = f"{info['ip']}-{info[channel + '_port']}"
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(path)
        sock.listen(64)
        sock.set_inheritable(True)
        listeners[f"ipc://{path}"] = sock
    return listeners


def run_kernel(info, listeners, serve):
    """In the forked child: become a plain process again and serve as a kernel."""
    for signum in range(1, signal.NSIG):
        if signum not in (signal.SIGKILL, signal.SIGSTOP):
            try:
                signal.signal(signum, signal.SIG_DFL)
            except (OSError, ValueError):
                pass
    # As a new interpreter would have them: Ctrl-C raises, writes past RLIMIT_FSIZE or to a
    # closed pipe fail with an OSError instead of killing the process.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    os.chdir("/work")
    global log_fd
    log_fd = os.dup(2)  # until the boot has run (stop_logging)
    null = os.open("/dev/null", os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    os.close(null)
    own_descriptions({log_fd, *(s.fileno() for s in listeners.values())})
    import zmq

    fds = {address: s.fileno() for address, s in listeners.items()}
    own = []  # listening, never bound to a path: no process outside this kernel knows them
    for channel in KERNEL_CHANNELS:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind("")  # autobind: an abstract name, in the container's own network namespace
        sock.listen(8)
        own.append(sock)
        fds[f"ipc://{info['ip']}-{info[channel + '_port']}"] = sock.fileno()
    bind = zmq.Socket.bind

    def bind_prebound(self, address):
        if address in fds:
            self.setsockopt(zmq.USE_FD, fds[address])
        return bind(self, address)

    zmq.Socket.bind = bind_prebound
    code = 0
    try:
        serve(info["key"])
    except SystemExit as exc:  # exit codes as if the kernel were a process of its own
        code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    except BaseException as exc:  # noqa: BLE001 - logged while the kernel has not served yet
        log(f"the kernel could not start ({type(exc).__name__}: {exc})")
        code = 1
    os._exit(code)


def own_descriptions(listeners):
    """Give the kernel only open file descriptions of its own: a descriptor it inherited from the
    warden (``/dev/null``, opened while importing IPython) shares its file status flags and owner
    (``F_SETFL``, ``F_SETSIG``, ``F_SETOWN``) with every later kernel, a channel between episodes. A
    file's descriptor is reopened in place (so what holds it keeps working), anything else closed;
    ``listeners`` (this kernel's own, bound for it) and 0-2 (opened just before) are kept."""
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd <= 2 or fd in listeners:
            continue
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
            flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        except OSError:  # listdir's own descriptor, closed by now
            continue
        if target.startswith("/"):
            fresh = os.open(target, flags & (os.O_ACCMODE | os.O_APPEND | os.O_NONBLOCK))
            os.dup2(fresh, fd, inheritable=os.get_inheritable(fd))
            os.close(fresh)
        else:
            os.close(fd)


def spawn(info, listeners, serve):
    write_kernel_file(info)
    pid = os.fork()
    if pid == 0:
        try:
            run_kernel(info, listeners, serve)
        finally:
            os._exit(70)
    return pid


def write_kernel_file(info):
    with open(KERNEL_FILE, "w") as f:
        json.dump(info, f)


def exit_status(status):
    return 128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def preload(names):
    """Import ``names`` (the host's ``SandboxConfig.preload``) here, once, so that every kernel
    forks with them imported. False, logged with the fix, when one cannot be imported."""
    import importlib

    for name in names:
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - any failure of the import is reported alike
            log(
                f"cannot preload {name!r} ({type(exc).__name__}: {exc}): install it in the image, "
                "or leave it out of sandbox.limits.preload"
            )
            return False
    return True


SI_USER = 0


def from_outside(info):
    """True for a signal sent with kill() from outside the container (the host, dockerd): the
    kernel reports a sender in an ancestor pid namespace as pid 0 (and a signal the kernel sends
    on a process's behalf, SIGIO to an owner set with F_SETOWN, has another code). A child's
    SIGCHLD counts as well."""
    return info.si_signo == signal.SIGCHLD or (info.si_code == SI_USER and info.si_pid == 0)


def next_signal(timeout=None):
    """The next handled signal from outside the container (None at the timeout); signals that
    code in the sandbox sent are dropped here."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        if deadline is None:
            info = signal.sigwaitinfo(HANDLED)
        else:
            info = signal.sigtimedwait(HANDLED, max(0.0, deadline - time.monotonic()))
            if info is None:
                return None
        if from_outside(info):
            return info.si_signo


def renew(connection_file, info, listeners, state):
    """Wipe the container for the next episode, wait for the host's go and bind fresh listeners
    in ``listeners`` (see the module docstring); the exit status when something does not check
    out, else None."""
    me = os.getpid()
    if not kill_others(me):
        return 72
    wipe()
    left = leftovers()
    if left:
        log(f"left after the wipe: {left[:5]}")
        return 73
    if process_state() != state or not intact():
        log("rlimits, scheduling or the warden itself were changed from inside: exiting")
        return 74
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        signum = next_signal(deadline - time.monotonic())
        if signum is None:
            log(f"the host did not start the next kernel within {START_TIMEOUT_S:g} s: exiting")
            return 76
        if signum == TERMINATE:
            return 0
        if signum == signal.SIGCHLD:
            reap()
        elif signum == START:
            break
    key = read_key(connection_file)
    if key is None:
        return 76
    info["key"] = key
    for sock in listeners.values():  # with whatever waits in their queues, or was set on them
        sock.close()
    try:
        listeners.update(bind_listeners(info))
    except OSError as exc:
        log(f"cannot bind the next kernel's sockets ({exc}): exiting")
        return 78
    return None


def main(argv):
    connection_file, boot, modules, kernel_args = argv[0], argv[1], json.loads(argv[2]), argv[3:]
    libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    sys.path[:] = [p for p in sys.path if p and os.path.abspath(p) != "/work"]
    sys.dont_write_bytecode = True
    os.umask(0o007)  # socket files 0770: connectable by the host through the group
    os.chdir("/")
    signal.pthread_sigmask(signal.SIG_BLOCK, HANDLED)
    for signum in range(1, signal.NSIG):
        if signum not in HANDLED and signum not in (signal.SIGKILL, signal.SIGSTOP):
            try:
                signal.signal(signum, signal.SIG_IGN)
            except (OSError, ValueError):
                pass
    # Everything a kernel imports, imported once here (a fork then shares it).
    import ipykernel.ipkernel  # noqa: F401
    import ipykernel.kernelapp  # noqa: F401
    import ipykernel.zmqshell  # noqa: F401
    import IPython.core.completerlib  # noqa: F401
    import IPython.core.ultratb  # noqa: F401

    try:
        import faulthandler  # noqa: F401

        import ipykernel.debugger  # noqa: F401
    except ImportError:
        pass
    warm_tracebacks()
    if not preload(modules):
        return 75
    with open(connection_file) as f:
        info = json.load(f)
    listeners = bind_listeners(info)
    state = process_state()
    write_kernel_file(info)
    serve = prepare_kernel(kernel_args, boot)
    gc.freeze()  # what the warden built stays out of the collector: fewer copy-on-write pages
    if threading.active_count() != 1:
        log("threads started before fork: exiting")
        return 71
    kernel = spawn(info, listeners, serve)
    while True:
        signum = next_signal()
        if signum == INTERRUPT:
            try:
                os.kill(kernel, signal.SIGINT)
            except ProcessLookupError:
                pass
        elif signum == TERMINATE:
            log(STOPPED_FROM_OUTSIDE)
            kill_others(os.getpid())
            return 0
        elif signum == RENEW:
            status = renew(connection_file, info, listeners, state)
            if status is not None:
                return status
            kernel = spawn(info, listeners, serve)
        elif signum == signal.SIGCHLD:
            status = reap().get(kernel)
            if status is not None:  # the kernel ended on its own: so does the container
                log(f"{KERNEL_EXITED} {exit_status(status)}")
                kill_others(os.getpid())
                return exit_status(status)


if __name__ == "__main__":
    os._exit(main(sys.argv[1:]))  # no atexit handlers: the prepared shell registered some
