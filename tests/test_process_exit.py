"""The CLI's exit skips the interpreter's teardown but keeps what a normal exit promises."""

import subprocess
import sys
import textwrap

import pytest

EXIT = {"teardown skipped": "from equivcheck.process.exit import exit_without_teardown as leave",
        "bare os._exit": "from os import _exit as leave"}  # the twin: what skipping teardown alone loses


def run(script: str, how: str) -> subprocess.CompletedProcess:
    code = f"{EXIT[how]}\n{textwrap.dedent(script)}"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("how", EXIT)
def test_exit_handlers_run_and_buffered_output_is_kept(tmp_path, how):
    marker = tmp_path / "atexit-ran"
    done = run(f"""
        import atexit, sys
        atexit.register(lambda: open({str(marker)!r}, "w").write("ran"))
        sys.stdout.write("verdict without a newline")  # block-buffered: stdout is a pipe here
        leave(3)
    """, how)
    assert done.returncode == 3
    kept = done.stdout == "verdict without a newline" and marker.exists()
    assert kept is (how == "teardown skipped"), (done.stdout, marker.exists())


@pytest.mark.parametrize("how", EXIT)
def test_a_running_non_daemon_thread_is_waited_for(how):
    done = run("""
        import threading, time
        threading.Thread(target=lambda: (time.sleep(0.3), print("thread finished", flush=True))).start()
        leave(0)
    """, how)
    assert done.returncode == 0
    assert ("thread finished" in done.stdout) is (how == "teardown skipped"), done.stdout
