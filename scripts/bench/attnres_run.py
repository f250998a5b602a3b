"""Running the attnres binary from the measurement scripts.

One helper for all of them, so that a failing attnres command ends a script the same way
everywhere: with the whole command and the end of what attnres printed on stderr (its own
one-line error is the last line), instead of a Python traceback.
"""

import subprocess
import sys


def run_attnres(cmd, env=None):
    """Runs `cmd` (a list: the binary, then its arguments) and returns the finished process, its
    stdout and stderr as text. Ends the calling script with a message when the binary cannot be
    started or exits with an error."""
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, env=env)
    except OSError as e:
        sys.exit(f"cannot run {cmd[0]}: {e}")
    if res.returncode != 0:
        sys.exit(f"failed (exit status {res.returncode}): {' '.join(cmd)}\n{res.stderr[-2000:]}")
    return res
