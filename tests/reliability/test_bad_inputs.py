"""Every bad input stops the pipeline with one clear message, through the command line.

Each case runs the driver's command line (``--config configs/micro.yaml ...``) with a runs
dir of its own and asserts the exit code, substrings that name the problem and the fix,
that no traceback reached the console, and that no stage the run failed left a published
output that says ``succeeded`` (a ``.partial`` directory is fine).

The fast cases stop before any work: config loading, the stages' pre-flight checks
(``stages.mechanism.preflight``), the runs dir and site checks; they also assert that no Parsl run
directory was made. They run in this process, through ``workflows.pipeline.main(argv)``
(the ``pipeline_main`` fixture); a config error and an input error also run as real
``python -m workflows.pipeline`` processes, the console a user sees. The slow ones go
through a stage, as real processes: a bad line past the first record of a JSON-lines file
(only the tokenize stage reads that far), a corpus the hub cannot serve, and an unknown
cluster (the plan stage's). The other parallel settings the plan stage judges run its work
in this process on the unknown-cluster run's tokenized store.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data_prep.config import TokenizerConfig
from data_prep.sources import stdlib_files
from data_prep.tokenizer import save_tokenizer, train_tokenizer
from stages.registry import PIPELINE, STAGE_ORDER
from tests.conftest import Console

REPO = Path(__file__).resolve().parents[2]
# Every cluster file the project ships, as the error lists them.
CLUSTER_NAMES = sorted(p.stem for p in (REPO / "configs" / "clusters").glob("*.yaml"))
MICRO = "configs/micro.yaml"
FAST_TIMEOUT = 120
SLOW_TIMEOUT = 600
DATA, TMP = "<data>", "<tmp>"  # replaced by the bad-data directory and the test's tmp_path


@dataclass(frozen=True)
class Case:
    """One bad invocation: extra CLI arguments and what the console must say."""

    name: str
    args: tuple[str, ...]
    expect: tuple[str, ...]
    code: int = 2
    config: str | None = MICRO  # None: the case passes its own --config
    runs: str | None = f"{TMP}/runs"  # None: the case passes its own --runs-dir
    one_line: bool = True  # the message is the console's last line


def sets(*items: str) -> tuple[str, ...]:
    return ("--set", *items)


CONFIG_CASES = [
    Case("unknown-key", sets("train.stepz=5"),
         ("config error: unknown key 'train.stepz'", "allowed keys in train: steps")),
    Case("unknown-section", sets("trainer.steps=5"),
         ("unknown key 'trainer'", "allowed keys: name, data")),
    Case("bad-value", sets("data.validation_fraction=1.5"),
         ("data.validation_fraction must be in (0, 1), got 1.5",)),
    Case("bad-type", sets("train.steps=many"),
         ("train.steps must be an integer, got 'many'",)),
    Case("bad-enum", sets("model.family=gpt2"),
         ("model.family='gpt2' is not allowed; choose one of ['llama', 'neox']",)),
    Case("bad-site-choice", ("--site", "cloud"),
         ("argument --site: invalid choice: 'cloud'", "choose from")),
    Case("negative-steps", sets("train.steps=-5"), ("train.steps must be > 0, got -5",)),
    Case("heads-not-dividing-width", sets("model.n_heads=5"),
         ("model.n_heads=5 must divide model.d_model=32",)),
    Case("nproc-not-divisible-by-nodes", sets("parallel.nproc=3", "parallel.nodes=2"),
         ("parallel.nproc=3 must be a multiple of parallel.nodes=2",)),
    Case("sequence-longer-than-model", sets("train.seq_len=128"),
         ("train.seq_len=128 exceeds model.max_seq_len=64",
          "lower train.seq_len or raise model.max_seq_len")),
    Case("bad-walltime", sets("site.walltime=30min"),
         ("site.walltime must be HH:MM:SS, got '30min'",)),
    Case("override-without-value", sets("train.steps"),
         ("override 'train.steps' must look like section.key=value",)),
    Case("unknown-preset", ("--config", "configs/nosuch.yaml"),
         ("config file 'configs/nosuch.yaml' not found",), config=None),
    Case("broken-preset", ("--config", f"{DATA}/broken.yaml"),
         ("broken.yaml: not valid YAML", "line 2, column 7"), config=None,
         one_line=False),  # the YAML parser's own lines point at the error
    Case("empty-preset", ("--config", f"{DATA}/empty.yaml"),
         ("empty.yaml is empty", "leave out --config for the defaults"), config=None),
    Case("more-ranks-than-the-machine-runs", sets("parallel.nproc=4096"),
         ("parallel.nproc=4096 on the local site starts that many training ranks",
          "8 per core", "lower parallel.nproc")),
    Case("source-and-sources", sets(f"data.sources={{web: {DATA}/ok.txt}}"),
         ("data.source='stdlib' and data.sources are both set", "data.source=null")),
    Case("sources-not-a-mapping", sets("data.source=null", "data.sources=[web, code]"),
         ("data.sources must be a mapping, got ['web', 'code']",)),
    Case("only-without-upstream", ("--only", "plan"),
         ("--only plan needs the 'curate' stage's output",
          "run the pipeline without --only first")),
]

DATA_CASES = [
    Case("missing-path", sets(f"data.source={DATA}/nope"),
         ("input error: data.source", "nope' does not exist", "give 'stdlib', a file")),
    Case("not-a-regular-file", sets("data.source=/dev/zero"),
         ("data.source '/dev/zero' is not a regular file or directory", "give 'stdlib'")),
    Case("empty-directory", sets(f"data.source={DATA}/empty_dir"),
         ("has no .txt/.jsonl/.json/.parquet files", "point data.source at a directory")),
    Case("unsupported-files-only", sets(f"data.source={DATA}/other_types"),
         ("other_types' has no .txt/.jsonl/.json/.parquet files",)),
    Case("glob-matching-nothing", sets(f"data.source={DATA}/*.nomatch"),
         ("glob", "matched no files: fix the pattern")),
    Case("zero-byte-file", sets(f"data.source={DATA}/empty.txt"),
         ("empty.txt' is empty (0 bytes)", "point data.source at files with documents")),
    Case("binary-file", sets(f"data.source={DATA}/binary.txt"),
         ("binary.txt: not UTF-8 text (invalid byte at offset 0", "convert it to UTF-8")),
    Case("latin-1-file", sets(f"data.source={DATA}/latin1"),
         ("latin1/cafe.txt: not UTF-8 text (invalid byte at offset 3",
          "remove it from data.source")),
    Case("missing-text-field", sets(f"data.source={DATA}/no_text.jsonl"),
         ("no_text.jsonl:1: record has no field 'text' (fields: body, id)",
          "set data.text_field")),
    Case("bad-first-json-line", sets(f"data.source={DATA}/bad_first.jsonl"),
         ("bad_first.jsonl:2: malformed JSON line", "fix the line")),
    Case("record-not-an-object", sets(f"data.source={DATA}/lists.json"),
         ("lists.json: record [0]: expected a JSON object with field 'text', got list",)),
    Case("parquet-without-column", sets(f"data.source={DATA}/body.parquet"),
         ("body.parquet: no column 'text' (columns: body)", "set data.text_field")),
    Case("labelled-source-missing",
         sets("data.source=null", f"data.sources={{code: stdlib, web: {DATA}/nope}}"),
         ("data.sources.web", "nope' does not exist")),
]

TOKENIZER_CASES = [
    Case("missing-tokenizer", sets(f"tokenizer.path={DATA}/nope.json"),
         ("tokenizer.path", "nope.json' does not exist", "tokenizer.path=null to train one")),
    Case("truncated-tokenizer", sets(f"tokenizer.path={DATA}/truncated.json"),
         ("truncated.json' is not a tokenizers JSON file", "point it at a tokenizer.json")),
    Case("tokenizer-without-eos", sets(f"tokenizer.path={DATA}/other_eos.json"),
         ("has no token '<|endoftext|>'", "set tokenizer.eos_token")),
    Case("tokenizer-above-model-vocab",
         sets(f"tokenizer.path={DATA}/tokenizer.json", "model.vocab_size=300"),
         ("exceeds model.vocab_size=300", "raise model.vocab_size to at least")),
    Case("vocab-above-token-dtype",
         sets("tokenizer.vocab_size=70000", "model.vocab_size=70000", "data.token_dtype=uint16"),
         ("does not fit data.token_dtype=uint16", "set data.token_dtype=uint32 or auto")),
]

CHECKPOINT_CASES = [
    Case("init-from-not-a-checkpoint", sets(f"train.init_from={DATA}/not_a_checkpoint"),
         ("config error: train.init_from", "not_a_checkpoint is neither a Hugging Face",
          "nor a checkpoint of ours (model.json)")),
]

SITE_CASES = [
    Case("frontier-without-account", sets("site.name=frontier"),
         ("config error: site.account is required on Frontier",
          "--set site.account=<project id>")),
    Case("runs-dir-with-space", ("--runs-dir", f"{TMP}/my runs"),
         ("contains white space", "choose a path without spaces"), runs=None),
    Case("unwritable-runs-dir", ("--runs-dir", "/proc/x"),
         ("--runs-dir /proc/x is not writable", "choose a directory you can write"), runs=None),
]

FAST_CASES = CONFIG_CASES + DATA_CASES + TOKENIZER_CASES + CHECKPOINT_CASES + SITE_CASES


@pytest.fixture(scope="module")
def bad_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory of broken inputs (and a few good ones they are made from)."""
    root = tmp_path_factory.mktemp("bad_data")
    (root / "broken.yaml").write_text("name: micro\ndata: {source: stdlib\n")
    (root / "empty.yaml").write_text("")
    (root / "ok.txt").write_text("def main():\n    return 0\n")
    (root / "empty_dir").mkdir()
    (root / "not_a_checkpoint").mkdir()
    (root / "not_a_checkpoint" / "notes.txt").write_text("weights to come\n")
    (root / "other_types").mkdir()
    (root / "other_types" / "table.csv").write_text("a,b\n1,2\n")
    (root / "empty.txt").write_bytes(b"")
    (root / "binary.txt").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 16)
    (root / "latin1").mkdir()
    (root / "latin1" / "cafe.txt").write_bytes("Caf\u00e9 cr\u00e8me\n".encode("latin-1"))
    records = [{"body": f"document {i}", "id": i} for i in range(3)]
    (root / "no_text.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (root / "bad_first.jsonl").write_text('\n{"text": "unterminated\n{"text": "b"}\n')
    good = "".join(json.dumps({"text": f.read_text(errors="replace")}) + "\n"
                   for f in stdlib_files()[:40])
    (root / "bad_third.jsonl").write_text(good + '{"text": "x",}\n')
    (root / "lists.json").write_text(json.dumps([["a"], ["b"]]))
    pq.write_table(pa.table({"body": ["one", "two"]}), root / "body.parquet")
    sample = [f.read_text(errors="replace") for f in stdlib_files()[:30]]
    tokenizer = train_tokenizer(sample, TokenizerConfig(vocab_size=400))
    assert tokenizer.get_vocab_size() > 300
    text = save_tokenizer(tokenizer, root / "tokenizer.json").read_text()
    (root / "truncated.json").write_text(text[: len(text) // 2])
    other = train_tokenizer(sample, TokenizerConfig(vocab_size=300, eos_token="<|eos|>"))
    save_tokenizer(other, root / "other_eos.json")
    return root


def command_line(case: Case, data: Path, tmp: Path) -> tuple[list[str], Path | None]:
    """The case's arguments to the driver and its runs dir (None: the case sets none)."""
    def fill(text: str) -> str:
        return text.replace(DATA, str(data)).replace(TMP, str(tmp))

    argv = ["--config", case.config] if case.config else []
    argv += [fill(a) for a in case.args]
    runs = None
    if case.runs:
        runs = Path(fill(case.runs))
        argv += ["--runs-dir", str(runs)]
    return argv, runs


def run_cli(case: Case, data: Path, tmp: Path, timeout: int) -> tuple[subprocess.CompletedProcess,
                                                                     Path | None]:
    """Run the case's command line as a process; return it and its runs dir (None: not set)."""
    argv, runs = command_line(case, data, tmp)
    proc = subprocess.run([sys.executable, "-m", "workflows.pipeline", *argv], cwd=REPO,
                          env=dict(os.environ), capture_output=True, text=True,
                          timeout=timeout, check=False)
    return proc, runs


def published(runs: Path) -> dict[str, list[str]]:
    """Stage -> states of its published (not ``.partial``) outputs under ``runs``."""
    found: dict[str, list[str]] = {}
    for status in sorted(runs.glob("stages/*/*/status.json")):
        if status.parent.name.endswith(".partial"):
            continue
        found.setdefault(status.parent.parent.name, []).append(
            json.loads(status.read_text())["state"])
    return found


def assert_refused(proc: subprocess.CompletedProcess | Console, case: Case, runs: Path | None,
                   failed_stage: str = "tokenize") -> str:
    """The common assertions; ``failed_stage`` and every stage after it published nothing."""
    console = proc.stdout + proc.stderr
    assert proc.returncode == case.code, console[-3000:]
    for text in case.expect:
        assert text in console, f"{text!r} not in the console:\n{console[-3000:]}"
    assert "Traceback" not in console, console[-3000:]
    if runs is not None:
        done = published(runs)
        for name in STAGE_ORDER[STAGE_ORDER.index(failed_stage):]:
            assert "succeeded" not in done.get(name, []), f"{name} looks complete: {done}"
    return console


def assert_refused_before_any_work(proc: subprocess.CompletedProcess | Console, case: Case,
                                   runs: Path | None) -> None:
    """``assert_refused``; the message is the last line if one, and nothing was started."""
    assert_refused(proc, case, runs)
    if case.one_line:
        assert case.expect[0] in proc.stderr.strip().splitlines()[-1], proc.stderr
    if runs is not None:
        assert not (runs / "parsl").exists(), "a Parsl run started for a refused input"
        assert not (runs / "stages").exists(), sorted(runs.rglob("*"))


@pytest.mark.parametrize("case", FAST_CASES, ids=[c.name for c in FAST_CASES])
def test_refused_before_any_work(case: Case, bad_data: Path, tmp_path: Path,
                                 pipeline_main: Callable[..., Console]) -> None:
    argv, runs = command_line(case, bad_data, tmp_path)
    assert_refused_before_any_work(pipeline_main(*argv), case, runs)


REAL_CONSOLE_CASES = [c for c in FAST_CASES if c.name in ("unknown-key", "missing-path")]
assert len(REAL_CONSOLE_CASES) == 2, "a real-console case was renamed"


@pytest.mark.parametrize("case", REAL_CONSOLE_CASES, ids=[c.name for c in REAL_CONSOLE_CASES])
def test_refused_on_the_real_console(case: Case, bad_data: Path, tmp_path: Path) -> None:
    """A config error and an input error as the user meets them: ``python -m
    workflows.pipeline`` in a process of its own, its exit status and console."""
    proc, runs = run_cli(case, bad_data, tmp_path, FAST_TIMEOUT)
    assert_refused_before_any_work(proc, case, runs)


def _status_of_attempt(console: str) -> dict:
    """The failed attempt's status.json, from the path the console names."""
    line = next(li for li in console.splitlines() if li.strip().startswith("status:"))
    path = Path(line.split("status:", 1)[1].strip())
    assert path.parent.name.endswith(".partial"), path
    return json.loads(path.read_text())


@pytest.mark.slow
def test_bad_line_past_the_first_record_fails_in_the_stage(bad_data: Path, tmp_path: Path,
                                                           seed_store) -> None:
    """Pre-flight reads only the first record: the first stage that reads the corpus
    (curation) finds line 41 and says so."""
    seed_store(tmp_path / "runs")
    case = Case("bad-json-line-41", sets(f"data.source={DATA}/bad_third.jsonl"),
                ("pipeline failed:", "curate failed: DataError",
                 "bad_third.jsonl:41: malformed JSON line", "fix the line"), code=1)
    proc, runs = run_cli(case, bad_data, tmp_path, SLOW_TIMEOUT)
    console = assert_refused(proc, case, runs)
    status = _status_of_attempt(console)
    assert status["state"] == "failed", status


@pytest.mark.slow
def test_unreachable_hub_corpus_fails_in_the_stage_with_its_cause(bad_data: Path,
                                                                  tmp_path: Path,
                                                                  seed_store) -> None:
    """An ``hf:`` corpus the hub cannot serve (the tests run offline): the first stage that
    reads it (curation) fails with the hub's own reason and the driver exits, rather than
    hanging after the error."""
    seed_store(tmp_path / "runs")
    case = Case("offline-hub", (*sets("data.source=hf:someorg/nocorpus"), "--only", "curate"),
                ("pipeline failed:", "curate failed: ConnectionError",
                 "Couldn't reach 'someorg/nocorpus' on the Hub (OfflineModeIsEnabled)"), code=1)
    proc, runs = run_cli(case, bad_data, tmp_path, SLOW_TIMEOUT)
    console = assert_refused(proc, case, runs)
    assert _status_of_attempt(console)["state"] == "failed"


@pytest.fixture(scope="module")
def tokenized(tmp_path_factory: pytest.TempPathFactory, bad_data: Path, seed_store
              ) -> tuple[Path, subprocess.CompletedProcess, Case]:
    """A runs dir whose tokenize stage succeeded and whose plan stage failed (an unknown
    cluster, found before the plan stage measures this machine); the plan cases copy it,
    so they only run the plan stage."""
    tmp = tmp_path_factory.mktemp("tokenized")
    case = Case("unknown-cluster", sets("parallel.cluster=nosuch"),
                ("plan failed: ClusterError: cluster 'nosuch' not found",
                 f"give a YAML path or one of {CLUSTER_NAMES}"), code=1)
    seed_store(tmp / "runs")
    proc, _ = run_cli(case, bad_data, tmp, SLOW_TIMEOUT)
    return tmp / "runs", proc, case


@pytest.mark.slow
def test_unknown_cluster_fails_in_the_plan_stage(tokenized) -> None:
    runs, proc, case = tokenized
    console = assert_refused(proc, case, runs, failed_stage="plan")
    assert published(runs).get("tokenize") == ["succeeded"], published(runs)
    assert _status_of_attempt(console)["state"] == "failed"


PLAN_CASES = [
    Case("tp-not-dividing-vocab-and-mlp",
         sets("parallel.tp=3", "parallel.nproc=3", "model.n_heads=6", "model.d_model=48"),
         ("parallel.tp=3 is not possible", "round model.vocab_size up to a multiple of 3")),
    Case("tp-not-dividing-heads", sets("parallel.tp=2", "model.n_heads=3", "model.d_model=48"),
         ("parallel.tp=2 is not possible", "model.n_heads=3")),
]


@pytest.mark.slow
@pytest.mark.parametrize("case", PLAN_CASES, ids=[c.name for c in PLAN_CASES])
def test_parallel_settings_that_cannot_work(case: Case, tokenized, tmp_path: Path,
                                            seed_microbench, seed_store) -> None:
    """The plan stage judges these settings: its work, run in this process (the inline
    executor) on the store of the tokenized runs dir, refuses them with a PlanError that
    names the setting and the fix. How the driver shows a stage's refusal (exit 1, "plan
    failed: <error>", no traceback, nothing published) is the unknown-cluster case's,
    which fails in the same stage through the real command line."""
    from model.parallel.layout import PlanError
    from stages.config import load_config
    from stages.mechanism.walk import run_work
    from stages.registry import declaration
    from tests.test_data_common import make_tracker

    source, first, _ = tokenized
    assert published(source).get("tokenize") == ["succeeded"], first.stdout + first.stderr
    (outputs,) = [json.loads(p.read_text())
                  for p in source.glob("stages/tokenize/*/outputs.json")
                  if not p.parent.name.endswith(".partial")]
    runs = tmp_path / "runs"
    seed_microbench(runs, 3)
    overrides = [arg for arg in case.args if arg != "--set"]
    cfg = load_config(REPO / MICRO, [*overrides, f"tracking.runs_dir={runs}"])
    tracker, _, _ = make_tracker(tmp_path / "mlflow", seed_store, "micro")
    with pytest.raises(PlanError) as refused:
        run_work(declaration("plan"), cfg, {"tokenize": outputs}, tmp_path / "plan", tracker)
    for text in case.expect:
        assert text in str(refused.value), str(refused.value)


@pytest.mark.slow
def test_preflight_checks_exactly_the_stages_the_driver_computes(tokenized) -> None:
    """Pre-flight and the driver agree on what a run reuses: a published tokenize output is
    not checked again (its inputs may be gone), the stages after it are."""
    from stages.config import load_config
    from stages.mechanism.preflight import stages_to_compute
    from stages.mechanism.selection import decide_stages

    runs, _, _ = tokenized
    cfg = load_config(MICRO, ["parallel.cluster=nosuch", f"tracking.runs_dir={runs}"])

    def computed(only: str | None = None, start: str | None = None) -> list[str]:
        decisions = decide_stages(PIPELINE, cfg, only, start, False)
        return [s.name for s in stages_to_compute(PIPELINE, decisions)]

    assert computed() == ["plan", "train", "evaluate"]
    assert computed(start="plan") == ["plan", "train", "evaluate"]
    assert computed(only="tokenize") == ["tokenize"]
