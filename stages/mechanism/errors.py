"""The engine's one error class a user can cause (re-exported by ``stages.config``)."""
from __future__ import annotations


class ConfigError(ValueError):
    """A configuration key or value that cannot be used; the message says what to change."""
