"""Run untrusted programs (model-written code) in a separate, limited process.

Each program gets its own Python process started in isolated mode (``python -I``) with an empty
environment (none of the parent's variables), a fresh temporary working directory that is deleted
afterwards, and a wall-time limit enforced by the parent (the whole process group is killed). A small
launcher runs first inside the child and, before any of the program's code:

- sets resource limits: CPU seconds (``RLIMIT_CPU``), address space (``RLIMIT_AS``, so a memory bomb
  gets ``MemoryError`` instead of taking the machine down), written file size and core dumps;
- cuts the network: it moves the process into a new, empty network namespace
  (``unshare(CLONE_NEWNET)``; even loopback is down there), which needs root or CAP_SYS_ADMIN. Where
  that is not permitted it falls back to replacing Python's socket API with functions that raise, which
  stops ordinary Python code but not a determined program (ctypes can still reach the libc). Which of
  the two is active is reported by ``network_isolation()`` and recorded in each ``ProgramResult``.

This is a guard against accidents in generated code (infinite loops, huge allocations, stray network
or file access), not a security boundary against an adversary: there is no filesystem or syscall
isolation beyond the working directory.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

# The child runs this before the program. argv: program path, CPU seconds, memory bytes, file bytes.
_LAUNCHER = r"""
import ctypes, resource, runpy, sys
program, cpu, memory, fsize = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
CLONE_NEWNET = 0x40000000
isolation = sys.argv[5]
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
sys.stderr.write("\x00sandbox-network:" + isolation + "\n")
sys.stderr.flush()
del ctypes, resource, CLONE_NEWNET
sys.argv = [program]
runpy.run_path(program, run_name="__main__")
"""
_MARKER = "\x00sandbox-network:"


@dataclass(frozen=True)
class Limits:
    """Per-program limits: wall seconds (enforced by the parent), CPU seconds and address space and
    written-file size (enforced by the kernel in the child)."""

    timeout: float = 10.0
    cpu_seconds: int = 10
    memory_mb: int = 1024
    file_mb: int = 16


@dataclass(frozen=True)
class ProgramResult:
    status: str  # "passed" (exit 0), "failed" (non-zero exit), "timeout" (wall limit), "killed" (a signal)
    returncode: int | None
    stdout: str
    stderr: str
    network: str  # "namespace" or "socket-disabled": how the network was cut in this run

    @property
    def passed(self) -> bool:
        return self.status == "passed"


def run_program(code: str, limits: Limits = Limits(), force_socket_fallback: bool = False) -> ProgramResult:
    """Run Python source ``code`` in a fresh sandboxed process; exit status 0 means passed.

    ``force_socket_fallback`` uses the socket-API fallback even where a network namespace is available
    (so the fallback can be tested on machines that have namespaces)."""
    with tempfile.TemporaryDirectory(prefix="fullband-sandbox-") as workdir:
        program = Path(workdir) / "program.py"
        program.write_text(code, encoding="utf-8")
        argv = [sys.executable, "-I", "-c", _LAUNCHER, str(program), str(limits.cpu_seconds),
                str(limits.memory_mb * 2**20), str(limits.file_mb * 2**20),
                "socket-disabled" if force_socket_fallback else "namespace"]
        # start_new_session: the program and anything it spawns form one process group we can kill.
        proc = subprocess.Popen(argv, cwd=workdir, env={}, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True)
        try:
            out, err = proc.communicate(timeout=limits.timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            out, err = proc.communicate()
            timed_out = True
        _kill_group(proc)  # children the program left behind
    stdout = out.decode("utf-8", errors="replace")
    stderr = err.decode("utf-8", errors="replace")
    network = "unknown"
    if stderr.startswith(_MARKER):
        first, _, stderr = stderr.partition("\n")
        network = first.removeprefix(_MARKER)
    if timed_out:
        status = "timeout"
    elif proc.returncode == 0:
        status = "passed"
    elif proc.returncode < 0:
        status = "killed"  # e.g. SIGXCPU/SIGKILL from the CPU limit
    else:
        status = "failed"
    return ProgramResult(status, proc.returncode, stdout, stderr, network)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_programs(codes: Sequence[str], limits: Limits = Limits(), workers: int | None = None) -> list[ProgramResult]:
    """Run many programs, ``workers`` at a time (default: the number of CPUs), results in input order.
    Threads only wait on child processes, so a thread pool is enough for parallelism."""
    workers = workers or os.cpu_count() or 1
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(lambda code: run_program(code, limits), codes))


@lru_cache(maxsize=1)
def network_isolation() -> str:
    """How the sandbox cuts the network on this machine: "namespace" or "socket-disabled"."""
    return run_program("pass", Limits(timeout=30)).network
