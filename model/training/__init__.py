"""The training loop and what it needs: optimizer, checkpoints, batches, metrics,
pre-launch checks."""
