"""Parallelism: mesh and dims, TP/activation checkpointing/FSDP/DDP, pipeline chunks,
rank identity."""
