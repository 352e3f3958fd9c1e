"""One rank rehearsed on the fake GPU, in a process of its own:
``python -m model.rehearsal.fake_gpu_rank REQUEST RESULT``.

``REQUEST`` holds the pickled positional arguments of ``model.rehearsal.rehearse.rehearse``
(device type ``cuda`` among them); ``RESULT`` gets the pickled Rehearsal, or the
RehearsalError that refused it. The fake GPU is loaded before torch is imported
(``model.rehearsal.fake_gpu.load_runtime``), which is why this is a module of its own.
"""
from __future__ import annotations

import pickle
import sys
from pathlib import Path
from typing import Any

from model.rehearsal import fake_gpu


def run_rank(request: Path, result: Path) -> None:
    """Load the fake GPU, rehearse the rank ``request`` describes, write ``result``
    (a temp file renamed into place)."""
    fake_gpu.load_runtime()
    from model.rehearsal.rehearse import RehearsalError, rehearse  # torch: after the runtime

    args = pickle.loads(request.read_bytes())
    try:
        outcome: Any = rehearse(*args)
    except RehearsalError as exc:
        outcome = exc
    tmp = result.with_suffix(".tmp")
    tmp.write_bytes(pickle.dumps(outcome))
    tmp.replace(result)


if __name__ == "__main__":
    run_rank(Path(sys.argv[1]), Path(sys.argv[2]))
