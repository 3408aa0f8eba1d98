"""Confining the current process before it runs model code: rlimits, no dumps, a syscall
filter.

Called by a process on itself: the sandboxed model child (`servemesh.sandbox.child`) after
its imports and before the first byte of a model is parsed, a model server after its first
models loaded (`services/model/app.py`). Irreversible: nothing undoes a seccomp
filter, and the limits are lowered hard and soft alike.

The syscall filter is libseccomp's, through its ctypes binding (`pyseccomp`, API
compatible with libseccomp's own Python module, which is packaged for the system Python
only). It allows by default and refuses by name, so torch, numpy and the interpreter keep
working unchanged, and forbids what a model process never needs:

- new processes and programs: fork, vfork, clone without CLONE_THREAD (threads stay
  allowed: torch's intra-op pool), clone3 (ENOSYS, so the C library falls back to clone,
  whose flags the filter can read), execve, execveat;
- the network and other processes: socket, socketpair, connect, bind, listen, ptrace,
  process_vm_readv/writev, kill and tgkill of any process but itself;
- writing to the file system: open/openat with any of O_WRONLY, O_RDWR, O_CREAT,
  O_TRUNC, O_APPEND; creat, openat2 (ENOSYS: its flags sit in a struct), rename, link,
  unlink, mkdir, chmod, chown, truncate, mknod, memfd_create;
- the kernel's bigger levers: mount, unshare, setns, chroot, pivot_root, bpf,
  perf_event_open, userfaultfd, keyctl, module and kexec loading.

Reading files stays allowed (torch reads its own libraries and /proc lazily); what a model
process may read is decided by the user it runs as (servemesh.procs.sandbox).

A model server is also a gRPC server: it reconnects to the registry and the trace store,
writes its shadow ledger and fault acknowledgements. Its profile ("server") keeps sockets
and file writes open and forbids the rest above, each call failing with EPERM
(docs/security.md says what that leaves a model).
"""

from __future__ import annotations

import ctypes
import errno
import os
import resource
from dataclasses import dataclass
from typing import Any, Literal

from servemesh.contract.errors import ServemeshError

_PR_SET_DUMPABLE = 4
_PR_SET_NO_NEW_PRIVS = 38
_CLONE_THREAD = 0x00010000
_WRITE_FLAGS = (os.O_WRONLY, os.O_RDWR, os.O_CREAT, os.O_TRUNC, os.O_APPEND)

GIB = 1 << 30
# Calls no process that runs model code ever needs: new programs and processes, other
# processes' memory, the kernel's bigger levers.
PROCESS_LEVEL = (
    "fork", "vfork", "execve", "execveat", "ptrace", "process_vm_readv", "process_vm_writev",
    "mount", "umount2", "unshare", "setns", "chroot", "pivot_root", "bpf", "perf_event_open",
    "userfaultfd", "keyctl", "add_key", "request_key", "init_module", "finit_module",
    "delete_module", "kexec_load", "kexec_file_load",
)  # fmt: skip
# The network: a process that only runs the model has its pipe and nothing else.
NETWORK = ("socket", "socketpair", "connect", "bind", "listen")
# Changing the file system: names, modes, owners, sizes, special files.
FILE_SYSTEM = (
    "creat", "rename", "renameat", "renameat2", "link", "linkat", "symlink", "symlinkat",
    "unlink", "unlinkat", "mkdir", "mkdirat", "rmdir", "chmod", "fchmod", "fchmodat",
    "chown", "fchown", "fchownat", "lchown", "truncate", "ftruncate", "mknod", "mknodat",
    "memfd_create",
)  # fmt: skip
# What a model server must keep of FILE_SYSTEM: its ledger rotates by rename, and its
# acknowledgements are written as a new file (mode set on its descriptor) renamed into place.
SERVER_FILE_WRITES = (
    "rename", "renameat", "renameat2", "unlink", "unlinkat", "mkdir", "mkdirat", "fchmod",
)  # fmt: skip
# Calls whose arguments the filter cannot read (they sit in a struct): answered "not
# implemented", which the C library takes as a cue to use the older call the filter reads.
NOT_IMPLEMENTED = ("clone3", "openat2")


@dataclass(frozen=True, kw_only=True)
class SandboxPolicy:
    """The walls around a process that runs model code.

    | wall | setting | why |
    | --- | --- | --- |
    | address space | `address_space_bytes` (RLIMIT_AS) | a model cannot take the host's memory |
    | file size | `file_size_bytes` (RLIMIT_FSIZE; None: as is) | nothing big is written |
    | core dumps | always 0 (RLIMIT_CORE) | a crash leaves no image of the process |
    | open files | `open_files` (RLIMIT_NOFILE) | a model cannot hoard descriptors |
    | syscalls | `profile`, `violation` | what is forbidden, and what a forbidden call gets |

    `profile`: "model" (a process that runs the model and nothing else: every call below
    forbidden, its pipe its only way out) or "server" (a model server: the network and
    file writes stay open, for its own gRPC and files; processes, programs, ptrace, other
    processes' memory, signals to others, modes and owners, the kernel's levers closed).

    `violation`: "kill" ends the whole process with SIGSYS at the first forbidden call (a
    process that runs nothing but the model: the caller sees the signal and says why);
    "errno" fails the call with EPERM and lets the process go on (a process that also runs
    code of ours, which must survive a model that tries). File writes get EPERM either
    way: benign code may try them (a cache) and go on.
    """

    # torch's CPU build maps about 1 GiB of address space at import; a model's weights and
    # a batch's activations come on top, and a server's threads each map an arena.
    address_space_bytes: int = 16 * GIB
    # None: left as is (a server's log is a file it appends to through its stdout).
    file_size_bytes: int | None = 0
    # None: left as is (a server's connections and Envoy's health checks each hold one).
    open_files: int | None = 256
    profile: Literal["model", "server"] = "model"
    violation: Literal["kill", "errno"] = "kill"

    def __post_init__(self) -> None:
        if self.address_space_bytes < GIB:
            raise ValueError("address_space_bytes: at least 1 GiB (torch maps ~1 GiB at import)")
        if self.file_size_bytes is not None and self.file_size_bytes < 0:
            raise ValueError("file_size_bytes: 0 or more")
        if self.open_files is not None and not 16 <= self.open_files <= 1 << 20:
            raise ValueError("open_files: between 16 and 1048576")


class ConfineError(ServemeshError, RuntimeError):
    """The process could not be confined; it must not run model code."""


def server_policy(address_space_bytes: int) -> SandboxPolicy:
    """The walls a model server puts up around itself once its first models loaded."""
    return SandboxPolicy(
        address_space_bytes=address_space_bytes,
        file_size_bytes=None,
        open_files=None,
        profile="server",
        violation="errno",
    )


def confine(policy: SandboxPolicy) -> None:
    """Apply `policy` to this process: rlimits, no core dumps or ptrace by its own user,
    no new privileges, then the syscall filter. ConfineError when any step fails."""
    rules = syscall_filter(policy)  # built first: its import may run a helper program
    _lower(resource.RLIMIT_AS, policy.address_space_bytes)
    if policy.file_size_bytes is not None:
        _lower(resource.RLIMIT_FSIZE, policy.file_size_bytes)
    _lower(resource.RLIMIT_CORE, 0)
    if policy.open_files is not None:
        _lower(resource.RLIMIT_NOFILE, policy.open_files)
    # Not dumpable: no core file, and /proc/<pid>/mem, environ and ptrace are closed to
    # every process of the same user but root.
    _prctl(_PR_SET_DUMPABLE, 0)
    _prctl(_PR_SET_NO_NEW_PRIVS, 1)
    try:
        rules.load()
    except OSError as exc:
        raise ConfineError(f"the syscall filter did not load: {exc}") from None


def syscall_filter(policy: SandboxPolicy) -> Any:
    """The filter `confine` loads (a pyseccomp SyscallFilter), not yet loaded."""
    try:
        # Its import looks for libc and libseccomp with ldconfig: a helper program, which
        # the filter forbids once loaded.
        import pyseccomp as seccomp
    except (ImportError, OSError) as exc:  # OSError: libseccomp.so.2 is missing
        raise ConfineError(
            f"the syscall filter needs libseccomp (Debian: libseccomp2): {exc}"
        ) from None
    deny = seccomp.KILL_PROCESS if policy.violation == "kill" else seccomp.ERRNO(errno.EPERM)
    refuse = seccomp.ERRNO(errno.EPERM)
    server = policy.profile == "server"
    rules = seccomp.SyscallFilter(seccomp.ALLOW)
    for name in PROCESS_LEVEL:
        rules.add_rule(deny, name)
    for name in NOT_IMPLEMENTED:
        rules.add_rule(seccomp.ERRNO(errno.ENOSYS), name)
    rules.add_rule(deny, "clone", seccomp.Arg(0, seccomp.MASKED_EQ, _CLONE_THREAD, 0))
    me = os.getpid()
    # Signals to itself (and its own threads) only. One rule may test an argument once, so
    # "not me" is two rules; pids compare unsigned, so -1 and process groups are above.
    for call in ("kill", "tgkill"):
        rules.add_rule(deny, call, seccomp.Arg(0, seccomp.GT, me))
        rules.add_rule(deny, call, seccomp.Arg(0, seccomp.LT, me))
    for name in FILE_SYSTEM:
        if not (server and name in SERVER_FILE_WRITES):
            rules.add_rule(refuse, name)
    if server:
        return rules
    for name in NETWORK:
        rules.add_rule(deny, name)
    for flag in _WRITE_FLAGS:
        rules.add_rule(refuse, "open", seccomp.Arg(1, seccomp.MASKED_EQ, flag, flag))
        rules.add_rule(refuse, "openat", seccomp.Arg(2, seccomp.MASKED_EQ, flag, flag))
    return rules


def _lower(limit: int, value: int) -> None:
    _, hard = resource.getrlimit(limit)
    target = value if hard == resource.RLIM_INFINITY else min(value, hard)
    try:
        resource.setrlimit(limit, (target, target))
    except (ValueError, OSError) as exc:
        raise ConfineError(f"rlimit {limit}: cannot lower to {value}: {exc}") from None


def _prctl(option: int, value: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(option, value, 0, 0, 0) != 0:
        code = ctypes.get_errno()
        raise ConfineError(f"prctl({option}, {value}): {os.strerror(code)}")
