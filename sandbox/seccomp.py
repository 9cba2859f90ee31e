"""The sandbox's own seccomp profile: the syscalls a Python notebook makes, and nothing else.

Docker's default profile is written for any container; ours replaces it (``security_opt
seccomp=<json>``) with an allowlist for one program: CPython with ipykernel, zmq over unix
sockets, numpy/scipy/sympy, threads, ``multiprocessing`` and ``subprocess``. Every other syscall
fails with EPERM. ``DENIED`` names the ones an attacker wants and a notebook never needs, so that
a test can check each of them (``tests/sandbox/test_reach.py``); they are simply not in the
allowlist.

Some rules carry arguments: ``clone`` only without namespace flags (a new user or network
namespace is how container escapes start), and ``socket``/``socketpair`` only for the families a
notebook uses: unix and netlink (address lookups), and IPv4/IPv6 only where the sandbox has a
network. Without one (``network: none``) there is nothing to reach but the container's own
loopback, whose state outlives an episode: connections in TIME_WAIT for a minute, and the
interface's and the TCP stack's counters, which code could set for the next episode to read.
``clone3`` answers ENOSYS rather than EPERM, so that glibc falls back to ``clone``, whose flags
the filter can read (clone3 passes them in memory). The calls that set scheduling, affinity,
priorities or rlimits of a process reach any process of the caller's uid but PID 1 (``NOT_PID_1``):
the warden's state is what every later kernel inherits. Memory calls only without their huge-page
flags (``NO_HUGETLB``: the host's reserved pool). Only the 64-bit ABIs (``ARCHITECTURES``): the 32-bit
compat ABI's multiplexers would bypass every argument rule. Names a kernel or architecture lacks are
skipped by the runtime.
"""

from __future__ import annotations

import errno
import json

CLONE_NAMESPACE_FLAGS = 0x7E020000
"""CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET."""

SOCKET_FAMILIES = {"AF_UNIX": 1, "AF_NETLINK": 16}
INET_FAMILIES = {"AF_INET": 2, "AF_INET6": 10}

ALLOWED = (
    # files and directories
    "access", "chdir", "chmod", "chown", "chown32", "close", "close_range", "copy_file_range", "creat",
    "dup", "dup2", "dup3", "faccessat", "faccessat2", "fadvise64", "fadvise64_64", "fallocate",
    "fchdir", "fchmod", "fchmodat", "fchmodat2", "fchown", "fchown32", "fchownat", "fcntl", "fcntl64",
    "fdatasync", "fgetxattr", "flistxattr", "flock", "fremovexattr", "fsetxattr", "fstat", "fstat64",
    "fstatat64", "fstatfs", "fstatfs64", "fsync", "ftruncate", "ftruncate64", "futimesat", "getcwd",
    "getdents", "getdents64", "getxattr", "ioctl", "lchown", "lchown32", "lgetxattr", "link", "linkat", "listxattr",
    "llistxattr", "_llseek", "lremovexattr", "lseek", "lsetxattr", "lstat", "lstat64", "mkdir",
    "mkdirat", "mknod", "mknodat", "newfstatat", "open", "openat", "openat2", "pipe", "pipe2",
    "pread64", "preadv", "preadv2", "pwrite64", "pwritev", "pwritev2", "read", "readahead",
    "readlink", "readlinkat", "readv", "removexattr", "rename", "renameat", "renameat2", "rmdir",
    "sendfile", "sendfile64", "setxattr", "splice", "stat", "stat64", "statfs", "statfs64", "statx",
    "symlink", "symlinkat", "sync", "sync_file_range", "sync_file_range2", "syncfs", "tee",
    "truncate", "truncate64", "umask", "unlink", "unlinkat", "utime", "utimensat",
    "utimensat_time64", "utimes", "write", "writev", "getxattrat", "setxattrat", "listxattrat",
    "removexattrat", "arm_fadvise64_64", "arm_sync_file_range",
    # memory
    "brk", "madvise", "membarrier", "mincore", "mlock", "mlock2", "mlockall", "mprotect", "mremap", "msync", "munlock", "munlockall", "munmap", "pkey_alloc",
    "pkey_free", "pkey_mprotect", "remap_file_pages", "get_mempolicy", "mseal", "map_shadow_stack",
    "cachestat", "getrandom",
    # processes, threads, scheduling
    "arch_prctl", "capget", "capset", "execve", "execveat", "exit", "exit_group", "fork", "vfork", "futex",
    "futex_time64", "futex_waitv", "get_robust_list", "set_robust_list", "get_thread_area",
    "set_thread_area", "set_tid_address", "getcpu", "getegid", "getegid32", "geteuid", "geteuid32",
    "getgid", "getgid32", "getgroups", "getgroups32", "getpgid", "getpgrp", "getpid", "getppid",
    "getpriority", "getresgid", "getresgid32", "getresuid", "getresuid32", "getrlimit", "getrusage",
    "getsid", "gettid", "getuid", "getuid32", "ioprio_get", "prctl",
    "rseq", "sched_getaffinity", "sched_getattr", "sched_getparam", "sched_get_priority_max",
    "sched_get_priority_min", "sched_getscheduler", "sched_rr_get_interval",
    "sched_rr_get_interval_time64", "sched_yield", "seccomp", "setfsgid", "setfsgid32", "setfsuid",
    "setfsuid32", "setgid", "setgid32", "setgroups", "setgroups32", "setpgid",
    "setregid", "setregid32", "setresgid", "setresgid32", "setresuid", "setresuid32", "setreuid",
    "setreuid32", "setrlimit", "setsid", "setuid", "setuid32", "ugetrlimit", "uname", "sysinfo",
    "times", "wait4", "waitid", "waitpid", "pidfd_open", "pidfd_send_signal", "set_tls",
    "cacheflush", "breakpoint", "riscv_flush_icache", "uretprobe",
    # signals and time
    "alarm", "clock_getres", "clock_getres_time64", "clock_gettime", "clock_gettime64",
    "clock_nanosleep", "clock_nanosleep_time64", "getitimer", "gettimeofday", "kill", "nanosleep",
    "pause", "restart_syscall", "rt_sigaction", "rt_sigpending", "rt_sigprocmask", "rt_sigqueueinfo",
    "rt_sigreturn", "rt_sigsuspend", "rt_sigtimedwait", "rt_sigtimedwait_time64",
    "rt_tgsigqueueinfo", "setitimer", "sigaltstack", "signalfd", "signalfd4", "sigprocmask",
    "sigreturn", "tgkill", "time", "timer_create", "timer_delete", "timer_getoverrun",
    "timer_gettime", "timer_gettime64", "timer_settime", "timer_settime64", "timerfd_create",
    "timerfd_gettime", "timerfd_gettime64", "timerfd_settime", "timerfd_settime64", "tkill",
    # waiting on descriptors
    "epoll_create", "epoll_create1", "epoll_ctl", "epoll_ctl_old", "epoll_pwait", "epoll_pwait2",
    "epoll_wait", "epoll_wait_old", "eventfd", "eventfd2", "poll", "ppoll", "ppoll_time64",
    "pselect6", "pselect6_time64", "select", "_newselect",
    # sockets (the families are filtered below)
    "accept", "accept4", "bind", "connect", "getpeername", "getsockname", "getsockopt", "listen",
    "recv", "recvfrom", "recvmmsg", "recvmmsg_time64", "recvmsg", "send", "sendmmsg", "sendmsg",
    "sendto", "setsockopt", "shutdown",
    # System V IPC (namespaced, emptied between episodes)
    "msgctl", "msgget", "msgrcv", "msgsnd",
    "semctl", "semget", "semop", "semtimedop", "semtimedop_time64", "shmat", "shmctl", "shmdt",
)  # fmt: skip

DENIED = (
    "ptrace", "process_vm_readv", "process_vm_writev", "process_madvise", "pidfd_getfd", "kcmp",
    "io_uring_setup", "io_uring_enter", "io_uring_register", "bpf", "perf_event_open",
    "userfaultfd", "keyctl", "add_key", "request_key", "mount", "umount", "umount2", "mount_setattr",
    "move_mount", "open_tree", "fsopen", "fsconfig", "fsmount", "fspick", "pivot_root", "chroot",
    "unshare", "setns", "personality", "syslog", "open_by_handle_at", "name_to_handle_at",
    "fanotify_init", "fanotify_mark", "quotactl", "quotactl_fd", "acct", "swapon", "swapoff",
    "reboot", "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module",
    "iopl", "ioperm", "vm86", "vm86old", "modify_ldt", "uselib", "ustat", "sysfs", "_sysctl",
    "lookup_dcookie", "nfsservctl", "vhangup", "settimeofday", "stime", "clock_settime",
    "clock_settime64", "clock_adjtime", "clock_adjtime64", "adjtimex", "sethostname",
    "setdomainname", "mbind", "set_mempolicy", "set_mempolicy_home_node", "migrate_pages",
    "move_pages", "memfd_secret", "landlock_create_ruleset", "landlock_add_rule",
    "landlock_restrict_self", "lsm_get_self_attr", "lsm_set_self_attr", "lsm_list_modules",
    "io_setup", "io_submit", "io_getevents", "io_pgetevents", "io_pgetevents_time64", "io_cancel",
    "io_destroy", "inotify_init", "inotify_init1", "inotify_add_watch", "inotify_rm_watch", "mq_open",
    "mq_unlink", "mq_timedsend", "mq_timedsend_time64", "mq_timedreceive", "mq_timedreceive_time64",
    "mq_notify", "mq_getsetattr",
)  # fmt: skip
"""What a notebook never calls and an attacker wants (tracing or reading other processes, kernel
attack surface, namespaces and mounts, the host's clock and identity; and what counts against a pool
the host shares with every sandbox: Linux AIO contexts, against the host-wide ``fs.aio-max-nr`` (two
sandboxes took all of it), inotify instances and POSIX message queues, against per-user quotas, which a
uid of its own per sandbox already separates): refused, named so that tests check each one.
Everything absent from ``ALLOWED`` is refused the same way."""

NOT_PID_1 = ("sched_setattr", "sched_setscheduler", "sched_setparam", "sched_setaffinity", "prlimit64")
"""Calls that may change a process's scheduling, affinity or rlimits: allowed for the caller and its
own processes, never for PID 1, the warden, from which every later kernel of the container forks and
inherits them (state that would outlive the episode). Their first argument is the pid (0: the caller)."""
NO_HUGETLB = {"mmap": (3, 0x40000), "memfd_create": (1, 0x4), "shmget": (2, 0x800)}
"""Calls allowed only without their huge-page flag ({name: (argument index, flag)}: ``MAP_HUGETLB``,
``MFD_HUGETLB``, ``SHM_HUGETLB``): huge pages come from the host's reserved pool
(``vm.nr_hugepages``), outside the container's memory limit, so one sandbox could take all of them
(it did: 8 of 8 reserved pages) from the host and every other sandbox."""

ARCHITECTURES = ("SCMP_ARCH_X86_64", "SCMP_ARCH_AARCH64")
"""The only ABIs a sandboxed process may call the kernel through. No 32-bit compat ABI: a 64-bit
process can still enter it (``int 0x80``), and there the multiplexers ``socketcall`` and ``ipc``
pass their arguments in memory, which no filter reads, so any socket family was reachable (an IPv4
and an ``AF_VSOCK`` socket were made without a network); compat syscalls of another ABI are
refused whatever their name."""

PRIO_PROCESS, IOPRIO_WHO_PROCESS = 0, 1
"""``setpriority`` and ``ioprio_set`` are allowed only for one process that is not PID 1: by group or by
user (all processes of the sandbox's uid, the warden's too) they would reach the warden."""


def profile(inet: bool = False) -> dict:
    """The profile in Docker's seccomp JSON format; ``inet``: IPv4 and IPv6 sockets allowed."""
    allowed = set(ALLOWED)
    assert not allowed & set(DENIED), sorted(allowed & set(DENIED))
    rules: list[dict] = [{"names": sorted(allowed), "action": "SCMP_ACT_ALLOW"}]
    rules.append(
        {
            "names": ["clone"],
            "action": "SCMP_ACT_ALLOW",
            "args": [{"index": 0, "value": CLONE_NAMESPACE_FLAGS, "valueTwo": 0, "op": "SCMP_CMP_MASKED_EQ"}],
        }
    )
    rules.append({"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": errno.ENOSYS})
    rules.append(
        {
            "names": list(NOT_PID_1),
            "action": "SCMP_ACT_ALLOW",
            "args": [{"index": 0, "value": 1, "op": "SCMP_CMP_NE"}],
        }
    )
    for call, (index, flag) in NO_HUGETLB.items():
        rules.append(
            {
                "names": [call],
                "action": "SCMP_ACT_ALLOW",
                "args": [{"index": index, "value": flag, "valueTwo": 0, "op": "SCMP_CMP_MASKED_EQ"}],
            }
        )
    for call, which in (("setpriority", PRIO_PROCESS), ("ioprio_set", IOPRIO_WHO_PROCESS)):
        rules.append(
            {
                "names": [call],
                "action": "SCMP_ACT_ALLOW",
                "args": [
                    {"index": 0, "value": which, "op": "SCMP_CMP_EQ"},
                    {"index": 1, "value": 1, "op": "SCMP_CMP_NE"},
                ],
            }
        )
    sockets = [*SOCKET_FAMILIES.values(), *(INET_FAMILIES.values() if inet else ())]
    for call, families in (("socket", sockets), ("socketpair", [SOCKET_FAMILIES["AF_UNIX"]])):
        rules += [
            {
                "names": [call],
                "action": "SCMP_ACT_ALLOW",
                "args": [{"index": 0, "value": f, "op": "SCMP_CMP_EQ"}],
            }
            for f in families
        ]
    return {
        "defaultAction": "SCMP_ACT_ERRNO",
        "defaultErrnoRet": errno.EPERM,
        "architectures": list(ARCHITECTURES),
        "syscalls": rules,
    }


def security_opt(inet: bool = False) -> str:
    """The ``security_opt`` entry that puts the profile on a container."""
    return "seccomp=" + json.dumps(profile(inet), separators=(",", ":"))
