"""The memory model's held-out plans (benchmarks/heldout_plans.yaml): every entry a valid,
rehearsable plan for its model on its cluster and devices, the coverage the file claims, no
overlap with the in-sample set the model was tuned on, a bad entry refused by name, and the
held-out figures as bench_rehearse computes them. Nothing is rehearsed here."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks import bench_rehearse  # noqa: E402 (needs the repository on sys.path)
from benchmarks.bench_rehearse import (  # noqa: E402
    HELDOUT_PLANS,
    HeldOut,
    HeldOutError,
    heldout_figures,
    heldout_jobs,
    load_heldout,
)
from model.planner.cluster import load_cluster  # noqa: E402

CLUSTERS = {"h100", "frontier", "dgx-a100", "jean-zay-a100"}
RESULTS = REPO / "benchmarks" / "results"


@pytest.fixture(scope="module")
def entries() -> list[HeldOut]:
    return load_heldout()


def shape_of(model) -> tuple:
    """The fields of a model's shape that its memory depends on."""
    return (model.family, model.n_layers, model.d_model, model.n_heads, model.kv_heads,
            model.ffn_dim, model.vocab_size)


def test_every_entry_is_a_valid_rehearsable_plan(entries):
    assert len(entries) >= 32
    names = [e.name for e in entries]
    assert len(set(names)) == len(names)
    for e in entries:
        assert e.plan.problems(e.model, e.train, e.devices) == [], e.name
        assert e.plan.tp * e.plan.pp * e.plan.dp == e.devices, e.name
        assert e.plan.global_batch == e.train.global_batch, e.name
        assert e.cluster in CLUSTERS, e.name
        assert load_cluster(e.cluster).name == e.cluster
        assert e.train.dtype == "bfloat16", e.name
        # cheap to rehearse on a small box: the layers one rank runs
        assert -(-e.model.n_layers // e.plan.pp) <= 28, e.name


def test_the_set_covers_what_it_claims(entries):
    plans = [e.plan for e in entries]
    assert {e.model.family for e in entries} == {"llama", "neox"}
    assert any(e.model.family == "llama" and e.model.kv_heads < e.model.n_heads
               for e in entries), "grouped-query attention"
    assert any(e.model.family == "neox" and e.model.kv_heads == e.model.n_heads
               for e in entries)
    assert {p.schedule for p in plans if p.pp > 1} == {"gpipe", "1f1b", "interleaved_1f1b"}
    assert {p.virtual_stages for p in plans if p.schedule == "interleaved_1f1b"} >= {2, 3, 4}
    assert any(p.pp == 1 for p in plans)
    for sharding in ("zero2", "zero3"):
        assert {p.pp > 1 for p in plans if p.sharding == sharding} == {True, False}, sharding
    assert any(p.sharding == "ddp" and p.pp > 1 for p in plans)
    recomputes = {p.recompute + ("-partial" if p.recompute_layers else "") for p in plans}
    assert recomputes >= {"none", "full", "full-partial"}
    assert {p.sequence_parallel for p in plans} == {True, False}
    assert {p.tp for p in plans} >= {1, 2, 4, 8}
    assert {e.train.seq_len for e in entries} >= {2048, 4096, 8192}
    assert {p.micro_batch for p in plans} >= {1, 2, 4}
    assert len({e.cluster for e in entries}) >= 3


def in_sample_keys() -> set[tuple]:
    """(model shape, seq_len, plan layout) of every plan the memory model was tuned on: the
    Frontier presets' plans and the study's (bench_rehearse.json, bench_rehearse_study.json)
    and the tuning plans (benchmarks/tuning_plans.yaml, the earlier held-out set among them)."""
    from model.parallel.layout import Plan
    from workflows.plan import load_model_file

    keys = set()
    for name in ("bench_rehearse", "bench_rehearse_study"):
        for r in json.loads((RESULTS / f"{name}.json").read_text())["ranks"]:
            if "error" in r:
                continue
            source = r["preset"]
            if source.startswith(f"{bench_rehearse.STUDY}:"):
                model, train, _, plan, _ = bench_rehearse.study_run(source.split(":", 1)[1])
            else:
                model, train, _ = load_model_file(REPO / "configs" / f"{source}.yaml")
                plan = Plan.from_dict(r["plan_fields"])
            keys.add((shape_of(model), train.seq_len, plan.key()))
    for e in load_heldout(bench_rehearse.PLAN_SETS[bench_rehearse.TUNING][0]):
        keys.add((shape_of(e.model), e.train.seq_len, e.plan.key()))
    return keys


def test_no_held_out_plan_is_in_sample(entries):
    tuned = in_sample_keys()
    assert len(tuned) >= 30 + 213  # the presets' 30 plans, the study's 3, 213 tuning plans
    held = {(shape_of(e.model), e.train.seq_len, e.plan.key()) for e in entries}
    assert not held & tuned
    # nor even a model shape the model was tuned on
    assert not {k[0] for k in held} & {k[0] for k in tuned}


def test_jobs_are_each_entrys_busiest_ranks(entries):
    jobs = heldout_jobs(None)
    assert len(jobs) == sum(2 if e.plan.pp > 1 else 1 for e in entries)
    one_stage = next(e for e in entries if e.plan.pp == 1)
    piped = next(e for e in entries if e.plan.pp > 1)
    assert sorted(heldout_jobs([f"{one_stage.name},{piped.name}:last"])) == sorted([
        (f"heldout:{one_stage.name}", -1, "first"), (f"heldout:{piped.name}", -1, "last")])
    with pytest.raises(SystemExit, match="no-such-plan"):
        heldout_jobs(["no-such-plan"])


def _write_entries(tmp_path: Path, change) -> Path:
    raw = yaml.safe_load(HELDOUT_PLANS.read_text())
    change(raw["plans"])
    path = tmp_path / "plans.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.mark.parametrize(("change", "message"), [
    (lambda ps: ps[3].update(devices=ps[3]["devices"] * 2), r"entry 3 \(.*\):.*world size"),
    (lambda ps: ps[5]["plan"].pop("recompute_layers"), r"entry 5 .*lacks \['recompute_layers'\]"),
    (lambda ps: ps[7].update(name=ps[0]["name"]), r"entry 7 .*name is taken"),
    (lambda ps: ps[2].update(cluster="nowhere"), r"entry 2 .*nowhere"),
    # q3-8b-gpipe-tp2-zero3-mb2 (16 devices, batch 64) with a batch its plan does not make
    (lambda ps: ps[2].update(global_batch=96), r"entry 2 \(q3-8b-gpipe-tp2-zero3-mb2\).*batch"),
    (lambda ps: ps[0]["model"].update(n_kv_heads=5), r"entry 0 .*n_kv_heads"),
    (lambda ps: ps[6].update(dtype="float16"), r"entry 6 .*dtype 'float16'"),
])
def test_a_bad_entry_is_refused_by_name(tmp_path, change, message):
    with pytest.raises(HeldOutError, match=message):
        load_heldout(_write_entries(tmp_path, change))


def test_heldout_figures():
    def rank(name: str, stage: str, modeled: float, rehearsed: float, seconds: float,
             rss: float) -> dict:
        return {"name": name, "stage": stage, "modeled_tensor_memory_gb": modeled,
                "rehearsed_peak_memory_gb": rehearsed, "rehearsal_seconds": seconds,
                "host_peak_rss_gb": rss}

    records = [rank("a", "first", 10.3, 10.0, 12.0, 0.4), rank("a", "last", 9.0, 10.0, 30.0, 0.5),
               rank("b", "first", 10.0, 10.0, 5.0, 0.3),
               {"name": "c", "stage": "first", "error": "timed out"}]
    figures = heldout_figures(records)
    assert figures["ranks_rehearsed"] == 3 and figures["ranks_failed"] == 1
    assert figures["plans_rehearsed"] == 2
    assert figures["memory_error_pct_min"] == pytest.approx(-10.0)
    assert figures["memory_error_pct_max"] == pytest.approx(3.0)
    assert figures["memory_error_pct_mean_abs"] == pytest.approx(13 / 3, abs=0.01)
    assert figures["memory_within_5pct_count"] == 2
    assert figures["memory_worst_rank"] == "a:last"
    assert figures["rehearsal_seconds_max"] == 30.0
    assert figures["host_peak_rss_gb_max"] == 0.5


def test_only_picks_a_presets_plan_and_stage_or_a_studys_run():
    preset = bench_rehearse.only_job("pythia-continue#1:first", study=False)
    assert preset == ("pythia-continue", 1, "first")
    assert bench_rehearse.matches(("pythia-continue", 1, "first"), preset)
    assert not bench_rehearse.matches(("pythia-continue", 2, "first"), preset)
    assert not bench_rehearse.matches(("pythia-continue", 1, "last"), preset)
    every_plan = bench_rehearse.only_job("frontier-1t:last", study=False)
    assert bench_rehearse.matches(("frontier-1t", 7, "last"), every_plan)
    run = bench_rehearse.only_job("gpt-22b:first", study=True)
    assert bench_rehearse.matches((f"{bench_rehearse.STUDY}:gpt-22b", -1, "first"), run)
    with pytest.raises(SystemExit, match="NAME:STAGE"):
        bench_rehearse.only_job("frontier-1t#2", study=False)
