"""Site values reach the batch scripts and the ranks' command intact: hostile values
(spaces, quotes, ``$(...)``, backquotes, semicolons) are quoted, so bash parses each line
into the intended words and runs none of them; values that cannot be carried (a newline,
a word that Parsl's unquoted srun prefix would split) are refused naming the field.

The scripts are checked three ways: ``bash -n`` (the whole script parses), ``shlex.split``
of the lines that carry the values (the intended words), and bash running the lines with
stand-ins for the cluster tools (the values arrive literally, nothing is executed).
"""
from __future__ import annotations

import json
import os
import shlex
import subprocess
from pathlib import Path

import pytest

from stages.config import ConfigError, SiteConfig, load_config
from stages.mechanism.launch import RankSpec
from workflows.dry_run import batch_script, srun_line
from workflows.executors import worker_init
from workflows.ranks import ranks_command

HOSTILE = "a b 'q' \"dq\" $(touch PWNED) `touch PWNED`; touch PWNED & echo | cat > PWNED"
"""A value that runs ``touch PWNED`` (or writes PWNED) wherever it is not quoted."""

HOSTILE_MODULE = "odd$(touch${IFS}PWNED);'x'\"y\"`touch${IFS}PWNED`"
"""A module entry has no white space (one name per entry), but may hold anything else."""

RUN_DIR = Path("/lustre/orion/abc123/scratch/runs/tiny")
CONDA_ENV = f"/ccs/proj/p q/{HOSTILE}"
PLUGIN = f"/opt/my plugin/{HOSTILE}"
ENV_ITEMS = [f"X_VALUE={HOSTILE}", "NCCL_DEBUG=INFO;touch PWNED", "EMPTY="]


def _yaml(value: object) -> str:
    """An override value read back exactly (JSON is YAML)."""
    return json.dumps(value)


def _frontier(*extra: str):
    return load_config(None, [
        "site.name=frontier", "site.account=ABC123", "parallel.nproc=16", "parallel.nodes=2",
        f"tracking.runs_dir={RUN_DIR}", f"site.modules={_yaml(['rocm/6.4.1', HOSTILE_MODULE])}",
        f"site.rccl_plugin_path={_yaml(PLUGIN)}", f"site.env={_yaml(ENV_ITEMS)}", *extra,
    ])


def _line(script: str, start: str) -> str:
    """The one line of ``script`` that starts with ``start``."""
    (line,) = [line for line in script.splitlines() if line.startswith(start)]
    return line


def _bash_parses(script: str) -> None:
    proc = subprocess.run(["bash", "-n"], input=script, text=True, capture_output=True,
                          check=False)
    assert proc.returncode == 0, proc.stderr


def _tools(tmp_path: Path, tools: dict[str, str]) -> dict[str, str]:
    """Stand-in scripts for cluster tools, first on PATH."""
    bin_dir = tmp_path / "tools"
    bin_dir.mkdir(exist_ok=True)
    for name, body in tools.items():
        path = bin_dir / name
        path.write_text(f"#!/bin/bash\n{body}\n")
        path.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}


def test_hostile_values_in_the_batch_scripts_parse_into_the_intended_words(tmp_path):
    cfg = _frontier(f"site.conda_env={_yaml(CONDA_ENV)}")
    for label in ("train", "compute"):
        script = batch_script(cfg, RUN_DIR, label)
        _bash_parses(script)
        assert shlex.split(_line(script, "module load")) == [
            "module", "load", "rocm/6.4.1", HOSTILE_MODULE]
        assert shlex.split(_line(script, "source activate")) == ["source", "activate", CONDA_ENV]
        assert "rccl-net-plugin" not in script  # site.rccl_plugin_path replaces the module

    # Run the worker's init lines with module and source standing in: each records the
    # words it got; nothing of the values runs.
    init = worker_init(cfg)
    record = tmp_path / "calls"
    stand_ins = (f'module() {{ printf "%s\\0" module "$@" >> {shlex.quote(str(record))}; }}\n'
                 f'source() {{ printf "%s\\0" source "$@" >> {shlex.quote(str(record))}; }}\n')
    proc = subprocess.run(["bash", "-c", stand_ins + init], cwd=tmp_path, capture_output=True,
                          text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    assert record.read_text().split("\0")[:-1] == [
        "module", "load", "rocm/6.4.1", HOSTILE_MODULE, "source", "activate", CONDA_ENV]
    assert not (tmp_path / "PWNED").exists()


def test_hostile_node_local_env_path_reaches_sbcast_as_one_argument(tmp_path):
    tarball = f"/lustre/orion/p q/{HOSTILE}.tar.gz"
    cfg = _frontier(f"site.node_local_env={_yaml(tarball)}")
    script = batch_script(cfg, RUN_DIR)
    _bash_parses(script)
    words = shlex.split(_line(script, "sbcast "))
    assert words[:5] == ["sbcast", "--preserve", "--force", tarball,
                         "/mnt/bb/$USER/frontier-llm-env.tar"]
    record = tmp_path / "sbcast.args"
    env = _tools(tmp_path, {"sbcast": f'printf "%s\\0" "$@" > {shlex.quote(str(record))}',
                            "srun": "exit 0"})
    proc = subprocess.run(["bash", "-c", worker_init(cfg)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    assert record.read_text().split("\0")[2] == tarball
    assert not (tmp_path / "PWNED").exists()


def test_hostile_values_in_the_ranks_command_arrive_literally(tmp_path):
    cfg = _frontier(f"site.conda_env={_yaml(CONDA_ENV)}")
    shown = srun_line(cfg, RUN_DIR, "train", _shape(cfg))
    _bash_parses(shown)
    assert shlex.split(_line(shown, "export X_VALUE=")) == ["export", f"X_VALUE={HOSTILE}"]
    assert shlex.split(_line(shown, "export NCCL_DEBUG=")) == [
        "export", "NCCL_DEBUG=INFO;touch PWNED"]
    assert shlex.split(_line(shown, "export LD_LIBRARY_PATH=")) == [
        "export", f"LD_LIBRARY_PATH={PLUGIN}${{LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}}"]
    launch = shlex.split(_line(shown, "srun --ntasks"))
    assert launch[-3:-1] == ["bash", "-c"]
    assert shlex.split(launch[-1]) == [  # the rank's own command, inside bash -c
        "mkdir", "-p", "$MIOPEN_USER_DB_PATH", "&&", "exec", "python", "-m",
        "stages.train.worker", "--spec", f"{RUN_DIR}/train/spec.json"]

    # The command itself, run by bash: the srun prefix records its words and environment.
    spec = RankSpec(worker="stages.train.worker", nproc=16, nodes=2, out_dir=str(tmp_path),
                    config={})
    command = ranks_command(cfg, spec, tmp_path / "spec.json")
    _bash_parses(command)
    record = tmp_path / "prefix"
    env = _tools(tmp_path, {
        "scontrol": "echo node1",
        "hostname": "case $1 in -s) echo node1;; -i) echo 10.0.0.1;; esac",
        "fake-srun": (f'printf "%s\\0" "$@" > {shlex.quote(str(record))}.args\n'
                      f'env -0 > {shlex.quote(str(record))}.env'),
    })
    env.update(PARSL_MPI_PREFIX="fake-srun --ntasks 16", PARSL_MPI_NODELIST="node1",
               LD_LIBRARY_PATH="/before")
    proc = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True,
                          text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    args = Path(f"{record}.args").read_text().split("\0")[:-1]
    assert args[:3] == ["--ntasks", "16", "bash"] and args[3] == "-c"
    got = dict(item.split("=", 1) for item in Path(f"{record}.env").read_text().split("\0")
               if "=" in item)
    assert got["X_VALUE"] == HOSTILE and got["NCCL_DEBUG"] == "INFO;touch PWNED"
    assert got["EMPTY"] == "" and got["NCCL_NET"] == "AWS Libfabric"
    assert got["LD_LIBRARY_PATH"] == f"{PLUGIN}:/before"
    assert got["MASTER_ADDR"] == "10.0.0.1"
    assert not (tmp_path / "PWNED").exists()


def _shape(cfg):
    from stages.registry import declaration

    return declaration("train").shape(cfg)


@pytest.mark.parametrize("field", ["account", "partition", "qos", "conda_env",
                                   "rccl_plugin_path", "node_local_env", "srun_options",
                                   "address", "walltime"])
def test_a_newline_in_a_site_field_is_refused_naming_the_field(field):
    value = "/lustre/orion/x/env\n.tar.gz" if field == "node_local_env" else "/abc\ntouch x"
    with pytest.raises(ConfigError, match=rf"site\.{field}=.* contains a newline"):
        load_config(None, [f"site.{field}={_yaml(value)}"])
    with pytest.raises(ValueError, match=rf"site\.{field}=.* contains a control character"):
        SiteConfig(**{field: "/abc\x1b[2Jx"})


def test_list_entries_and_multi_line_fields_are_checked_too():
    with pytest.raises(ConfigError, match=r"site\.modules\[1\]=.* contains a newline"):
        load_config(None, ["site.modules=" + _yaml(["rocm/6.4.1", "a\nb"])])
    with pytest.raises(ConfigError, match=r"site\.env\[0\]=.* contains a newline"):
        load_config(None, ["site.env=" + _yaml(["A=1\ntouch x"])])
    with pytest.raises(ConfigError, match="site.modules entry 'a b' is not one module name"):
        load_config(None, [f"site.modules={_yaml(['a b'])}"])
    with pytest.raises(ConfigError, match="'1X' is not a shell variable name"):
        load_config(None, ["site.env=[1X=2]"])
    # worker_init and scheduler_options are lines by design: newlines yes, others no.
    cfg = load_config(None, ["site.worker_init=" + _yaml("export A=1\nexport B=2")])
    assert cfg.site.worker_init.splitlines() == ["export A=1", "export B=2"]
    with pytest.raises(ConfigError, match=r"site\.worker_init contains a carriage return"):
        load_config(None, ["site.worker_init=" + _yaml("export A=1\r")])
    with pytest.raises(ConfigError, match=r"site\.worker_init contains a control character"):
        load_config(None, ["site.worker_init=" + _yaml("export A=1\x00")])
    with pytest.raises(ConfigError, match="'hostname' is not an #SBATCH line"):
        load_config(None, ["site.scheduler_options=" + _yaml("#SBATCH -C nvme\nhostname")])


def test_values_parsl_writes_unquoted_are_refused_with_the_fix():
    with pytest.raises(ConfigError, match="site.account='abc 123'.*unquoted into an #SBATCH"):
        load_config(None, [f"site.account={_yaml('abc 123')}"])
    with pytest.raises(ConfigError, match="site.partition='batch;id'"):
        load_config(None, [f"site.partition={_yaml('batch;id')}"])
    with pytest.raises(ConfigError, match="site.address='10.0.0.1 x' holds ' ': it is not a "
                                          "host name"):
        load_config(None, [f"site.address={_yaml('10.0.0.1 x')}"])
    # srun options go through Parsl's unquoted $PARSL_MPI_PREFIX: one word per option.
    with pytest.raises(ConfigError, match=r"site.srun_options word='--comment=a b'.*PARSL_MPI"):
        load_config(None, ["site.srun_options=" + _yaml('-c7 --comment="a b"')])
    with pytest.raises(ConfigError, match=r"site.srun_options word='\$\(id\)' holds '\$' "
                                          r"'\(' '\)'"):
        load_config(None, [f"site.srun_options={_yaml('-c7 $(id)')}"])
    with pytest.raises(ConfigError, match="does not split into srun options"):
        load_config(None, ["site.srun_options=" + _yaml('-c7 "open')])
    ok = load_config(None, ["site.srun_options=-c7 --gpu-bind=map_gpu:0,1 --export=ALL"])
    assert ok.site.srun_options == "-c7 --gpu-bind=map_gpu:0,1 --export=ALL"


# --- every site value that reaches a shell, on every site -----------------------------------

MARKER = "PWNED"
HOSTILE_VALUES = {
    "subshell": f"$(touch {MARKER})",
    "backquotes": f"`touch {MARKER}`",
    "semicolon": f"x;touch {MARKER}",
    "newline": f"x\ntouch {MARKER}",
}
"""Each runs ``touch PWNED`` in the working directory wherever a shell reads it unquoted."""

SITES = {
    "local-processes": ["site.login_workers=processes"],
    "local-threads": ["site.login_workers=threads"],
    "slurm": ["site.name=slurm"],
    "frontier": ["site.name=frontier", "site.account=ABC123", "parallel.nproc=8",
                 "site.conda_env=/ccs/proj/abc123/env"],
}


def _site_config(site: str, field: str, value: str, where: Path):
    """The site's config with ``field`` set to the hostile ``value`` (the runs dir: a
    directory named ``value`` under ``where``), or the ConfigError refusing it."""
    runs = (RUN_DIR if site == "frontier" else where) / "runs"
    sets = [*SITES[site], f"tracking.runs_dir={_yaml(str(runs))}"]
    if field == "runs_dir":
        sets.append(f"tracking.runs_dir={_yaml(str(runs / value))}")
    else:
        sets.append(f"site.{field}={_yaml(value)}")
    from workflows.frontier import check_site

    try:
        cfg = load_config(None, sets)
        check_site(cfg)
    except ConfigError as error:
        return error
    return cfg


@pytest.mark.parametrize("kind", list(HOSTILE_VALUES))
@pytest.mark.parametrize("field", ["runs_dir", "account", "partition", "qos"])
@pytest.mark.parametrize("site", list(SITES))
def test_a_hostile_value_is_refused_naming_it_or_reaches_the_shell_inert(tmp_path, site, field,
                                                                          kind):
    """Refused: one line naming the setting and the characters. Accepted (only where no tool
    writes it unquoted: the runs dir with the driver's threads): the site's commands run it
    for real through bash, and it arrives as itself; nothing runs."""
    from workflows.executors import make_parsl_config

    value = HOSTILE_VALUES[kind]
    work = tmp_path / "cwd"
    work.mkdir()
    got = _site_config(site, field, value, tmp_path)
    setting = "tracking.runs_dir" if field == "runs_dir" else f"site.{field}"
    if isinstance(got, ConfigError):
        message = str(got)
        assert "\n" not in message.replace(repr(value)[1:-1], "")  # one line (the value as repr)
        assert message.startswith(setting), message
        bad = "\\n" if kind == "newline" else {"subshell": "$", "backquotes": "`",
                                                "semicolon": ";"}[kind]
        assert bad in message, message
        return
    assert (site, field) == ("local-threads", "runs_dir"), f"{site} accepted {setting}={value!r}"
    config = make_parsl_config(got, got.runs_dir)  # threads: no worker command line to write
    assert all(type(e).__name__ == "ThreadPoolExecutor" for e in config.executors)
    # The local ranks command, for real: a one-rank launch whose spec lives under the runs dir.
    spec_dir = got.runs_dir / "stages" / "train" / "k.partial"
    spec_dir.mkdir(parents=True)
    spec = RankSpec(worker="tests.killed_rank_worker", nproc=1, nodes=1, out_dir=str(spec_dir),
                    config={}, extra={"victim": -1})
    path = spec.write(spec_dir / "spec.json")
    command = ranks_command(got, spec, path)
    _bash_parses(command)
    proc = subprocess.run(["bash", "-c", command], cwd=work, capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert value in str(path) and not list(work.iterdir()) and not list(tmp_path.glob(MARKER))


@pytest.mark.parametrize("site", ["slurm", "frontier"])
def test_slurm_scripts_and_rank_lines_carry_hostile_paths_inert(tmp_path, site):
    """What a Slurm site writes itself is quoted: its batch script parses, and its ranks'
    command, run by bash with srun standing in, hands a hostile spec path over as one word."""
    cfg = _site_config(site, "qos", "normal", tmp_path)
    script = batch_script(cfg, RUN_DIR, "train")
    _bash_parses(script)
    spec_path = tmp_path / HOSTILE_VALUES["subshell"] / f"{HOSTILE_VALUES['semicolon']} `x`.json"
    spec = RankSpec(worker="stages.train.worker", nproc=2, nodes=1, out_dir=str(tmp_path),
                    config={})
    command = ranks_command(cfg, spec, spec_path)
    _bash_parses(command)
    record = tmp_path / "srun.args"
    env = _tools(tmp_path, {
        "fake-srun": f'printf "%s\\0" "$@" > {shlex.quote(str(record))}',
        "scontrol": "echo node1",
        "hostname": "case $1 in -s) echo node1;; -i) echo 10.0.0.1;; esac",
    })
    env.update(PARSL_MPI_PREFIX="fake-srun --ntasks 2", PARSL_MPI_NODELIST="node1")
    work = tmp_path / "cwd"
    work.mkdir()
    proc = subprocess.run(["bash", "-c", command], cwd=work, env=env, capture_output=True,
                          text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    args = record.read_text().split("\0")[:-1]
    worker = shlex.split(args[-1]) if site == "frontier" else args
    assert str(spec_path) in worker, args
    assert not list(work.iterdir()) and not list(tmp_path.rglob(MARKER))


def test_local_worker_processes_refuse_a_parsl_dir_their_command_line_cannot_carry(tmp_path):
    """Parsl writes its directory unquoted into the local worker pool's command line: the
    configuration refuses one that would split or run, before Parsl starts."""
    from workflows.executors import make_parsl_config
    from workflows.frontier import SiteError

    cfg = load_config(None, [f"tracking.runs_dir={tmp_path / 'runs'}"])
    with pytest.raises(SiteError, match=r"tracking.runs_dir \(--runs-dir\)=.* holds ' ' '\$' '\('"):
        make_parsl_config(cfg, tmp_path, parsl_dir=tmp_path / "$(touch PWNED)")
    assert make_parsl_config(cfg, tmp_path, parsl_dir=tmp_path / "parsl-1").run_dir.endswith(
        "parsl-1")


def test_the_driver_refuses_a_hostile_runs_dir_before_any_work(tmp_path, pipeline_main):
    """The reported case: worker processes (the tiny default) and a runs dir that runs ``id``."""
    runs = tmp_path / "x" / f"$(id>{tmp_path}/pwned)"
    console = pipeline_main("--runs-dir", str(runs))
    assert console.returncode == 2 and "Traceback" not in console.stderr
    assert console.stderr.startswith("config error: tracking.runs_dir (--runs-dir)=")
    assert "'$' '(' ')' '>'" in console.stderr and "site.login_workers=threads" in console.stderr
    assert not (tmp_path / "pwned").exists() and not (tmp_path / "x").exists()
