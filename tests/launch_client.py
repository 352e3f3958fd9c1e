"""``python -m tests.launch_client --spec PATH``: ``python -m stages.mechanism.launch``'s
stand-in in a driver forked by the tests, its launch forked by the driver's launch zygote
(``tests/launch_zygote.py``). Standard library only, so that it starts in milliseconds.

It sends its argv, directory, environment and output streams to the zygote, forwards the
signals it gets to the launch, and ends as the launch ended: its exit code, or killed by
the same signal.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import sys

SOCKET_VAR = "FRONTIER_LLM_TESTS_LAUNCH_SOCKET"
"""Where a client finds its driver's launch zygote (``tests.launch_zygote.start`` sets it)."""
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


def main() -> None:
    me = os.getpid()
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(os.environ[SOCKET_VAR])
    request = {"argv": sys.argv[1:], "cwd": os.getcwd(), "env": dict(os.environ),
               "stdout": f"/proc/{me}/fd/1", "stderr": f"/proc/{me}/fd/2"}
    conn.sendall((json.dumps(request) + "\n").encode())
    replies = conn.makefile("r")
    launch = json.loads(replies.readline())["pid"]

    def forward(signum: int, frame: object) -> None:
        try:
            os.kill(launch, signum)
        except ProcessLookupError:  # ended meanwhile: its code is on its way
            pass

    for signum in FORWARDED:
        signal.signal(signum, forward)
    line = replies.readline()
    code = json.loads(line)["code"] if line else -signal.SIGKILL
    if code < 0:  # killed: end the same way
        signal.signal(-code, signal.SIG_DFL)
        os.kill(me, -code)
    sys.exit(code)


if __name__ == "__main__":
    main()
