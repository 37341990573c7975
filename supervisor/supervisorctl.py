"""`supervisorctl` (the console script) and `python -m vime.supervisor.supervisorctl`: ours, or
supervisord's when the invocation is aimed at it. The rule is in supervisor/client/dispatch.py;
this module stays at its path because scripts and docs name it."""

import sys

from vime.supervisor.client.dispatch import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
