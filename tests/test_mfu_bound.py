"""The planner's predicted MFU is a fraction of the device's peak: never above 100 %, also
where attention dominates (long sequences), on a measured CPU cluster whose kernels run at
the measured peak (gemm_efficiency 1, the tightest bound) and on the shipped GPU clusters."""
from __future__ import annotations

import pytest

from model.flops import flops_per_token, param_count
from model.planner.cluster import cluster_from_dict, load_cluster, read_cluster_file
from stages.config import load_config
from stages.plan.work import choose, fixed_fields

# This machine's figures as model/planner/microbench.py writes them (a 2-rank CPU box; the
# kernels priced at the measured matmul rate), fixed here so the test measures nothing.
MEASURED_CPU = {
    "ranks_per_node": 2, "memory_gb": 1e4, "peak_tflops": 0.0717, "fp32_tflops": 0.0717,
    "hbm_bandwidth_gbps": 11.3, "gemm_efficiency": 1.0, "kernel_overhead_us": 2.8,
    "reserved_gb": 0.235, "fragmentation": 0.1, "layer_overhead_us": 852.0,
    "microbatch_overhead_us": 353.0, "optimizer_overhead_us": 27.0, "comm_overlap": 0.0,
    "cores_per_node": 2.0, "links": {"node": {"group": 2, "bandwidth_gbps": 1.55,
                                              "latency_us": 1179.0}},
}


def _measured_cpu():
    path, raw = read_cluster_file("local")
    return cluster_from_dict({**raw, **MEASURED_CPU}, str(path))


@pytest.mark.parametrize("seq_len", [128, 2048, 16384, 100_000])
@pytest.mark.parametrize("cluster", ["measured-cpu", "frontier", "h100"])
def test_no_plan_is_predicted_above_100_percent_mfu(cluster: str, seq_len: int) -> None:
    cfg = load_config(None, [f"train.seq_len={seq_len}", f"model.max_seq_len={seq_len}",
                             "train.global_batch=8", "train.dtype=bfloat16"])
    devices = load_cluster(cluster) if cluster != "measured-cpu" else _measured_cpu()
    world = 2 if cluster == "measured-cpu" else 8
    best, found = choose(cfg.model, cfg.train, devices, world, fixed_fields(cfg.parallel),
                         top_k=1000)
    mfus = [plan.predictions["mfu"] for plan in (found.plans if found else [best])]
    assert 0 < max(mfus) <= 1.0, (cluster, seq_len, max(mfus))
    if cluster == "measured-cpu" and seq_len >= 16384:
        # attention is nearly all the work and runs at the kernels' rate: the MFU nears the
        # measured efficiency (1), where counting the masked half of causal attention gave 2
        assert max(mfus) > 0.8


def test_causal_attention_counts_half_of_the_score_and_value_products() -> None:
    cfg = load_config(None, ["model.max_seq_len=4096"]).model
    non_embedding = param_count(cfg, include_embedding=False)
    per_key = 6 * cfg.n_layers * cfg.d_model  # 2 matmuls x 2 FLOPs x 3 (fwd+bwd) / 2 (causal)
    assert flops_per_token(cfg, 4096) == 6 * non_embedding + per_key * 4096
    assert flops_per_token(cfg, 4096) - flops_per_token(cfg, 2048) == per_key * 2048
