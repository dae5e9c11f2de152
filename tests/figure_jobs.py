"""Module-level calls for tests/test_figure_process.py to send to a figure process."""
import os


def write(path, text, pid=False):
    """Write ``text`` (with ``pid``: the writing process's id) to ``path``."""
    with open(path, "w") as fh:
        fh.write(str(os.getpid()) if pid else text)


def fail(message):
    raise ValueError(message)
