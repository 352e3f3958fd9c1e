"""The one rank launcher: what every rank of a multi-rank stage reads, and how ranks start.

A multi-rank stage (train, evaluate with ``eval.ranks`` > 1, and the plan stage's measured
refinement) writes a ``RankSpec`` as JSON, then ``nproc`` processes each run
``python -m <spec.worker> --spec <path>``:

- on this machine as children of the launcher (``LocalRanks`` / ``run_local``; the command
  ``local_command``), meeting at a rendezvous file;
- under Slurm, the workflow puts the same worker line after ``$PARSL_MPI_PREFIX`` (an
  ``srun`` line composed by Parsl's MPIExecutor; see ``workflows.ranks.ranks_command``).

Every rank calls ``die_with_parent`` first, so no rank outlives its launcher and writes into
a stage directory after the stage was declared failed. A rank that rejects its input
(``ValueError`` and its subclasses: a user mistake that a retry cannot fix) writes
``rank-error.json`` beside the spec and exits with ``USER_ERROR_EXIT``, so the workflow
fails at once with that message instead of retrying.

A rank that stopped out of time (``OutOfTime``: Slurm's signal ahead of the walltime, or a
SIGTERM, after the ranks wrote the checkpoint of the step they all stopped at) leaves
``out-of-time.json`` (the step and checkpoint) beside the spec; the launch then exits
``OUT_OF_TIME_EXIT``, which the workflow reads as "resume in a new job", neither a failure
nor a spent retry. The ranks exit ``OUT_OF_TIME_EXIT`` and the launcher (or, under srun, the
ranks' command) checks the file; a rank run by hand under torchrun exits 0 instead, since
torchrun reports any other code as a failure.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from data_prep.atomic import storage_error, write_json_atomic
from model.parallel.parent_death import arm_parent_death_signal, die_with_parent
from model.parallel.threads import rank_threads_env
from stages.mechanism.shape import StageShape

REPO_ROOT = Path(__file__).resolve().parents[2]
SPEC_FILE = "spec.json"
"""What a ranks stage's ``prepare`` writes in its work directory: the ranks' ``RankSpec``."""
RANK_ERROR_FILE = "rank-error.json"
RANK_MESSAGE_PREFIX = "[rank] "
"""How a rank's one-line error starts on its stderr (the launcher takes it from there where
a full disk took no ``rank-error.json``)."""
USER_ERROR_EXIT = 3  # a rank refused its input: retrying cannot help
OUT_OF_TIME_EXIT = 75  # the ranks stopped at a checkpoint before the walltime: resume (EX_TEMPFAIL)
OUT_OF_TIME_FILE = "out-of-time.json"
"""What the ranks leave beside their spec when they stopped out of time: the step, the
checkpoint, the signal, the job."""


class OutOfTime(Exception):
    """Raised by a rank's run once every rank stopped at a checkpoint before its steps were
    done (asked to by a signal); ``rank_main`` turns it into the out-of-time exit."""


class RanksOutOfTime(RuntimeError):
    """The ranks stopped out of time at a checkpoint (``OUT_OF_TIME_FILE``): run them again
    to resume."""

    def __init__(self, what: str, record: dict[str, Any]) -> None:
        self.record = record
        super().__init__(f"{what} ranks stopped out of time after step {record.get('step')} "
                         f"(checkpoint {record.get('checkpoint')}): run them again to resume")


class RanksFailed(RuntimeError):
    """The ranks of a stage exited non-zero; ``user_error`` holds a rank's own message."""

    def __init__(self, what: str, exit_code: int, tail: str, user_error: str | None,
                 killed: str | None = None) -> None:
        self.exit_code, self.user_error, self.killed = exit_code, user_error, killed
        detail = user_error or (f"{killed}; " if killed else "") + f"last output:\n{tail}"
        super().__init__(f"{what} ranks failed (exit {exit_code}): {detail}")


@dataclass
class RankSpec:
    """Everything a rank needs, written by the stage's ``prepare`` (JSON round trip)."""

    worker: str  # module every rank runs: python -m <worker> --spec <path>
    nproc: int  # ranks in all
    nodes: int  # nodes they span (ranks divide evenly)
    out_dir: str  # where the ranks write (absolute)
    config: dict[str, Any]  # the resolved pipeline config (PipelineConfig.to_dict())
    plan: dict[str, Any] | None = None  # the parallel plan (Plan.to_dict()), training only
    store: str | None = None  # token store path; None: synthetic tokens
    tracking: dict[str, str] | None = None  # {"uri", "run_id"} of the stage's MLflow run
    steps: int | None = None  # stop after this many steps (None: train.steps)
    peak_tflops: float | None = None  # device peak MFU is reported against
    timeout_s: float | None = None  # the launch is killed after this long (None: no limit)
    series: list[str] = field(default_factory=list)
    """A series of launches instead of one (the plan stage's measured refinement): the
    paths of rank specs started one after another, each on this spec's ranks and nodes. One
    that fails or overruns its ``timeout_s`` is reported and the next starts; what each
    left in its own ``out_dir`` is the result."""
    extra: dict[str, Any] = field(default_factory=dict)  # stage-specific fields

    def __post_init__(self) -> None:
        if self.nproc < 1 or self.nodes < 1 or self.nproc % self.nodes:
            raise ValueError(
                f"{self.nproc} ranks do not divide over {self.nodes} node(s): make the rank "
                "count a multiple of the node count"
            )

    @property
    def ranks_per_node(self) -> int:
        return self.nproc // self.nodes

    @classmethod
    def for_shape(cls, shape: StageShape, **fields: Any) -> RankSpec:
        """The spec of a ranks stage's shape: its worker, rank and node counts."""
        return cls(worker=shape.worker, nproc=shape.nproc, nodes=shape.nodes, **fields)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> RankSpec:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - names)
        if unknown:
            raise ValueError(f"rank spec has unknown fields {unknown}; known: {sorted(names)}")
        return cls(**raw)

    def write(self, path: str | Path) -> Path:
        """Write the spec atomically; return its absolute path."""
        return write_json_atomic(Path(path).resolve(), self.to_dict())

    @classmethod
    def read(cls, path: str | Path) -> RankSpec:
        return cls.from_dict(json.loads(Path(path).read_text()))


def project_environment(base: dict[str, str] | None = None) -> dict[str, str]:
    """``base`` (default this process's environment) with the project first on PYTHONPATH,
    for a child started as ``python -m <project module>`` from any directory."""
    env = dict(os.environ if base is None else base)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    return env


def rank_environment(base: dict[str, str] | None = None) -> dict[str, str]:
    """The ranks' environment: one thread per rank, the project importable, no stale identity."""
    env = project_environment(base)
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    env.update(rank_threads_env())
    return env


def rank_command(spec_path: str | Path, spec: RankSpec, python: str = sys.executable) -> list[str]:
    """The argv of one rank of ``spec``: ``python -m <worker> --spec <path>``."""
    return [python, "-m", spec.worker, "--spec", str(spec_path)]


def local_command(spec_path: str | Path, python: str = sys.executable) -> list[str]:
    """The argv that starts every rank of the spec at ``spec_path`` on this machine: this
    module's own command line (``main``)."""
    return [python, "-m", "stages.mechanism.launch", "--spec", str(spec_path)]


class LocalRanks:
    """The ``nproc`` ranks of a one-node spec, started here: rank 0 as a child of this
    process, the others forked from it (``stages.mechanism.forked_ranks``), so that the worker's
    imports are paid once per launch.

    Rank 0 runs ``rank_command`` with its identity (``dist_env.local_rank_variables``); the
    ranks meet at a fresh rendezvous file (torch's FileStore): no port is chosen, so
    concurrent launches cannot collide, and nothing heavier than this module is imported
    here (torchrun would import torch, seconds of CPU per launch). The ranks share one
    process group (``pgid``, so that they are killed together, and out of reach of a signal
    to the caller's group) and one pipe for their merged stdout and stderr (``stdout``);
    rank 0 dies with this process and the others with rank 0 (parent-death signals). When
    one rank fails rank 0 stops the others (``forked_ranks.FAILED_RANKS_GRACE_S``); ``wait``
    gives the first failure's exit code (128 + the signal for a rank killed by one), else 0.
    """

    def __init__(self, spec_path: str | Path, spec: RankSpec, env: dict[str, str]) -> None:
        import tempfile

        from model.parallel.dist_env import local_rank_variables
        from stages.mechanism.forked_ranks import FORK_PEERS_VAR

        if spec.nodes != 1:
            raise ValueError(
                f"{spec.nodes} nodes cannot be launched on this machine: multi-node ranks are "
                "started with srun by the workflow (site.name=slurm or frontier)"
            )
        self._rendezvous = tempfile.mkdtemp(prefix="ranks-")
        store = str(Path(self._rendezvous) / "store")
        read_end, write_end = os.pipe()
        try:
            self.rank0 = self._start_rank0(
                rank_command(spec_path, spec),
                {**env, **local_rank_variables(0, spec.nproc, store), FORK_PEERS_VAR: "1"},
                write_end)
        except BaseException:
            shutil.rmtree(self._rendezvous, ignore_errors=True)
            raise
        finally:
            os.close(write_end)
        self.pgid = self.rank0.pid
        self.nproc = spec.nproc
        self.killed_here = False  # this launcher killed the ranks (a timeout, its own end)
        self.stdout = open(read_end, errors="replace")  # noqa: SIM115 - closed in wait

    def _start_rank0(self, command: list[str], env: dict[str, str],
                     output: int) -> subprocess.Popen:
        """Rank 0: ``command`` with ``env``, its stdout and stderr ``output``, in a process
        group of its own (the launch's), dying with this process."""
        return subprocess.Popen(command, env=env, cwd=REPO_ROOT, stdout=output, stderr=output,
                                process_group=0,
                                preexec_fn=arm_parent_death_signal)  # noqa: PLW1509 (one prctl)

    def kill(self) -> None:
        """SIGKILL every rank still running; reap rank 0 (rank 0 reaps the others)."""
        if self.rank0.poll() is None:
            self.killed_here = True
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pgid, signal.SIGKILL)
        self.rank0.wait()
        shutil.rmtree(self._rendezvous, ignore_errors=True)

    def wait(self) -> int:
        """Wait for every rank; the launch's exit code."""
        from stages.mechanism.forked_ranks import shell_exit_code

        code = self.rank0.wait()
        shutil.rmtree(self._rendezvous, ignore_errors=True)
        return shell_exit_code(code)

    def rank0_killed(self) -> str | None:
        """The line naming rank 0 when a signal this launcher did not send killed it (its
        peers then die with it), else None."""
        from stages.mechanism.forked_ranks import killed_message

        code = self.rank0.returncode
        if code is None or code >= 0 or self.killed_here:
            return None
        return killed_message(0, -code, peers=self.nproc > 1)


def read_out_of_time(out_dir: str | Path) -> dict[str, Any] | None:
    """What the ranks recorded when they stopped out of time, or None."""
    try:
        record = json.loads((Path(out_dir) / OUT_OF_TIME_FILE).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def read_killed_rank(log: str | Path | None) -> str | None:
    """The launch's line naming the rank a signal killed (``forked_ranks.killed_message``)
    in the ranks' ``log``, or None: the cause to report before the other ranks' errors."""
    from stages.mechanism.forked_ranks import killed_line

    try:
        lines = Path(log).read_text(errors="replace").splitlines() if log else []
    except OSError:
        return None
    return next((found for line in lines if (found := killed_line(line))), None)


def read_rank_error(out_dir: str | Path, log: str | Path | None = None) -> str | None:
    """The message a rank left when it refused its input, or None.

    From ``RANK_ERROR_FILE``; failing that (a full disk took no file), from the last line a
    rank said it on in the ranks' ``log``.
    """
    try:
        return str(json.loads((Path(out_dir) / RANK_ERROR_FILE).read_text())["message"])
    except (OSError, ValueError, KeyError):
        pass
    if log is None:
        return None
    try:
        lines = Path(log).read_text(errors="replace").splitlines()
    except OSError:
        return None
    said = [line[len(RANK_MESSAGE_PREFIX):].strip() for line in lines
            if line.startswith(RANK_MESSAGE_PREFIX)]
    return said[-1] if said else None


def run_local(spec_path: str | Path, log_path: str | Path | None = None, what: str = "stage",
              echo: bool = True, timeout_s: float | None = None) -> None:
    """Start every rank of the spec at ``spec_path`` here (``LocalRanks``); stream their output.

    Raises ``RanksFailed`` (with the rank's own message when it refused its input) on a
    non-zero exit or after ``timeout_s`` (default: the spec's), ``RanksOutOfTime`` when the
    ranks stopped out of time at a checkpoint; ranks are killed with their launcher. A
    series spec starts its launches in turn (``run_series_local``).
    """
    from stages.mechanism.forked_ranks import killed_line

    spec = RankSpec.read(spec_path)
    if spec.series:
        run_series_local(spec, log_path, what, echo)
        return
    timeout_s = spec.timeout_s if timeout_s is None else timeout_s
    (Path(spec.out_dir) / RANK_ERROR_FILE).unlink(missing_ok=True)
    (Path(spec.out_dir) / OUT_OF_TIME_FILE).unlink(missing_ok=True)
    tail: collections.deque[str] = collections.deque(maxlen=40)
    with contextlib.ExitStack() as stack:
        log = stack.enter_context(open(log_path, "a")) if log_path else None
        ranks = LocalRanks(spec_path, spec, rank_environment())
        stack.callback(ranks.kill)
        if timeout_s:
            import threading

            timer = threading.Timer(timeout_s, ranks.kill)
            timer.start()
            stack.callback(timer.cancel)
        reported: str | None = None  # a rank's own one-line error
        killed: str | None = None  # the rank a signal killed, which the others failed after
        full: set[int] = set()  # the sinks a full disk stopped taking: the ranks are still heard
        for line in ranks.stdout:
            own = line.startswith(RANK_MESSAGE_PREFIX)
            if own:
                reported = line[len(RANK_MESSAGE_PREFIX):].strip()
            killed = killed or killed_line(line)
            # once a rank has said why it failed, the other ranks' tracebacks (a peer gone
            # from a collective) go to the log only
            if echo and (own or reported is None):
                _copy(line, sys.stdout, full)
            tail.append(line)
            if log:
                _copy(line, log, full)
        code = ranks.wait()
        ranks.stdout.close()
        killed = ranks.rank0_killed() or killed
    stopped = read_out_of_time(spec.out_dir)
    if stopped is not None and read_rank_error(spec.out_dir) is None:
        raise RanksOutOfTime(what, stopped)
    if code != 0:
        # the rank's file, or its line where a full disk took no file
        raise RanksFailed(what, code, "".join(tail), read_rank_error(spec.out_dir) or reported,
                          killed)


def _copy(line: str, sink: TextIO, full: set[int]) -> None:
    """Write ``line`` to ``sink`` unless a full disk stopped taking it (its id in ``full``):
    a launcher whose own log fills the disk goes on reading its ranks to their verdict."""
    if id(sink) in full:
        return
    try:
        sink.write(line)
        sink.flush()
    except OSError as error:
        if storage_error(error) is None:
            raise
        full.add(id(sink))


def _say(text: str) -> None:
    """Print ``text`` to stderr where the disk under it still takes it (see ``_copy``)."""
    with contextlib.suppress(OSError):
        print(text, file=sys.stderr, flush=True)


def run_series_local(spec: RankSpec, log_path: str | Path | None = None, what: str = "stage",
                     echo: bool = True) -> None:
    """Start each launch of a series spec in turn on this machine; one that fails or
    overruns its timeout is reported in a line and the next starts."""
    for path in spec.series:
        try:
            run_local(path, log_path, what=what, echo=echo)
        except (RanksFailed, RanksOutOfTime) as error:
            line = f"[launch] {path}: {str(error).splitlines()[0][:300]}\n"
            sys.stdout.write(line)
            if log_path:
                with open(log_path, "a") as log:
                    log.write(line)


STACKS_SIGNAL = signal.SIGUSR2
"""The signal on which a rank prints every thread's Python stack to its stderr and goes on."""


def rank_main(description: str, run: Callable[[RankSpec], Any],
              argv: list[str] | None = None) -> int:
    """The command-line entry every rank worker shares: parse ``--spec``, run, report.

    A ``ValueError`` (the project's input errors derive from it) or a full disk is written
    to ``rank-error.json`` (where the disk still takes it) and ends the rank with
    ``USER_ERROR_EXIT`` and one line on stderr; ``OutOfTime`` ends it with
    ``OUT_OF_TIME_EXIT`` (0 under torchrun, which counts any other code as a failure);
    anything else propagates. A hung rank shows where it waits: ``kill -USR2 <pid>`` prints
    the stack of each of its threads to its stderr (``STACKS_SIGNAL``). Rank 0 of a local
    launch first forks the launch's other ranks and ends with the launch's exit code
    (``stages.mechanism.forked_ranks``).
    """
    from stages.mechanism.forked_ranks import fork_peers

    die_with_parent()
    peers = fork_peers(ok=(0, OUT_OF_TIME_EXIT))
    if peers is None:
        return _run_rank(description, run, argv)
    try:
        code = _run_rank(description, run, argv)
    except BaseException:  # what the interpreter would print; the peers are stopped first
        peers.settle()  # a peer killed by a signal (the likely cause) is named first
        traceback.print_exc()
        code = 1
    return peers.finish(code)


def _run_rank(description: str, run: Callable[[RankSpec], Any], argv: list[str] | None) -> int:
    """This rank's part of ``rank_main``."""
    import argparse
    import faulthandler

    faulthandler.register(STACKS_SIGNAL, all_threads=True)
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--spec", required=True, help="path of the rank spec (JSON)")
    spec = RankSpec.read(parser.parse_args(argv).spec)
    try:
        run(spec)
        _end_process_group()
    except OutOfTime:
        _end_process_group()
        return 0 if os.environ.get("TORCHELASTIC_RUN_ID") else OUT_OF_TIME_EXIT
    except BaseException as error:  # torch's CheckpointException is a BaseException
        full = storage_error(error)
        if not isinstance(error, ValueError) and full is None:
            raise
        message = f"{type(error).__name__}: {error}"
        if full is not None:  # retrying fails the same way: say so once, with the fix
            message = (f"OSError: {full.strerror} (while writing under {spec.out_dir}: free "
                       "space or pass another --runs-dir)")
        print(f"{RANK_MESSAGE_PREFIX}{message}", file=sys.stderr, flush=True)
        with contextlib.suppress(OSError):
            write_json_atomic(Path(spec.out_dir) / RANK_ERROR_FILE,
                              {"message": message, "traceback": traceback.format_exc()})
        return USER_ERROR_EXIT
    return 0


def _end_process_group() -> None:
    """Destroy the default process group a worker left open, before the interpreter ends.

    gloo's worker threads release a finished collective's tensors through Python; one that
    does so while the interpreter finalizes aborts the process ("terminate called without
    an active exception", exit 134), so a rank that succeeded would read as killed. Destroying
    the group joins those threads first. Only on success: a failed rank's group may hold a
    collective still waiting for a dead peer."""
    dist = sys.modules.get("torch.distributed")  # a worker that never imported it has none
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    """``python -m stages.mechanism.launch --spec PATH``: start the spec's ranks on this machine.

    The workflow's local ranks app runs this: it dies with its Parsl worker and the ranks die
    with it. Exits ``USER_ERROR_EXIT`` when a rank refused its input, ``OUT_OF_TIME_EXIT``
    when the ranks stopped out of time at a checkpoint, else the first failed rank's exit
    code (``LocalRanks.wait``).
    """
    import argparse

    die_with_parent()
    parser = argparse.ArgumentParser(description="Start a rank spec's ranks on this machine.")
    parser.add_argument("--spec", required=True, help="path of the rank spec (JSON)")
    args = parser.parse_args(argv)
    try:
        run_local(args.spec, what=Path(args.spec).parent.name)
    except RanksOutOfTime as stopped:
        _say(f"[launch] {stopped}")
        return OUT_OF_TIME_EXIT
    except RanksFailed as error:
        _say(f"[launch] {error}")
        out_dir = Path(RankSpec.read(args.spec).out_dir)
        if error.user_error and read_rank_error(out_dir) is None:
            # the rank said why on stderr but a full disk took no file: keep it for the
            # driver where the disk now takes it
            with contextlib.suppress(OSError):
                write_json_atomic(out_dir / RANK_ERROR_FILE, {"message": error.user_error})
        return USER_ERROR_EXIT if error.user_error else error.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
