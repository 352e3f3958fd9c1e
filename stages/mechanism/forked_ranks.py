"""The ranks of a local launch forked from rank 0, so that torch is imported once per launch.

A rank's start-up is mostly imports (torch, its distributed and DTensor modules, the trainer:
about 2.8 CPU seconds); the ranks of one machine would each pay it. The local launcher
(``stages.mechanism.launch.LocalRanks``) therefore starts rank 0 alone, with ``FORK_PEERS_VAR`` set;
rank 0 has imported its worker module by the time ``stages.mechanism.launch.rank_main`` runs, and
there forks ranks 1 .. n-1 (``fork_peers``, by ``model.parallel.fork_server.fork_child``, as
every forked rank is made). A forked rank is the same program at the same
point, so it keeps the command line the tests and ``ps`` see (``python -m <worker> --spec``),
its stdout and stderr (the launcher's pipe) and its process group (the launch's); it gets
its own identity (``dist_env.local_rank_variables``) and dies with rank 0 (parent-death
signal), as rank 0 dies with the launcher.

Rank 0 keeps the launcher's rule for failures (``ForkedPeers``): when one rank fails the
others get SIGTERM, then SIGKILL ``FAILED_RANKS_GRACE_S`` later, and rank 0 exits with the
first failure's code, else with a peer's out-of-time code, else 0. A rank killed by a signal
the launch did not send (the OOM killer, a user's ``kill -9``) is the cause of the others'
failures (a peer gone from a collective): it comes first, its code 128 + the signal, named
in one line (``killed_message``) before the other ranks' tracebacks.

Fork is safe here: importing the workers starts no thread (one thread, checked in
``fork_peers``), no accelerator is initialised before the ranks set up their devices, and
the process group starts after the fork. Ranks under srun or torchrun are started one by
one by those launchers and fork nothing.
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time

from model.parallel.dist_env import STORE_FILE_VAR, local_rank_variables
from model.parallel.fork_server import flush_streams, fork_child

FORK_PEERS_VAR = "FRONTIER_LLM_FORK_PEERS"
"""Set by the local launcher on rank 0: fork the launch's other ranks."""
FAILED_RANKS_GRACE_S = 30.0
"""After one rank failed, the others get SIGTERM, then SIGKILL this much later (torchrun's
rule): a rank stuck in a collective with the failed one may not end by itself."""
POLL_S = 0.1
SETTLE_S = 1.0
"""How long a failed rank 0 waits to see whether a peer was killed first (``settle``)."""


def shell_exit_code(returncode: int) -> int:
    """A return code (negative: killed by that signal) as a shell reports it: 128 + the
    signal for a killed process."""
    return 128 - returncode if returncode < 0 else returncode


def exit_code(status: int) -> int:
    """The exit code of a ``waitpid`` status (``shell_exit_code``)."""
    return shell_exit_code(os.waitstatus_to_exitcode(status))


KILLED_PREFIX = "[launch] "
"""How the launch's line naming a rank killed by a signal starts (``killed_message``)."""


def killed_message(rank: int, signum: int, peers: bool = True) -> str:
    """The one line that names a rank killed by a signal (the launch did not send), the
    cause the other ranks' failures follow from (a peer gone from a collective); ``peers``
    False for a launch of one rank, which has no others."""
    try:
        name = f" ({signal.Signals(signum).name})"
    except ValueError:
        name = ""
    after = "; the other ranks failed after it" if peers else ""
    return (f"rank {rank} was killed by signal {signum}{name}{after} "
            "(a killed rank: out of memory, a scheduler's or a user's kill)")


def killed_line(line: str) -> str | None:
    """The message of a ``killed_message`` line of a launch's output, else None."""
    if line.startswith(KILLED_PREFIX + "rank ") and " was killed by signal " in line:
        return line[len(KILLED_PREFIX):].strip()
    return None


def launch_code(codes: list[int], ok: tuple[int, ...]) -> int:
    """The launch's exit code from its ranks' codes in the order they ended: the first
    failure (a code outside ``ok``), else the first non-zero code, else 0."""
    return next((c for c in codes if c not in ok), next((c for c in codes if c != 0), 0))


class ForkedPeers:
    """Rank 0's view of the ranks it forked: a thread reaps them as they end, stops the rest
    when one fails, and ``finish`` waits for them all before rank 0 exits."""

    def __init__(self, pids: list[int], ok: tuple[int, ...]) -> None:
        self.running = set(pids)
        self.codes: list[int] = []  # in the order the ranks ended, rank 0 included
        self.ranks = {pid: rank for rank, pid in enumerate(pids, start=1)}
        self.killed: list[tuple[int, int]] = []  # (rank, signal): killed, not by this launch
        self._sent: dict[int, set[int]] = {}  # pid -> the signals this launch sent it
        self._named = False  # the killed rank's line was printed
        self._ok = ok
        self._lock = threading.Lock()
        self._failed_at: float | None = None
        self._finishing = False  # rank 0 waits in ``finish``
        self._watch = threading.Thread(target=self._watch_peers, daemon=True)
        self._watch.start()

    def _ended(self, code: int) -> None:
        """Record one rank's exit; the first failure sends SIGTERM to the running peers."""
        self.codes.append(code)
        if code not in self._ok and self._failed_at is None:
            self._failed_at = time.monotonic()
            self._signal(signal.SIGTERM)

    def _signal(self, signum: int) -> None:
        for pid in self.running:
            self._sent.setdefault(pid, set()).add(signum)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)

    def _reap(self, block: bool) -> None:
        for pid in list(self.running):
            try:
                done, status = os.waitpid(pid, 0 if block else os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere: its code is unknown
                self.running.discard(pid)
                continue
            if done:
                self.running.discard(pid)
                if os.WIFSIGNALED(status) and os.WTERMSIG(status) not in self._sent.get(pid, ()):
                    self.killed.append((self.ranks[pid], os.WTERMSIG(status)))
                self._ended(exit_code(status))

    def _watch_peers(self) -> None:
        """Reap the peers as they end. Once the grace after a failure is over, kill the rest;
        and if rank 0 is not yet waiting in ``finish`` (stuck in a collective with a dead
        peer, say), end rank 0 too, with the launch's code."""
        while True:
            with self._lock:
                self._reap(block=False)
                failed_at = self._failed_at
                if failed_at is None or self._finishing:
                    if not self.running:
                        return
                if failed_at is not None and time.monotonic() - failed_at > FAILED_RANKS_GRACE_S:
                    self._signal(signal.SIGKILL)
                    self._reap(block=True)
                    if not self._finishing:
                        code = self.verdict()
                        flush_streams()
                        os._exit(code)
                    return
            time.sleep(POLL_S)

    def finish(self, own_code: int) -> int:
        """Rank 0 ended its work with ``own_code``: wait for the peers (stopped first if
        anything failed) and return the launch's exit code."""
        with self._lock:
            self._finishing = True
            self._ended(own_code)
        self._watch.join()
        return self.verdict()

    def settle(self, timeout_s: float = SETTLE_S) -> None:
        """Rank 0 failed: give a peer that died first up to ``timeout_s`` to be reaped, so
        that a rank killed by a signal (the usual cause of rank 0's failure in a collective)
        is known, and named (``verdict``) first."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                self._reap(block=False)
                if self.killed or not self.running:
                    break
            time.sleep(POLL_S / 4)
        self._name_killed()

    def _name_killed(self) -> None:
        """Print the first killed rank's line (``killed_message``) once, if there is one."""
        if self.killed and not self._named:
            self._named = True
            with contextlib.suppress(OSError, ValueError):
                print(KILLED_PREFIX + killed_message(*self.killed[0]), file=sys.stderr,
                      flush=True)

    def verdict(self) -> int:
        """The launch's exit code: the first rank killed by a signal this launch did not
        send (128 + the signal; named on stderr by ``killed_message``, before the ranks that
        failed after it), else ``launch_code``."""
        if not self.killed:
            return launch_code(self.codes, self._ok)
        self._name_killed()
        return 128 + self.killed[0][1]


def fork_peers(ok: tuple[int, ...]) -> ForkedPeers | None:
    """In rank 0 of a local launch (``FORK_PEERS_VAR`` set): fork ranks 1 .. n-1
    (``model.parallel.fork_server.fork_child``: each dies with rank 0) and return them as
    ``ForkedPeers``; None in every other process (a forked rank included). ``ok`` holds
    the exit codes that are not failures."""
    if not os.environ.pop(FORK_PEERS_VAR, None):
        return None
    if threading.active_count() > 1:  # a thread would be lost in the forked copies
        raise RuntimeError(f"{FORK_PEERS_VAR} is set in a process that runs threads "
                           f"({threading.enumerate()}): ranks cannot be forked from it")
    world = int(os.environ["LOCAL_WORLD_SIZE"])
    store = os.environ[STORE_FILE_VAR]
    pids = []
    for rank in range(1, world):
        pid = fork_child(local_rank_variables(rank, world, store))
        if pid == 0:
            return None
        pids.append(pid)
    return ForkedPeers(pids, ok)
