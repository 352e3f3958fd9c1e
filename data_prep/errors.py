"""Errors raised for unusable input data or token stores."""
from __future__ import annotations


class DataError(ValueError):
    """Input data that cannot be used; the message names the file, line or key to fix."""


class StoreError(DataError):
    """A token store that is incomplete, damaged or built for another tokenizer."""
