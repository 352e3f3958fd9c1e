"""Failure tests: corrupt checkpoints, unsafe checkpoint files, killed ranks."""
