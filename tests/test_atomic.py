"""data_prep.atomic: readers see the old file or the new one, never half of one."""
from __future__ import annotations

import json
import os
import stat

import pytest

from data_prep.atomic import atomic_path, write_json_atomic


def test_written_file_has_the_permissions_of_a_plain_write(tmp_path) -> None:
    mask = os.umask(0o022)
    try:
        path = write_json_atomic(tmp_path / "status.json", {"state": "running"})
        plain = tmp_path / "plain.json"
        plain.write_text("{}")
    finally:
        os.umask(mask)
    assert stat.S_IMODE(path.stat().st_mode) == stat.S_IMODE(plain.stat().st_mode) == 0o644
    assert json.loads(path.read_text()) == {"state": "running"}


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path) -> None:
    path = write_json_atomic(tmp_path / "outputs.json", {"v": 1})
    with pytest.raises(RuntimeError), atomic_path(path) as tmp:
        tmp.write_text("half")
        raise RuntimeError("writer died")
    assert json.loads(path.read_text()) == {"v": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["outputs.json"]


def test_an_os_error_names_the_file_being_written(tmp_path) -> None:
    target = tmp_path / "summary.json"
    with pytest.raises(OSError, match=r"while writing .*summary\.json"), \
            atomic_path(target) as tmp:
        tmp.write_text("x")
        raise OSError(28, "No space left on device")
    assert not target.exists()
