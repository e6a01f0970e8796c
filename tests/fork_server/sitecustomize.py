"""Hands this process's script to the tests' fork server (server.py beside this file) when one is
running (POSENC_TEST_FORK_SERVER names its socket) and it serves the script; otherwise, or if the
server cannot be reached, the script runs here as usual. Only the tests put this file on the path."""
import os
import sys


def _run_in_fork_server():
    address = os.environ.get("POSENC_TEST_FORK_SERVER")
    if not address or not sys.argv or sys.argv[0] in ("", "-c", "-m") or not os.path.isfile(sys.argv[0]):
        return
    import json
    import socket
    import struct

    request = json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "environ": dict(os.environ),
                          "facts": startup_facts()}).encode()
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        connection.connect(address)
        socket.send_fds(connection, [struct.pack("!I", len(request)) + request], [0, 1, 2])
        answer = b""
        while True:
            more = connection.recv(4096)
            if not more:
                break
            answer += more
    except OSError:
        return
    result = json.loads(answer) if answer else {"fallback": True}
    if result.get("fallback"):
        return
    code = result["exit"]
    if code < 0:
        import signal
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code)


def startup_facts():
    """What must be equal between a caller and the server for a fork to equal a new process: the
    environment variables read when Python, torch or OpenMP start, the interpreter and its options."""
    return {"environ": {key: value for key, value in os.environ.items()
                        if key.startswith(STARTUP_VARIABLES) and key not in NOT_READ_AT_START},
            "executable": sys.executable, "warnoptions": list(sys.warnoptions), "xoptions": dict(sys._xoptions),
            "flags": list(sys.flags)}


STARTUP_VARIABLES = ("PYTHON", "OMP_", "MKL_", "KMP_", "GOMP_", "TORCH", "PYTORCH", "CUDA", "NCCL", "LD_")
#: names under those prefixes that nothing reads at start-up. PYTHON: a script's name for its interpreter
#: (examples/claims/short_to_long.py hands it to its shell script). TORCHINDUCTOR_CACHE_DIR: read when
#: torch compiles, from the environment the fork has then (the caller's); torch sets it in a test worker's
#: own environment at its first compile, which every command that worker starts afterwards inherits.
NOT_READ_AT_START = ("PYTHON", "TORCHINDUCTOR_CACHE_DIR")
_run_in_fork_server()
