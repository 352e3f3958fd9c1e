"""Every use of Parsl beyond its documented API, in one place.

Each function says why the project needs it; each was checked against Parsl
``PARSL_CHECKED`` (pyproject.toml bounds the dependency there, and
``tests/test_parsl_seam.py`` fails on a release where an attribute used here is gone).
Everything else in ``workflows/`` uses Parsl's public API: ``Config``, the executors and
providers, ``python_app``/``bash_app``, ``parsl.load``/``dfk``/``clear``.
"""
from __future__ import annotations

from typing import Any

PARSL_CHECKED = "2026.10.26"
"""The Parsl release every function below was read against and tested with."""


def stop_status_poller(dfk: Any) -> None:
    """Tell the DataFlowKernel's job-status poller to start no new poll.

    Why: the poller asks each interchange for its blocks over a socket with no timeout and
    ``dfk.cleanup`` joins it with no timeout, so a poll that meets an interchange killed by a
    group signal blocks the driver's shutdown forever. Parsl has no public way to stop it
    before cleanup (``JobStatusPoller._kill_event``)."""
    dfk.job_status_poller._kill_event.set()


def interchange_process(executor: Any) -> Any | None:
    """The executor's interchange process (``HighThroughputExecutor.interchange_proc``), or
    None (a thread pool has none, an unstarted executor neither).

    Why: to see an interchange that a signal killed, and to kill one that a cleanup would
    wait on forever."""
    return getattr(executor, "interchange_proc", None)


def fail_executor(executor: Any, error: Exception) -> None:
    """Mark an executor broken and fail its outstanding tasks
    (``BlockProviderExecutor.set_bad_state_and_fail_all``), so cleanup skips its scale-in.

    Why: its interchange is gone; a scale-in would ask it and never return."""
    executor.set_bad_state_and_fail_all(error)


def job_ids(executor: Any) -> list[str]:
    """The scheduler job ids of an executor's blocks (``blocks_to_job_id``; [] for
    executors without blocks).

    Why: to cancel the jobs through the provider when the interchange that would scale them
    in is gone."""
    blocks = getattr(executor, "blocks_to_job_id", {})
    return [job for job in blocks.values() if job]


def block_status(executor: Any) -> dict[str, Any]:
    """Block id -> JobStatus from the last poll (``BlockProviderExecutor.status_facade``).

    Why: to hand back only the blocks that run (a finished stage's allocation)."""
    return executor.status_facade


def connected_blocks(executor: Any) -> list[str]:
    """The blocks whose worker pools are connected to the interchange
    (``HighThroughputExecutor.connected_blocks``). Ask only a live interchange."""
    return list(executor.connected_blocks())


def scale_in(executor: Any, blocks: int) -> None:
    """Cancel ``blocks`` blocks of the executor (``BlockProviderExecutor.scale_in_facade``).

    Why: Parsl keeps an idle block until its idle timeout; a finished stage's allocation
    would hold every node of it meanwhile."""
    executor.scale_in_facade(blocks)


def slurm_script_template() -> str:
    """The batch-script template ``SlurmProvider.submit`` fills
    (``parsl.providers.slurm.template``, a private module).

    Why: the dry run prints the very script a run would submit."""
    from parsl.providers.slurm.template import template_string

    return template_string


def srun_prefix(resources: dict[str, str], hosts: str) -> str:
    """The ``srun`` prefix MPIExecutor gives a ranks app for ``resources``
    (``parsl.executors.high_throughput.mpi_prefix_composer``).

    Why: the dry run prints the very srun line a run would use."""
    from parsl.executors.high_throughput.mpi_prefix_composer import compose_srun_launch_cmd

    return compose_srun_launch_cmd(resources, hosts)[1]
