"""The tests' fork server (tests/fork_server) runs a script as a new Python process would: the same
output, exit status, arguments, working directory, environment and standard input; a caller whose
start-up environment differs runs its script itself; a caller that dies takes its command along."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import fork_server
from util import BIN, command_env

PROBE = r'''
import json, os, sys
print(json.dumps({"preloaded": "torch" in sys.modules, "argv": sys.argv[1:], "cwd": os.getcwd(),
                  "variable": os.environ.get("PROBE_VARIABLE"), "stdin": sys.stdin.read(),
                  "path0": sys.path[0], "name": __name__}))
print("to stderr", file=sys.stderr)
how = sys.argv[1]
if how == "code":
    sys.exit(3)
if how == "message":
    sys.exit("a message")
if how == "raise":
    raise ValueError("raised")
if how == "signal":
    sys.stdout.flush()
    os.kill(os.getpid(), __import__("signal").SIGTERM)
if how == "sleep":
    open(sys.argv[2], "w").write(str(os.getpid()))
    import time
    time.sleep(60)
'''


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(a folder whose scripts the server serves, with probe.py in it; the callers' environment)."""
    scripts = tmp_path_factory.mktemp("served")
    (scripts / "probe.py").write_text(PROBE)
    server, callers = fork_server.start(tmp_path_factory.mktemp("server"), command_env(), served=[scripts])
    yield scripts, dict(command_env(), **callers)
    fork_server.stop(server)


def server_log(callers):
    return (Path(callers["POSENC_TEST_FORK_SERVER"]).parent / "server.log").read_text()


def new_process_env(**variables):
    """The commands' environment without a fork server (the session's, conftest.py, included)."""
    environ = dict(command_env(), **variables)
    environ.pop("POSENC_TEST_FORK_SERVER", None)
    return environ


def probe(scripts, environ, *argv, stdin="", **kwargs):
    done = subprocess.run([sys.executable, str(scripts / "probe.py"), *argv], input=stdin, capture_output=True,
                          text=True, env=environ, cwd=scripts.parent, timeout=120, **kwargs)
    facts = json.loads(done.stdout.splitlines()[0]) if done.stdout else None
    return done, facts


@pytest.mark.parametrize("how", ["ok", "code", "message", "raise", "signal"])
def test_a_served_script_runs_as_a_new_process_would(served, how):
    scripts, callers = served
    forked, forked_facts = probe(scripts, dict(callers, PROBE_VARIABLE="x"), how, "more", stdin="input")
    new, new_facts = probe(scripts, new_process_env(PROBE_VARIABLE="x"), how, "more", stdin="input")
    assert forked_facts.pop("preloaded") and not new_facts.pop("preloaded")
    assert forked_facts == new_facts == {"argv": [how, "more"], "cwd": str(scripts.parent), "variable": "x",
                                         "stdin": "input", "path0": str(scripts), "name": "__main__"}
    assert forked.returncode == new.returncode
    assert forked.stdout.splitlines()[1:] == new.stdout.splitlines()[1:]
    assert forked.returncode == {"ok": 0, "code": 3, "message": 1, "raise": 1, "signal": -signal.SIGTERM}[how]
    # a traceback names the file and line in both; only what precedes it may differ
    assert forked.stderr.splitlines()[-2:] == new.stderr.splitlines()[-2:]


def test_a_fairseq_command_gives_what_the_new_process_gives(served):
    _, callers = served
    command = [str(BIN / "fairseq-train"), "--arch", "no_such_arch", "/nonexistent"]
    forked = subprocess.run(command, capture_output=True, text=True, env=callers, timeout=120)
    new = subprocess.run(command, capture_output=True, text=True, env=new_process_env(), timeout=120)
    assert forked.returncode == new.returncode == 2
    assert (forked.stdout, forked.stderr) == (new.stdout, new.stderr)


def test_another_start_up_environment_runs_the_script_itself(served):
    scripts, callers = served
    _, facts = probe(scripts, dict(callers, OMP_NUM_THREADS="3"), "ok")
    assert not facts["preloaded"]
    # the server names what differed, for whoever finds a test slower than it should be
    assert f"fallback: {scripts / 'probe.py'}: differs in ['OMP_NUM_THREADS']" in server_log(callers)


def test_a_variable_named_python_is_no_start_up_setting(served):
    """PYTHON alone (a script's name for its interpreter) is read by no interpreter: still served;
    PYTHONHASHSEED is."""
    scripts, callers = served
    assert probe(scripts, dict(callers, PYTHON=sys.executable), "ok")[1]["preloaded"]
    assert not probe(scripts, dict(callers, PYTHONHASHSEED="7"), "ok")[1]["preloaded"]


def test_a_fairseq_command_through_a_linked_venv_folder_is_served(served, tmp_path):
    """The README's commands run in a folder whose .venv links to the repository's: the same venv."""
    _, callers = served
    (tmp_path / "venv").symlink_to(BIN.parent)
    command = [str(tmp_path / "venv" / "bin" / "fairseq-train"), "--arch", "no_such_arch", "/nonexistent"]
    forked = subprocess.run(command, capture_output=True, text=True, env=callers, timeout=120)
    assert forked.returncode == 2 and "invalid choice: 'no_such_arch'" in forked.stderr
    assert command[0] not in server_log(callers)  # no fallback


def test_a_caller_that_dies_takes_its_command_along(served, tmp_path):
    scripts, callers = served
    pid_file = tmp_path / "pid"
    with pytest.raises(subprocess.TimeoutExpired):
        subprocess.run([sys.executable, str(scripts / "probe.py"), "sleep", str(pid_file)], env=callers,
                       capture_output=True, timeout=10)
    command = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and os.path.exists(f"/proc/{command}"):
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{command}")
