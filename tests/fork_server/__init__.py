"""The tests' fork server (server.py): `start` runs one, `stop` ends it."""
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
#: the scripts it serves besides fairseq's commands
SERVED = (REPO / "examples", REPO / "scripts")


def start(folder, environ, served=SERVED):
    """Start a server listening in `folder`, for callers whose environment is `environ` (the commands'
    environment: the server must start as they would). Returns (the server's process, the variables
    that make a Python process started with them hand the server its script, if it serves it)."""
    path = os.pathsep.join(filter(None, [str(HERE), environ.get("PYTHONPATH")]))
    address = str(Path(folder) / "socket")
    environ = dict(environ, PYTHONPATH=path)
    environ.pop("POSENC_TEST_FORK_SERVER", None)
    with open(Path(folder) / "server.log", "w") as log:  # what went wrong in the server, if anything
        server = subprocess.Popen([sys.executable, str(HERE / "server.py"), address, *map(str, served)],
                                  env=environ, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                  start_new_session=True)
    # the server binds its socket before it imports torch: callers queue until it is ready
    while not os.path.exists(address):
        if server.poll() is not None:
            raise RuntimeError(f"the fork server exited ({server.returncode})")
        time.sleep(0.01)
    return server, {"PYTHONPATH": path, "POSENC_TEST_FORK_SERVER": address}


def stop(server):
    """End the server; warn if it ended before (its commands then ran as new processes: slower only)."""
    if server.poll() is not None:
        warnings.warn(f"the tests' fork server ended early ({server.returncode}): see server.log beside its socket")
    server.kill()
    server.wait()
