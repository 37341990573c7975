"""`python -m vime.supervisor` and the `vime-supervisor` script.

SIGHUP is ignored before anything heavy is imported (a second or two): its default action
would kill a daemon that has no handler yet. The event loop's handler (a reload) replaces it.
"""

import signal
import sys


def main() -> int:
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    from .daemon import main as daemon_main

    return daemon_main()


if __name__ == "__main__":
    sys.exit(main())
