"""The GPT and everything that trains, plans and evaluates it; no Parsl, no MLflow.

- ``gpt``, ``config``, ``flops``: the model, its typed configs, and the one parameter and
  FLOP count everyone uses.
- ``parallel``: the device mesh, TP/PP/FSDP applied as plain functions, rank identity.
- ``training``: the trainer, optimizer, checkpoints, synthetic batches, metrics, checks.
- ``planner``: plans, memory and time models, search, clusters, calibration (no torch).
- ``evaluation``: held-out loss, generation, the lm-eval adapter, Hugging Face export.
"""
