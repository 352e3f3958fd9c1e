"""The pipeline configuration: one typed section per concern, loaded from YAML.

``load_config(path, overrides)`` reads a preset, applies ``section.key=value`` overrides
and validates everything before any work starts. Unknown keys and invalid values raise
``ConfigError`` naming the key and what is allowed.
"""
from __future__ import annotations

import dataclasses
import re
import shlex
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from data_prep.config import DataConfig, TokenizerConfig
from data_prep.curate.config import CurateConfig
from model.config import ModelConfig, ParallelConfig, TrainConfig
from stages.mechanism.errors import ConfigError

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"
DEFAULT_CONFIG = CONFIG_DIR / "tiny.yaml"


@dataclass
class EvalConfig:
    """Held-out evaluation.

    Two layouts (``layout``): ``replicas`` loads the whole model in every evaluation
    process; ``training`` spreads it over the training plan's tp x pp ranks, so no process
    ever holds all of it. With ``training`` the held-out loss and both generations (greedy,
    and sampled with the fixed seed ``train.seed``: every rank draws the same tokens) run
    on the ranks; the Hugging Face export is streamed from the checkpoint as always; the
    lm-eval tasks need one process holding the model and are refused (``tasks``).
    """

    max_tokens: int = 32768
    """Evaluate validation loss over at most this many tokens (token-weighted)."""
    batch_size: int = 8
    """Sequences per evaluation batch."""
    prompts: list[str] = field(default_factory=lambda: ["def main(", "import "])
    """Prompts for the greedy and sampled generations written as an artifact."""
    generate_tokens: int = 48
    """Tokens generated per prompt."""
    temperature: float = 0.8
    """Sampling temperature of the sampled generations."""
    tasks: list[str] = field(default_factory=list)
    """lm-eval-harness task names to run (needs the 'eval' extra); empty: none.
    'heldout_perplexity' is built from the validation split and needs no download."""
    task_limit: int | None = 64
    """Documents per lm-eval task (None: all)."""
    task_include: str | None = None
    """Directory of extra lm-eval task YAML files (custom local tasks)."""
    log_model: bool = True
    """Log the Hugging Face export as an MLflow model (text-generation, with a signature)."""
    ranks: int = 1
    """Processes that compute the held-out loss data-parallel (windows dealt round-robin,
    sums all-reduced over gloo: the result does not depend on it). 1: computed inside the
    evaluate stage's own process (Parsl "cpu" executor, the submitting node), no launch.
    > 1: ranks started like the training ranks (``stages.mechanism.launch`` locally; srun on
    slurm/frontier,
    inside the training job's allocation), all on one node: on slurm a non-exclusive job
    asks for at least this many CPUs per node, on Frontier it must be <= 8 (one rank per
    GCD). Generations, lm-eval and the export run once, in the stage's driver-side app.
    With ``layout: training``: tp*pp*k ranks (k model replicas of the training plan's tp x pp
    layout, which split the windows), at most ``parallel.nproc``."""
    layout: Literal["replicas", "training"] = "replicas"
    """replicas: every rank loads the whole model and evaluates its share of the windows
    (small models). training: the ranks take the training plan's tp x pp layout, each loads
    only its shard of the checkpoint, and the loss and generations run on them (a model too
    big for one process); lm-eval tasks are refused."""

    def __post_init__(self) -> None:
        if self.ranks < 1:
            raise ValueError(f"eval.ranks must be >= 1, got {self.ranks}")
        if self.layout == "training" and self.tasks:
            raise ValueError(
                f"eval.tasks={self.tasks} with eval.layout=training: lm-eval drives one model "
                "object in one process, which the training layout never builds: set "
                "eval.tasks=[] or eval.layout=replicas")
        if self.task_limit is not None and self.task_limit <= 0:
            raise ValueError(f"eval.task_limit must be > 0 or null, got {self.task_limit}")
        if self.max_tokens <= 0:
            raise ValueError(f"eval.max_tokens must be > 0, got {self.max_tokens}")
        if self.batch_size <= 0:
            raise ValueError(f"eval.batch_size must be > 0, got {self.batch_size}")
        if self.generate_tokens < 0:
            raise ValueError("eval.generate_tokens must be >= 0")
        if self.temperature <= 0:
            raise ValueError("eval.temperature must be > 0")


@dataclass
class TrackingConfig:
    """Where outputs and MLflow runs go."""

    runs_dir: str = "runs"
    """Directory for stage outputs and the default MLflow store (relative to the cwd)."""
    uri: str | None = None
    """MLflow tracking URI; None means MLFLOW_TRACKING_URI or sqlite:///<runs_dir>/mlflow.db."""
    experiment: str | None = None
    """MLflow experiment name; None means the config's name."""
    server: bool | None = None
    """Without ``uri`` on a Slurm site: the driver starts an MLflow server over the runs
    dir's SQLite file and everything logs through it (``workflows.tracking_server``), so no
    compute node writes the file over the shared file system. None: on Frontier only."""
    system_metrics: Literal["auto", True, False] = "auto"
    """Sample each node's CPU, memory, disk, network and (with pynvml or pyrsmi) GPU use into
    the train and evaluate stage runs, as ``system/<host>/<metric>``: one sampler per node
    (its local rank 0). auto: on, on every site (a laptop's run shows its machine's use too;
    benchmarks/bench_system_metrics.py measures the cost below 1 % of a step)."""
    system_metrics_interval_s: float = 10.0
    """Seconds between two samples of ``system_metrics``."""

    def system_metrics_on(self, site: str) -> bool:
        """Whether the nodes sample system metrics on site ``site`` (``site.name``)."""
        if self.system_metrics == "auto":
            return True
        return bool(self.system_metrics)

    def __post_init__(self) -> None:
        if not isinstance(self.system_metrics, bool) and self.system_metrics != "auto":
            raise ValueError(f"tracking.system_metrics={self.system_metrics!r} is not allowed; "
                             "choose auto, true or false")
        if self.system_metrics_interval_s <= 0:
            raise ValueError("tracking.system_metrics_interval_s must be > 0 seconds, got "
                             f"{self.system_metrics_interval_s}")
        if not self.runs_dir.strip():
            raise ValueError("tracking.runs_dir is empty: give a directory (--runs-dir DIR)")
        # One line: the runs dir reaches command lines and scripts (quoted where this project
        # writes them; where Parsl writes it unquoted, workflows.frontier refuses more).
        problem = control_char_problem(self.runs_dir)
        if problem:
            raise ValueError(f"tracking.runs_dir={self.runs_dir!r} (--runs-dir) contains "
                             f"{problem}: choose a path on one line")


@dataclass
class SiteConfig:
    """Where the stages run: this machine, a Slurm cluster, or Frontier."""

    name: Literal["local", "slurm", "frontier"] = "local"
    """Site kind: local (HTEX on this machine), slurm (generic) or frontier."""
    max_workers: int = 2
    """Parallel Parsl workers for the light stages: on this machine (local), per compute node
    of the tokenize block (slurm, frontier)."""
    login_workers: Literal["processes", "threads"] = "processes"
    """How the Parsl workers on the submitting machine (the login node; locally every stage's
    Python apps and the launcher of its ranks) run: "processes" (a HighThroughputExecutor:
    an interchange, a worker pool and worker processes, apps in parallel beyond the GIL) or
    "threads" (Parsl's ThreadPoolExecutor inside the driver: nothing to start, the stages'
    libraries imported once; for small runs, whose apps take less than starting the workers
    does). Ranks and compute-node workers are processes either way."""
    tokenize_nodes: int = 1
    """Compute nodes of the tokenize block (slurm, frontier): one Slurm job of this many nodes,
    one worker pool of site.max_workers workers on each; the input shards spread over them."""
    account: str | None = None
    """Slurm account (required on Frontier)."""
    partition: str | None = None
    """Slurm partition."""
    qos: str | None = None
    """Slurm QOS."""
    walltime: str = "00:30:00"
    """Slurm walltime of the training block (its allocation), HH:MM:SS; also of the other
    blocks unless ``compute_walltime`` is set."""
    compute_walltime: str | None = None
    """Slurm walltime of the compute (tokenize) block and of the evaluation's allocation,
    HH:MM:SS; None: ``walltime``. On Frontier a small job's bin allows less than a large
    one's (2 h below 92 nodes)."""
    worker_init: str = ""
    """Shell lines run before workers start (module loads, conda activate)."""
    conda_env: str | None = None
    """Conda environment activated on compute nodes (Frontier)."""
    retries: int = 1
    """Parsl retries for a failed app; training resumes from the last checkpoint."""
    scheduler_options: str = ""
    """Extra #SBATCH lines."""
    rccl_plugin_path: str | None = None
    """Directory of an aws-ofi-rccl plugin build put first on the ranks' LD_LIBRARY_PATH
    (Frontier); None: OLCF's rccl-net-plugin module provides the plugin."""
    node_local_env: str | None = None
    """A packed Python environment (a conda-pack or venv-pack tarball, absolute path) that
    every Frontier job copies with sbcast to each node's NVMe and runs from (/mnt/bb/$USER,
    #SBATCH -C nvme); None: site.conda_env, or the submitting interpreter, read over the
    shared filesystem."""
    modules: list[str] | None = None
    """Environment modules loaded on compute nodes; None: the site default (ROCm on Frontier)."""
    env: list[str] = field(default_factory=list)
    """Extra KEY=VALUE environment variables for the training ranks (override site defaults)."""
    srun_options: str | None = None
    """Extra srun options for the training ranks; None: the site default
    (Frontier: '-c7 --gpus-per-task=1 --gpu-bind=closest', slurm: '--cpus-per-task=1')."""
    exclusive: bool | None = None
    """Request whole nodes (#SBATCH --exclusive); None: the site default
    (Frontier yes, slurm no)."""
    cores_per_node: int | None = None
    """CPUs requested per node for a non-exclusive training job; None: one per rank."""
    address: str | None = None
    """Address of the submitting node that compute-node workers connect back to (slurm,
    frontier); None: Parsl offers all of this node's addresses and workers probe them."""
    heartbeat_threshold: int = 120
    """Seconds without a heartbeat before Parsl declares a job's workers lost and retries
    their tasks (e.g. after a cancelled or preempted Slurm job)."""
    save_before_end_s: int | None = None
    """Seconds before the walltime at which Slurm signals the training ranks (#SBATCH
    --signal=USR1@N) to checkpoint at the next step and end the job out of time; the next
    job resumes there. Leave one step, one checkpoint save and Slurm's up to 60 s early
    delivery. None: 600 on Frontier, 180 elsewhere, at most a quarter of the walltime;
    0: no signal (SIGTERM at the walltime still stops the ranks at the next step)."""
    failures_per_node_hour: float | None = None
    """Failures per node-hour of the training's nodes: the readiness report's expected
    interruptions and lost work, and ``train.checkpoint_minutes: auto``. None: Llama 3 405B's
    1.58e-4 (``model.planner.failures``; docs/frontier.md)."""

    def save_before_end(self) -> int:
        """Seconds before the walltime the training ranks are signalled to stop (0: never):
        ``save_before_end_s``, else 600 on Frontier and 180 on other Slurm sites, at most a
        quarter of the walltime; 0 on the local site (no walltime)."""
        if self.name == "local":
            return 0
        if self.save_before_end_s is not None:
            return self.save_before_end_s
        hours, minutes, seconds = (int(part) for part in self.walltime.split(":"))
        default = 600 if self.name == "frontier" else 180
        return min(default, (hours * 3600 + minutes * 60 + seconds) // 4)

    def __post_init__(self) -> None:
        _check_site_text(self)
        for item in self.env:
            if "=" not in item or not item.split("=", 1)[0].strip():
                raise ValueError(f"site.env entries must look like KEY=VALUE, got {item!r}")
            if not _SHELL_NAME.fullmatch(item.split("=", 1)[0].strip()):
                raise ValueError(
                    f"site.env entry {item!r}: {item.split('=', 1)[0].strip()!r} is not a shell "
                    "variable name (letters, digits and _, not starting with a digit): fix the key"
                )
        if self.cores_per_node is not None and self.cores_per_node <= 0:
            raise ValueError(f"site.cores_per_node must be > 0, got {self.cores_per_node}")
        if self.heartbeat_threshold <= 0:
            raise ValueError(
                f"site.heartbeat_threshold must be > 0 seconds, got {self.heartbeat_threshold}"
            )
        if self.max_workers <= 0:
            raise ValueError(f"site.max_workers must be > 0, got {self.max_workers}")
        if self.tokenize_nodes <= 0:
            raise ValueError(f"site.tokenize_nodes must be > 0, got {self.tokenize_nodes}")
        if self.retries < 0:
            raise ValueError("site.retries must be >= 0")
        if self.save_before_end_s is not None and self.save_before_end_s < 0:
            raise ValueError(f"site.save_before_end_s must be >= 0 seconds, got "
                             f"{self.save_before_end_s}")
        for name in ("walltime", "compute_walltime"):
            value = getattr(self, name)
            parts = str(value).split(":")
            if value is not None and (len(parts) != 3 or not all(p.isdigit() for p in parts)):
                raise ValueError(f"site.{name} must be HH:MM:SS, got {value!r}")
            problem = value is not None and walltime_rounding_problem(f"site.{name}", value)
            if problem:
                raise ValueError(problem)
        if self.failures_per_node_hour is not None and self.failures_per_node_hour <= 0:
            raise ValueError(f"site.failures_per_node_hour must be > 0 or null (Llama 3's "
                             f"rate), got {self.failures_per_node_hour}")
        parts = self.walltime.split(":")
        wall = int(parts[0]) * 3600 + int(parts[1]) * 60 + int(parts[2])
        if self.save_before_end_s and self.save_before_end_s >= wall:
            raise ValueError(
                f"site.save_before_end_s={self.save_before_end_s} is not shorter than "
                f"site.walltime={self.walltime} ({wall} s): the ranks would be told to stop "
                "before they start; lower it or lengthen the walltime")


def walltime_seconds(walltime: str) -> int:
    """``site.walltime`` (HH:MM:SS, hours may exceed 24) in seconds."""
    hours, minutes, seconds = (int(part) for part in walltime.split(":"))
    return hours * 3600 + minutes * 60 + seconds


def walltime_rounding_problem(setting: str, walltime: str) -> str | None:
    """Why Slurm would not run ``walltime`` (HH:MM:SS) as written, or None: Parsl hands
    sbatch whole minutes (``--time=M``, the seconds dropped) while the save before the end
    is timed from the seconds written, so seconds, or less than a minute, are refused."""
    hours, minutes, seconds = (int(part) for part in walltime.split(":"))
    total = hours * 3600 + minutes * 60 + seconds
    if seconds == 0 and total >= 60:
        return None
    down = total // 60 * 60
    near = [t for t in (down + 60, down) if t >= 60]
    shown = " or ".join(f"{t // 3600:02d}:{t % 3600 // 60:02d}:00" for t in near)
    return f"{setting}={walltime}: Slurm takes whole minutes (at least one); use {shown}"


_SHELL_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_SHELL_BARE = re.compile(r"[A-Za-z0-9_@%+=:,./-]")
"""The ASCII characters ``shlex.quote`` leaves bare: a word of only these (and non-ASCII
letters and digits) means itself to a shell, quoted or not."""
_ONE_LINE_FIELDS = ("account", "partition", "qos", "walltime", "compute_walltime", "conda_env",
                    "rccl_plugin_path", "node_local_env", "srun_options", "address")
_MULTI_LINE_FIELDS = ("worker_init", "scheduler_options")
_TARBALL = re.compile(r".+\.(tar|tgz|tar\.[A-Za-z0-9]+)")


def unquoted_shell_problem(setting: str, value: str, where: str,
                           also_refuse: str = "") -> str | None:
    """The one shell-safety rule for a value written into a shell line without quotes.

    A value this project writes into a command or script itself is ``shlex.quote``d and
    needs no rule (only ``control_char_problem``: one line). A value another tool writes
    unquoted (Parsl: the #SBATCH lines, the worker pool's command line, its local submit
    script, ``$PARSL_MPI_PREFIX``) must mean itself to a shell: every character is one that
    ``shlex.quote`` leaves bare (letters, digits and ``_ @ % + = : , . / -``) or a non-ASCII
    letter or digit, and none is in ``also_refuse`` (``%``, which sbatch expands in file
    names). Returns the one-line refusal naming ``setting``, the characters and ``where``
    the value goes, or None when the value is safe.
    """
    bad = sorted({ch for ch in value if ch in also_refuse or not (
        _SHELL_BARE.fullmatch(ch) or (ord(ch) > 127 and ch.isalnum()))})
    if not bad:
        return None
    allowed = "".join(ch for ch in "_ @ % + = : , . / -" if ch not in also_refuse)
    shown = " ".join(repr(ch) for ch in bad)
    return (f"{setting}={value!r} holds {shown}: {where}, where such characters split the "
            f"line or run as commands: use only letters, digits and {' '.join(allowed.split())}")


def control_char_problem(value: str, allow: str = "") -> str | None:
    """Words for the first newline or control character of ``value`` not in ``allow``."""
    for char in value:
        code = ord(char)
        if char in allow or not (code < 32 or 127 <= code < 160 or char in "\u2028\u2029"):
            continue
        if char == "\n":
            return "a newline"
        return "a carriage return (\\r)" if char == "\r" else f"a control character ({char!r})"
    return None


def _check_site_text(site: SiteConfig) -> None:
    """Refuse site values that cannot reach a shell script intact (see the field notes)."""
    values: list[tuple[str, str | None]] = [(f, getattr(site, f)) for f in _ONE_LINE_FIELDS]
    values += [(f"modules[{i}]", m) for i, m in enumerate(site.modules or [])]
    values += [(f"env[{i}]", item) for i, item in enumerate(site.env)]
    for name, value in values:
        problem = value and control_char_problem(value)
        if problem:
            raise ValueError(
                f"site.{name}={value!r} contains {problem}: a site value is written into the "
                "batch script or the ranks' command as one line: remove it")
    for name in _MULTI_LINE_FIELDS:
        problem = control_char_problem(getattr(site, name), allow="\n\t")
        if problem:
            raise ValueError(f"site.{name} contains {problem}: remove it (lines are separated "
                             "by newlines only)")
    unquoted = [(f"site.{name}", getattr(site, name), "Parsl writes it unquoted into an "
                 "#SBATCH line") for name in ("account", "partition", "qos")]
    unquoted.append(("site.address", site.address, "it is not a host name or an IP address, "
                     "and Parsl writes it unquoted into the worker pool's command line"))
    for setting, value, where in unquoted:
        problem = value is not None and unquoted_shell_problem(setting, value, where)
        if problem:
            raise ValueError(problem)
    for module in site.modules or []:
        if not module.strip() or any(ch.isspace() for ch in module):
            raise ValueError(f"site.modules entry {module!r} is not one module name: give one "
                             "module per list entry, e.g. site.modules=[PrgEnv-gnu, rocm/6.4.1]")
    if site.srun_options:
        try:
            words = shlex.split(site.srun_options)
        except ValueError as error:
            raise ValueError(f"site.srun_options={site.srun_options!r} does not split into "
                             f"srun options ({error}): fix its quotes") from None
        for word in words:
            problem = unquoted_shell_problem(
                "site.srun_options word", word, "Parsl hands the ranks' srun line to the app as "
                "an unquoted $PARSL_MPI_PREFIX, which splits at spaces, keeps quotes as "
                "characters and expands * ? [")
            if problem:
                raise ValueError(problem)
    for line in site.scheduler_options.splitlines():
        if line.strip() and not line.strip().startswith("#"):
            raise ValueError(
                f"site.scheduler_options line {line.strip()!r} is not an #SBATCH line: sbatch "
                "stops reading options at the first command; put shell lines in site.worker_init")
    if site.rccl_plugin_path is not None and not site.rccl_plugin_path.startswith("/"):
        raise ValueError(f"site.rccl_plugin_path={site.rccl_plugin_path!r} must be an absolute "
                         "directory (the plugin's lib/), or unset to use OLCF's module")
    if site.node_local_env is not None and not (
            site.node_local_env.startswith("/") and _TARBALL.fullmatch(site.node_local_env)):
        raise ValueError(
            f"site.node_local_env={site.node_local_env!r} must be the absolute path of a packed "
            "environment tarball (.tar, .tar.gz, .tgz), e.g. made by conda-pack -p <env> -o "
            "/lustre/orion/<project>/proj-shared/envs/frontier-llm.tar.gz")


@dataclass
class PipelineConfig:
    """The whole pipeline: one section per stage concern."""

    name: str = "tiny"
    """Name of this configuration (the MLflow experiment by default)."""
    data: DataConfig = field(default_factory=DataConfig)
    curate: CurateConfig = field(default_factory=CurateConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    site: SiteConfig = field(default_factory=SiteConfig)

    def __post_init__(self) -> None:
        if self.train.seq_len > self.model.max_seq_len:
            raise ValueError(
                f"train.seq_len={self.train.seq_len} exceeds model.max_seq_len="
                f"{self.model.max_seq_len}: lower train.seq_len or raise model.max_seq_len"
            )
        if self.tokenizer.path is None and self.tokenizer.vocab_size > self.model.vocab_size:
            raise ValueError(
                f"tokenizer.vocab_size={self.tokenizer.vocab_size} exceeds model.vocab_size="
                f"{self.model.vocab_size}: raise model.vocab_size or lower tokenizer.vocab_size"
            )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def runs_dir(self) -> Path:
        return Path(self.tracking.runs_dir).resolve()


def _field_help(cls: type) -> str:
    return ", ".join(f.name for f in dataclasses.fields(cls))


def _convert(value: Any, annotation: Any, key: str) -> Any:
    """Check ``value`` against a field annotation; return it (ints widen to float)."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(annotation)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _convert(value, option, key)
            except ConfigError as err:
                errors.append(str(err))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{key}: invalid value {value!r}")
    if origin is Literal:
        allowed = typing.get_args(annotation)
        if value not in allowed:
            raise ConfigError(f"{key}={value!r} is not allowed; choose one of {list(allowed)}")
        return value
    if origin is list:
        (item_type,) = typing.get_args(annotation)
        if not isinstance(value, list):
            raise ConfigError(f"{key} must be a list, got {value!r}")
        return [_convert(v, item_type, f"{key}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        key_type, value_type = typing.get_args(annotation)
        if not isinstance(value, dict):
            raise ConfigError(f"{key} must be a mapping, got {value!r}")
        return {_convert(k, key_type, f"{key} key {k!r}"): _convert(v, value_type, f"{key}.{k}")
                for k, v in value.items()}
    if annotation is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key} must be true or false, got {value!r}")
        return value
    if annotation is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key} must be an integer, got {value!r}")
        return value
    if annotation is float:
        if isinstance(value, str):  # YAML 1.1 reads "1e-3" (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key} must be a number, got {value!r}")
        return float(value)
    if annotation is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key} must be a string, got {value!r}")
        return value
    raise ConfigError(f"{key}: unsupported field type {annotation!r}")


def build_dataclass(cls: type, raw: dict[str, Any] | None, prefix: str) -> Any:
    """Build dataclass ``cls`` from a plain mapping, refusing unknown keys and bad types."""
    raw = raw or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{prefix or 'config'} must be a mapping, got {raw!r}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted((_yaml_key(key) for key in set(raw) - names), key=str)
    if unknown:
        where = f"{prefix}." if prefix else ""
        raise ConfigError(
            f"unknown key '{where}{unknown[0]}'; allowed keys"
            f"{' in ' + prefix if prefix else ''}: {_field_help(cls)}"
        )
    kwargs = {}
    for name, value in raw.items():
        key = f"{prefix}.{name}" if prefix else name
        annotation = hints[name]
        if dataclasses.is_dataclass(annotation):
            kwargs[name] = build_dataclass(annotation, value, key)
        else:
            kwargs[name] = _convert(value, annotation, key)
    try:
        return cls(**kwargs)
    except ValueError as err:
        if isinstance(err, ConfigError):
            raise
        raise ConfigError(str(err)) from None


def _set_path(tree: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {dotted}: '{part}' is not a section")
    node[parts[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """Parse ``section.key=value``; the value is read as YAML (so 3, 0.1, true, null work),
    except a clock time such as ``12:00:00``, which stays a string (YAML 1.1 would read it
    as a base-60 integer, 43200)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like section.key=value")
    key, raw_value = text.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"override {text!r} has no key")
    if _CLOCK.fullmatch(raw_value.strip()):
        return key, raw_value.strip()
    return key, yaml.safe_load(raw_value) if raw_value.strip() else ""


_CLOCK = re.compile(r"\d+(:\d\d)+")


def resolve_preset(path: str | Path) -> Path:
    """Find a config by path, or by name in configs/ (``tiny`` -> configs/tiny.yaml)."""
    candidate = Path(path)
    if candidate.exists():
        return candidate
    named = CONFIG_DIR / f"{path}.yaml"
    if named.exists():
        return named
    raise ConfigError(f"config file {str(path)!r} not found (nor {named})")


def _read_preset(preset: Path) -> dict[str, Any]:
    """The YAML mapping of a pipeline config file; ConfigError (one line, with the fix) for a
    directory, an unreadable or non-text file, broken YAML, an empty file, or YAML that is
    not a pipeline config (a list, another tool's file such as a CI workflow)."""
    if preset.is_dir():
        raise ConfigError(f"--config {str(preset)!r} is a directory, not a config file: give a "
                          f"YAML file, e.g. {preset / 'tiny.yaml'}, or a preset name (tiny)")
    try:
        raw = yaml.safe_load(preset.read_text(encoding="utf-8"))
    except OSError as err:
        raise ConfigError(f"--config {str(preset)!r} cannot be read ({err.strerror or err}): "
                          "give a readable YAML file") from None
    except UnicodeDecodeError:
        raise ConfigError(f"--config {str(preset)!r} is not UTF-8 text: give a YAML "
                          "pipeline config") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{preset}: not valid YAML: {' '.join(str(err).split())}") from None
    if raw is None:  # taken silently as all defaults, it would train the tiny preset
        raise ConfigError(f"{preset} is empty: give it the sections to set (configs/tiny.yaml "
                          "shows them all), or leave out --config for the defaults")
    sections = _field_help(PipelineConfig)
    if not isinstance(raw, dict):
        raise ConfigError(f"{preset} is not a pipeline config: its top level is a "
                          f"{type(raw).__name__}, not a mapping of sections ({sections}); "
                          "configs/tiny.yaml shows one")
    # "name:" alone proves nothing (a CI workflow has one); a misspelt section of a real
    # config is named by build_dataclass
    known = {f.name for f in dataclasses.fields(PipelineConfig)} - {"name"}
    if not any(key in known for key in raw) and set(raw) - {"name"}:
        # YAML 1.1 reads a CI workflow's "on:" as true: show the keys as the file wrote them
        shown = ", ".join(repr(_yaml_key(key)) for key in raw if key != "name")
        raise ConfigError(f"{preset} is not a pipeline config: unknown key {shown} and none of "
                          f"the sections {', '.join(n for n in sections.split(', ') if n in known)}"
                          " (configs/tiny.yaml shows them all)")
    return raw


def _yaml_key(key: Any) -> str:
    """A mapping key as a YAML file may have written it (``on`` and ``yes`` load as true)."""
    if isinstance(key, bool):
        return "on/yes/true" if key else "off/no/false"
    return str(key)


def load_config(
    path: str | Path | None = None, overrides: list[str] | None = None
) -> PipelineConfig:
    """Load a YAML preset (default configs/tiny.yaml), apply overrides, validate."""
    preset = resolve_preset(path) if path is not None else DEFAULT_CONFIG
    raw = _read_preset(preset)
    for text in overrides or []:
        key, value = parse_override(text)
        _set_path(raw, key, value)
    adopt_init_from_shape(raw)
    return build_dataclass(PipelineConfig, raw, "")


def adopt_init_from_shape(raw: dict[str, Any]) -> None:
    """With ``train.init_from`` set (and present on this machine), take the model shape from
    that checkpoint: every model.* key the config sets must equal the checkpoint's, else a
    ConfigError names both values. A path that does not exist yet (a preset's placeholder)
    is left to the train stage, which refuses it by name."""
    train = raw.get("train")
    source = train.get("init_from") if isinstance(train, dict) else None
    if not isinstance(source, str) or not source or not Path(source).exists():
        return
    from model.evaluation.import_hf import init_model_config

    try:
        shape = dataclasses.asdict(init_model_config(source))
    except ValueError as err:
        raise ConfigError(f"train.init_from {source!r}: {err}") from None
    given = raw.get("model") or {}
    if not isinstance(given, dict):
        raise ConfigError(f"model must be a mapping, got {given!r}")
    conflicts = [f"model.{k}={v!r} but train.init_from has {k}={shape[k]!r}"
                 for k, v in given.items() if k in shape and k != "init_std" and v != shape[k]]
    if conflicts:
        raise ConfigError(f"{'; '.join(conflicts)} ({source}): the model shape comes from "
                          "train.init_from; remove these model settings or make them match")
    raw["model"] = {**given, **{k: v for k, v in shape.items() if k != "init_std"}}


def config_from_dict(raw: dict[str, Any]) -> PipelineConfig:
    """Rebuild a PipelineConfig from ``to_dict()`` output (used by launched rank processes)."""
    return build_dataclass(PipelineConfig, raw, "")
