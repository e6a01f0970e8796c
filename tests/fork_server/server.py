"""A Python with torch and fairseq already imported, for the commands the tests run.

Each fairseq command (`fairseq-train`, ...) spends seconds importing torch and fairseq before it does
anything: most of a tiny test run. The test session starts this server once per pytest-xdist worker
(tests/conftest.py); every Python process the tests start has `sitecustomize.py` beside this file on
its path, which hands the command to the server when it is one the server serves. The server forks a
copy of itself per command; the copy takes the caller's stdin, stdout and stderr, working directory,
environment and argv, and runs the script as `python SCRIPT` would. The caller then exits with the
copy's exit status (or its signal), so to the test it is the command's own process.

What makes the fork the same as a new process:
- only what the server imported is shared: torch and fairseq's packages, whose import depends on
  nothing but the interpreter and the environment (the variables the import sets are set again in
  each fork). A command that differs from the server in
  anything read at start-up (sitecustomize's `startup_facts`: such environment variables, the
  interpreter and its options) runs as a new process instead;
- fairseq's commands configure the root logger when their module is imported, before they import
  fairseq: the fork puts the root logger back to a new interpreter's (importing fairseq configures
  it) and leaves `fairseq_cli` unimported, so each command configures it itself;
- signal dispositions are a new interpreter's; the script runs through `runpy` as `__main__`, with
  its directory first on `sys.path`; atexit functions and non-daemon threads end it as they would.
A caller that dies (a test's timeout) takes its command's whole process group with it.
"""
import json
import logging
import os
import select
import signal
import socket
import struct
import sys
import traceback

from sitecustomize import startup_facts  # this directory is first on the server's path

HEADER = struct.Struct("!I")


def serves(script, roots):
    """The scripts worth a fork: fairseq's commands and the repository's own scripts."""
    # (a venv reached through a linked folder is the same venv; its python itself is a link)
    folder, name = os.path.split(os.path.abspath(script))
    if name.startswith("fairseq-") and os.path.realpath(folder) == os.path.realpath(os.path.dirname(sys.executable)):
        return True
    path = os.path.realpath(script)
    return path.endswith(".py") and any(path.startswith(root + os.sep) for root in roots)


def receive(connection):
    """One request: (fds of the caller's stdin/stdout/stderr, the request's fields)."""
    data, fds, _, _ = socket.recv_fds(connection, 1 << 16, 3)
    if not data:
        return None, None
    size = HEADER.unpack_from(data)[0]
    while len(data) < HEADER.size + size:
        more = connection.recv(1 << 16)
        if not more:
            return None, None
        data += more
    return fds, json.loads(data[HEADER.size:HEADER.size + size])


def reply(connection, **fields):
    connection.sendall(json.dumps(fields).encode())


def as_new_process(request, fds):
    """In the command's own fork: become the caller's process, run its script, exit as Python would."""
    os.setpgid(0, 0)
    for signum in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_DFL)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["environ"])
    script = request["argv"][0]
    sys.argv = list(request["argv"])
    sys.path[0] = os.path.dirname(os.path.realpath(script))
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    root.setLevel(logging.WARNING)

    import atexit
    import runpy
    import threading

    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as done:
        if done.code is None:
            code = 0
        elif isinstance(done.code, int):
            code = done.code & 0xFF
        else:
            print(done.code, file=sys.stderr)
            code = 1
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(code)


def supervise(connection, request, fds):
    """Fork the command, wait for it, report its exit status; kill it if the caller goes away."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    command = os.fork()
    if command == 0:
        try:
            connection.close()
            as_new_process(request, fds)
        except BaseException:  # before its script started: say why, as a new process would
            traceback.print_exc()
            os._exit(1)
    for fd in fds:
        os.close(fd)
    ended = os.pidfd_open(command)
    while True:
        ready, _, _ = select.select([ended, connection], [], [])
        if ended in ready:
            break
        if not connection.recv(1):  # the caller died: so does its command, children included
            try:
                os.killpg(command, signal.SIGKILL)
            except ProcessLookupError:
                pass
            os.waitpid(command, 0)
            os._exit(0)
    _, status = os.waitpid(command, 0)
    try:
        reply(connection, exit=os.waitstatus_to_exitcode(status))
    except OSError:
        pass
    os._exit(0)


def serve(address, roots):
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(address)
    listener.listen(128)  # callers wait here while the imports below run
    facts, environ = startup_facts(), dict(os.environ)
    import torch  # noqa: F401
    import fairseq  # noqa: F401
    import fairseq.checkpoint_utils  # noqa: F401
    import fairseq.options  # noqa: F401
    import fairseq.sequence_generator  # noqa: F401
    import fairseq.trainer  # noqa: F401

    # what importing them sets in the environment (KMP_* by torch, for one) a new process sets too
    imports_set = {key: value for key, value in os.environ.items() if environ.get(key) != value}
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # supervisors are reaped without waiting
    sys.stdout.flush()
    sys.stderr.flush()
    while True:
        connection, _ = listener.accept()
        try:
            take(connection, listener, facts, imports_set, roots)
        except Exception:  # one caller's failure is logged and ends no other command
            traceback.print_exc()
        finally:
            connection.close()


def describe(differs, theirs, ours):
    """The facts that differ, start-up environment variables by name."""
    named = []
    for key in differs:
        if key == "environ":
            theirs_env, ours_env = theirs.get(key) or {}, ours[key]
            named += sorted(name for name in set(theirs_env) | set(ours_env) if theirs_env.get(name) != ours_env.get(name))
        else:
            named.append(key)
    return named


def take(connection, listener, facts, imports_set, roots):
    """Answer one caller: fork its command, or tell it to run the script itself."""
    fds, request = receive(connection)
    if request is None:
        return
    try:
        differs = [key for key in facts if request["facts"].get(key) != facts[key]]
        if differs or not serves(request["argv"][0], roots):
            # the reason, for whoever debugs (also in server.log): the caller only runs the script itself
            reason = f"differs in {describe(differs, request['facts'], facts)}" if differs else "not served"
            print(f"fallback: {request['argv'][0]}: {reason}", file=sys.stderr, flush=True)
            reply(connection, fallback=reason)
            return
        if os.fork() == 0:
            try:
                listener.close()
                supervise(connection, dict(request, environ=dict(request["environ"], **imports_set)), fds)
            finally:
                os._exit(1)
    finally:
        for fd in fds:
            os.close(fd)


if __name__ == "__main__":
    serve(sys.argv[1], [os.path.realpath(root) for root in sys.argv[2:]])
