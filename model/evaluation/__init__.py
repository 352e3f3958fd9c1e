"""Evaluation: held-out loss, greedy generation, the lm-eval adapter, Hugging Face export."""
