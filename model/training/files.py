"""What a training run leaves in its output directory: one home for the names every reader
uses (the train stage, the plan stage's measurements, the scaling studies). Imports nothing,
so readers that never train pay no torch."""

SUMMARY_FILE = "summary.json"
"""Written once by rank 0 at the end: losses, throughput, memory, the plan, the hosts."""

LOSS_CURVE_FILE = "loss_curve.png"
"""The loss curve rank 0 plots at the end (logged to MLflow by the train stage)."""

CHECKPOINTS_DIR = "checkpoints"
"""Holds one ``step-N/`` directory per checkpoint (torch.distributed.checkpoint)."""

HEALTH_FILE = "health.json"
"""Every skipped step and rollback of a training that diverged (``TrainingDiverged``)."""
