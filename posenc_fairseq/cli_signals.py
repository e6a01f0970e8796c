"""SIGTERM (kill, a job scheduler's stop) ends a command-line run as Ctrl-C does.

Python's default for SIGTERM ends the process at once: no `finally`, no `except KeyboardInterrupt`, so a
run killed while writing leaves its temporary files and half-built folders. Raised as KeyboardInterrupt
instead, the run's own clean-up for Ctrl-C removes them. Installed by the scripts' `__main__` (tests call
their `main` in the test process, which keeps its own handler).
"""
import signal


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def end_on_terminate():
    """From now on SIGTERM raises KeyboardInterrupt in the main thread."""
    signal.signal(signal.SIGTERM, _interrupt)
