"""The tests' forked launches (``tests.rank_zygote``) end as a launch would: a refused input
with the launcher's exit code and the rank's own line, a launch past its time with every
rank's stack on stderr and no rank left running."""
from __future__ import annotations

import psutil
import pytest

from stages.mechanism.launch import USER_ERROR_EXIT, RankSpec
from tests.train_helpers import run_ranks, run_worker, tiny_config

DDP2 = {"dp": 2, "micro_batch": 2, "grad_accum": 2, "sharding": "ddp"}


def _spec(tmp_path, plan: dict, *overrides: str):
    spec = RankSpec(worker="stages.train.worker", nproc=2, nodes=1, out_dir=str(tmp_path),
                    config=tiny_config(*overrides).to_dict(), plan=plan)
    return spec.write(tmp_path / "spec.json")


def test_a_refused_plan_ends_with_the_launchers_code_and_the_ranks_line(tmp_path):
    code, _, stderr = run_ranks("stages.train.worker", _spec(tmp_path, {**DDP2, "dp": 4}), 2,
                                timeout=120)
    assert code == USER_ERROR_EXIT, stderr[-2000:]
    assert "[rank] PlanError" in stderr and "must equal train.global_batch" in stderr


@pytest.mark.slow
def test_a_launch_past_its_timeout_shows_each_ranks_stack_and_leaves_no_rank(tmp_path):
    with pytest.raises(AssertionError, match="did not end in 6 s") as failed:
        run_worker(tmp_path, DDP2, 2, "train.steps=1000000", timeout=6)
    # faulthandler's dump of each rank's main thread, in the trainer
    assert str(failed.value).count("Current thread") + str(failed.value).count(
        "Thread 0x") >= 2, str(failed.value)[-3000:]
    assert "trainer.py" in str(failed.value)
    # the launches are the zygotes' children, the ranks theirs: none is left
    zygotes = [z for z in psutil.Process().children() if "rank_zygote" in " ".join(z.cmdline())]
    assert zygotes
    assert not [p for z in zygotes for p in z.children(recursive=True)]
