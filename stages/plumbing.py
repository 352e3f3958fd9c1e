"""Project modules that every stage's code may import but that never change an output:
atomic file writes, error classes, progress lines and pictures. Each stage declares them
``not_code`` (``stages.mechanism.declaration.StageDeclaration``), so an edit there reruns
nothing."""
from __future__ import annotations

NOT_CODE: tuple[str, ...] = (
    "data_prep.atomic",  # write to a temporary name, then rename
    "data_prep.errors",  # exception classes
    "data_prep.progress",  # progress lines
    "model.training.plots",  # pictures of a finished run
    "stages.config",  # the config loader: the values it reads enter keys as config
)

STORE_READERS: tuple[str, ...] = ("data_prep.store", "data_prep.chunk_files")
"""The token store's readers. A stage downstream of tokenize declares them ``not_code``: its
key hashes the store's content (tokenize's output digest), and tokenize's own key covers the
format these modules read."""
