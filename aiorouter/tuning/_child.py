"""A background re-solve's process (`background.BackgroundSolver`): reads a pickled (fn, args) on
stdin, writes the pickled (True, fn(*args)) or (False, the exception) on stdout."""
from __future__ import annotations

import os
import pickle
import sys

from .background import lowest_priority


def main() -> None:
    lowest_priority()
    out = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    sys.stdout = sys.stderr  # anything the solve prints must not mix with the answer
    try:
        fn, args = pickle.load(sys.stdin.buffer)
        answer = (True, fn(*args))
    except BaseException as e:  # everything goes back to the parent, which raises it there
        answer = (False, e)
    try:
        out.write(pickle.dumps(answer))
    except Exception as e:  # (an unpicklable answer or exception)
        out.write(pickle.dumps((False, RuntimeError(f"the background solve's answer could not be pickled: {e!r}"))))
    out.close()


if __name__ == "__main__":
    main()
