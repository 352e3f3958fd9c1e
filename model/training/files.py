"""What a training run leaves in its output directory: one home for the names every reader
uses (the train stage, the plan stage's measurements, the scaling studies). Imports nothing,
so readers that never train pay no torch."""

SUMMARY_FILE = "summary.json"
"""Written once by rank 0 at the end: losses, throughput, memory, the plan, the hosts."""

CHECKPOINTS_DIR = "checkpoints"
"""Holds one ``step-N/`` directory per checkpoint (torch.distributed.checkpoint)."""
