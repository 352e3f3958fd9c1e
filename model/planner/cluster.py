"""Cluster descriptions: device memory and speed, and the links between ranks.

A cluster YAML (configs/clusters/*.yaml) gives per-device figures and a hierarchy of
link levels. Ranks are numbered node-major, so consecutive ranks share the innermost
level first: on Frontier ranks 2k and 2k+1 are the two GCDs of one MI250X ("pair"),
ranks 8n..8n+7 share a node ("node"), everything else crosses the network.

``measured: true`` (local.yaml) means the speed figures come from model/planner/microbench.py,
run on this machine at plan time (``microbench.load_measured_cluster``) and cached.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

CLUSTER_DIR = Path(__file__).resolve().parents[2] / "configs" / "clusters"

REQUIRED = {
    "name": "cluster name",
    "ranks_per_node": "devices (ranks) per node",
    "memory_gb": "memory per device in GB (1e9 bytes)",
    "peak_tflops": "dense bf16 peak per device, TFLOP/s",
    "fp32_tflops": "dense fp32 (matrix) peak per device, TFLOP/s",
    "hbm_bandwidth_gbps": "device memory bandwidth, GB/s",
    "gemm_efficiency": "fraction of peak that large GEMMs reach",
    "links": "link levels (pair/node/network) with bandwidth_gbps and latency_us",
}
LINK_REQUIRED = ("bandwidth_gbps", "latency_us")
ATTENTION_KERNELS = ("flash", "math")
"""What ``Cluster.attention_kernel`` may name."""


class ClusterError(ValueError):
    """A cluster description that cannot be used; the message names file and field."""


@dataclass
class Link:
    """One level of the interconnect, as seen by one rank."""

    name: str
    group: int
    """Ranks that share this level (consecutive rank ids); network: 0 = unbounded."""
    bandwidth_gbps: float
    """Per-rank bus bandwidth in GB/s (network: per node, shared by its ranks)."""
    latency_us: float
    """Per-message latency in microseconds."""


@dataclass
class Cluster:
    """Per-device figures and link levels of one machine type."""

    name: str
    ranks_per_node: int
    memory_gb: float
    peak_tflops: float
    fp32_tflops: float
    hbm_bandwidth_gbps: float
    gemm_efficiency: float
    links: list[Link]
    kernel_overhead_us: float = 10.0
    """Fixed cost per kernel launch (small GEMMs and collectives pay it)."""
    reserved_gb: float = 1.0
    """Memory per device not available to tensors (runtime, libraries, workspace)."""
    fragmentation: float = 0.10
    """Allocator fragmentation margin as a fraction of the tensor memory."""
    comm_overlap: float = 0.8
    """Fraction of data-parallel communication hidden under compute."""
    layer_overhead_us: float | None = None
    """Fixed host cost per block per micro-batch, forward + backward (dispatch, autograd);
    None: 60 kernel launches."""
    microbatch_overhead_us: float | None = None
    """Fixed cost per micro-batch (embedding, head, loss, schedule); None: 30 kernel launches."""
    fsdp_unit_overhead_us: float = 0.0
    """Host cost per FSDP2 unit (block) per micro-batch beyond its collectives (measured on
    CPU; hidden by asynchronous execution on GPUs)."""
    tp_layer_overhead_us: float = 0.0
    """Extra host cost per block per micro-batch under tensor parallelism (DTensor dispatch
    and redistribution bookkeeping) beyond its collectives; measured on CPU, hidden by
    asynchronous execution on GPUs."""
    tp_microbatch_overhead_us: float = 0.0
    """Extra host cost per micro-batch under tensor parallelism (vocab-parallel embedding,
    head and loss) beyond its collectives; measured on CPU."""
    optimizer_overhead_us: float | None = None
    """Fixed optimizer cost per parameter tensor; None: 12 kernel launches (unfused AdamW)."""
    cores_per_node: float = 0.0
    """CPU cores the ranks of one node share (measured clusters on CPUs); 0: every rank has
    its own device. With more ranks than cores a rank waiting in a pipeline bubble leaves
    its core to another rank, which the time model accounts for."""
    alone_speedup: float = 0.0
    """With more ranks than cores: how much faster a block runs when only one rank per core
    is busy than when every rank is (measured; above ranks/cores when oversubscription's
    context switches cost time). 0: ranks/cores."""
    receive_stall_us: float = 0.0
    """With more ranks than cores and every rank busy: what a pipeline stage's receive costs
    beyond its transfer (measured: the ranks that arrive first idle until the last one's
    time slice comes round). 0: nothing."""
    ddp_stall_us: float = 0.0
    """The same for DDP's gradient all-reduce, which runs beside the backward (measured)."""
    stall_after_us: float = 0.0
    """The compute (every rank busy) each stall was measured after: a wait that follows less
    compute stalls less (``time_model.crowded_stall``). 0: the stalls as measured."""
    gemm_sms: int = 0
    """Streaming multiprocessors / compute units per device; > 0 turns on tile and wave
    quantisation of GEMMs (output tiles of ``gemm_tile`` x ``gemm_tile`` run in waves of
    ``gemm_sms``), so small per-rank shapes under wide tensor parallelism lose efficiency.
    0 (CPUs): plain roofline."""
    gemm_tile: int = 128
    """Output tile edge of the GEMM kernels (used when gemm_sms > 0)."""
    attention_efficiency: float = 0.0
    """Fraction of peak a fused (flash) attention kernel reaches; its backward recomputes the
    scores (2.5 forward passes in all). 0: attention is timed as two batched GEMMs."""
    attention_kernel: str = "flash"
    """The attention kernel this trainer's SDPA gets on the device: ``flash`` (a flash or
    memory-efficient kernel: no s x s score matrix is stored, a float32 log-sum-exp is) or
    ``math`` (the scores are stored). The memory and time models of this trainer's plans
    assume it; the file says why for its device."""
    tp_comm_scale: float = 1.0
    """Multiplier on the modelled tensor-parallel communication: measured on CPUs (a real
    tp=2 block against the model, ``model.planner.microbench.tp_comm_scale``), 1 elsewhere."""
    tp_comm_overlap: float = 0.0
    """Fraction of tensor-parallel communication hidden under GEMMs (0: all exposed)."""
    node_write_gbps: float = 0.0
    """GB/s one node writes to the shared file system a checkpoint goes to (0: not known,
    checkpoints are not priced). With ``filesystem_write_gbps`` it prices a checkpoint
    (``model.planner.run_cost.checkpoint_seconds``)."""
    filesystem_write_gbps: float = 0.0
    """GB/s the whole shared file system writes (0: no cap beyond the nodes')."""
    framework_efficiency: dict[str, float] = field(default_factory=dict)
    """Per-framework efficiency factor (e.g. megatron, pytorch): the compute time the model
    predicts is divided by it. Fitted to published measurements
    (model.planner.published); a framework not listed gets 1.0."""
    stack_efficiency: float | None = None
    """Efficiency of this device's software stack (BLAS, attention kernels, runtime) beyond
    what the per-device figures and the framework factor capture, a multiplier on the
    framework factor of every framework run on the cluster. Set only on a cluster that has
    published measurements of its own (Frontier: the MI250X with ROCm 5.x of the Frontier
    study) and fitted to them alone (model.planner.published.fit_stack); None: not a fitted
    parameter of this cluster (factor 1)."""
    collectives: dict[str, dict[str, float]] = field(default_factory=dict)
    """Optional measured bus bandwidth/latency per collective (local clusters)."""
    measured: bool = False
    source: str = ""
    """File (or cache) the figures came from."""
    figures: str = "file"
    """How the figures were got: ``file`` (the cluster file's), ``cached`` (a microbenchmark
    cache file, ``source``) or ``measured`` (measured by this process, then cached there)."""

    def __post_init__(self) -> None:
        k = self.kernel_overhead_us
        if self.layer_overhead_us is None:
            self.layer_overhead_us = 60 * k
        if self.microbatch_overhead_us is None:
            self.microbatch_overhead_us = 30 * k
        if self.optimizer_overhead_us is None:
            self.optimizer_overhead_us = 12 * k

    @property
    def device_type(self) -> str:
        """The torch device type its ranks train on: ``cpu`` for a cluster measured on this
        machine, ``cuda`` for the GPU clusters (torch's CUDA and ROCm builds alike)."""
        return "cpu" if self.measured else "cuda"

    def link_for(self, stride: int, size: int) -> Link:
        """The slowest level a group of ``size`` ranks at rank ``stride`` crosses."""
        if size <= 1:
            return self.links[0]
        block = stride * size  # groups tile aligned blocks of this many consecutive ranks
        for link in self.links:
            if link.group and block <= link.group and link.group % block == 0:
                return link
        return self.links[-1]

    def rank_bandwidth(self, link: Link, concurrent: int = 0) -> float:
        """Bytes/s one rank gets on ``link``; network bandwidth is split among the node's ranks."""
        if link.name == "network":
            users = max(1, min(self.ranks_per_node, concurrent or self.ranks_per_node))
            return link.bandwidth_gbps * 1e9 / users
        return link.bandwidth_gbps * 1e9

    def framework_factor(self, framework: str | None) -> float:
        """The fitted efficiency factor of ``framework`` on this cluster (1.0 if unknown),
        times the cluster's software-stack efficiency where it has one."""
        stack = 1.0 if self.stack_efficiency is None else self.stack_efficiency
        return float(self.framework_efficiency.get(framework or "", 1.0)) * stack

    def peak_for(self, dtype: str) -> float:
        """Peak FLOP/s per device for the compute dtype."""
        return (self.peak_tflops if dtype == "bfloat16" else self.fp32_tflops) * 1e12

    def to_dict(self) -> dict[str, Any]:
        from dataclasses import asdict
        return asdict(self)


def _num(raw: dict, key: str, where: str, positive: bool = True) -> float:
    value = raw[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ClusterError(f"{where}: field {key!r} must be a number, got {value!r}")
    if positive and value <= 0:
        raise ClusterError(f"{where}: field {key!r} must be > 0, got {value}")
    return float(value)


def cluster_from_dict(raw: dict[str, Any], where: str = "<cluster>") -> Cluster:
    """Validate a cluster mapping; a missing field names the file, field and all required ones."""
    if not isinstance(raw, dict):
        raise ClusterError(f"{where}: a cluster file must be a mapping")
    missing = [k for k in REQUIRED if k not in raw]
    if missing:
        listing = "; ".join(f"{k} ({v})" for k, v in REQUIRED.items())
        raise ClusterError(f"{where}: missing field(s) {missing}. Required fields: {listing}")
    links_raw = raw["links"]
    if not isinstance(links_raw, dict) or not links_raw:
        raise ClusterError(f"{where}: field 'links' must map level names (pair, node, network) "
                           f"to {{bandwidth_gbps, latency_us[, group]}}")
    links = []
    for name, spec in links_raw.items():
        lw = f"{where}: links.{name}"
        if not isinstance(spec, dict):
            raise ClusterError(f"{lw} must be a mapping with {LINK_REQUIRED}")
        lack = [k for k in LINK_REQUIRED if k not in spec]
        if name != "network" and "group" not in spec:
            lack.append("group")
        if lack:
            raise ClusterError(f"{lw}: missing field(s) {lack}; required: "
                               f"{list(LINK_REQUIRED) + ([] if name == 'network' else ['group'])}")
        group = 0 if name == "network" else int(_num(spec, "group", lw))
        links.append(Link(name, group, _num(spec, "bandwidth_gbps", lw),
                          _num(spec, "latency_us", lw, positive=False)))
    links.sort(key=lambda link: link.group or 1 << 62)
    if links[-1].name != "network":
        links.append(Link("network", 0, links[-1].bandwidth_gbps, links[-1].latency_us))
    rpn = int(_num(raw, "ranks_per_node", where))
    eff = _num(raw, "gemm_efficiency", where)
    if eff > 1:
        raise ClusterError(f"{where}: gemm_efficiency must be in (0, 1], got {eff}")
    optional = {}
    for key in ("kernel_overhead_us", "reserved_gb", "fragmentation", "comm_overlap",
                "layer_overhead_us", "microbatch_overhead_us", "optimizer_overhead_us",
                "fsdp_unit_overhead_us", "tp_layer_overhead_us", "tp_microbatch_overhead_us",
                "cores_per_node", "alone_speedup", "receive_stall_us", "ddp_stall_us",
                "stall_after_us", "gemm_tile", "attention_efficiency", "tp_comm_overlap",
                "tp_comm_scale", "node_write_gbps", "filesystem_write_gbps"):
        if key in raw:
            optional[key] = _num(raw, key, where, positive=False)
    if "attention_kernel" in raw:
        kernel = raw["attention_kernel"]
        if kernel not in ATTENTION_KERNELS:
            raise ClusterError(f"{where}: attention_kernel must be one of "
                               f"{', '.join(ATTENTION_KERNELS)}, got {kernel!r}")
        optional["attention_kernel"] = kernel
    if "gemm_sms" in raw:
        optional["gemm_sms"] = int(_num(raw, "gemm_sms", where, positive=False))
    if "gemm_tile" in optional:
        optional["gemm_tile"] = int(optional["gemm_tile"])
    fw = raw.get("framework_efficiency") or {}
    if not isinstance(fw, dict) or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v <= 1.5
            for v in fw.values()):
        raise ClusterError(f"{where}: framework_efficiency must map framework names to "
                           f"factors in (0, 1.5], got {fw!r}")
    optional["framework_efficiency"] = {str(k): float(v) for k, v in fw.items()}
    if "stack_efficiency" in raw:
        st = raw["stack_efficiency"]
        if isinstance(st, bool) or not isinstance(st, (int, float)) or not 0 < st <= 1.5:
            raise ClusterError(f"{where}: stack_efficiency must be a factor in (0, 1.5], "
                               f"got {st!r}")
        optional["stack_efficiency"] = float(st)
    known = set(REQUIRED) | set(optional) | {"measured", "collectives", "source", "notes",
                                             "figures"}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ClusterError(f"{where}: unknown field(s) {unknown}; allowed: {sorted(known)}")
    return Cluster(
        name=str(raw["name"]), ranks_per_node=rpn, memory_gb=_num(raw, "memory_gb", where),
        peak_tflops=_num(raw, "peak_tflops", where), fp32_tflops=_num(raw, "fp32_tflops", where),
        hbm_bandwidth_gbps=_num(raw, "hbm_bandwidth_gbps", where), gemm_efficiency=eff,
        links=links, collectives=dict(raw.get("collectives") or {}),
        measured=bool(raw.get("measured", False)), source=str(raw.get("source", where)),
        figures=str(raw.get("figures", "file")),
        **optional,
    )


def resolve_cluster_path(name_or_path: str | Path) -> Path:
    """A path to a YAML file, or a name in configs/clusters/ ('frontier')."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") and path.exists():
        return path
    named = CLUSTER_DIR / f"{name_or_path}.yaml"
    if named.exists():
        return named
    known = sorted(p.stem for p in CLUSTER_DIR.glob("*.yaml"))
    raise ClusterError(
        f"cluster {str(name_or_path)!r} not found: give a YAML path or one of {known}"
    )


def read_cluster_file(name_or_path: str | Path) -> tuple[Path, dict[str, Any]]:
    """The resolved path and raw mapping of a cluster file (nothing validated or measured)."""
    path = resolve_cluster_path(name_or_path)
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ClusterError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(raw, dict):
        raise ClusterError(f"{path}: a cluster file must be a mapping")
    return path, raw


def rehearses(setting: bool | None, measured: bool) -> bool:
    """Whether the plan stage rehearses its pick: ``parallel.rehearse``, where None means on
    for every cluster but a measured one (this machine, where measured refinement is cheap
    and the rehearsal's device model does not apply)."""
    return (not measured) if setting is None else setting


def is_measured(name_or_path: str | Path) -> bool:
    """Whether a cluster file says ``measured: true`` (read only; False for a file that
    cannot be read, which the plan stage then reports)."""
    try:
        return bool(read_cluster_file(name_or_path)[1].get("measured"))
    except (ClusterError, OSError):
        return False


def load_cluster(
    name_or_path: str | Path, measured_fields: dict[str, Any] | None = None
) -> Cluster:
    """Load and validate a cluster file. Loading never measures anything: a ``measured: true``
    file needs ``measured_fields`` (``model.planner.microbench.load_measured_cluster`` measures
    this machine and passes them)."""
    path, raw = read_cluster_file(name_or_path)
    if raw.get("measured"):
        if measured_fields is None:
            raise ClusterError(
                f"{path} is measured on this machine at plan time: load it with "
                "model.planner.microbench.load_measured_cluster"
            )
        raw = {**raw, **measured_fields}
    return cluster_from_dict(raw, str(path))
