"""Language identification: py3langid's naive Bayes model, the one its wheel ships.

``identifier()`` loads the model as ``py3langid.modelio.load_model`` (0.4.0) does, from the
same file, with two differences, both for memory (a signals task runs on every core of a
node, and its peak is the language model plus a little): the DFA transition table (39 MB,
the largest array) is read into its ``array`` in 1 MB pieces, where py3langid builds a
numpy copy first and converts it (a 30-39 MB transient that was the task's peak); and
the per-state tables are arrays, not lists of Python ints (7 MB less). The identifier is
py3langid's own ``LanguageIdentifier`` (pinned: 0.4.0); a test checks that it holds the
same tables and answers the same as the one ``LanguageIdentifier.from_model_file``
builds.
"""
from __future__ import annotations

import functools
import lzma
import shutil
import tempfile
import zipfile
from array import array
from typing import Any

import numpy as np

_PIECE = 1 << 20
_TYPECODES = {2: "H", 4: "I", 8: "Q"}


def _read(archive: zipfile.ZipFile, name: str) -> np.ndarray:
    with archive.open(f"{name}.npy") as handle:
        return np.lib.format.read_array(handle, allow_pickle=False)


def _read_into_array(archive: zipfile.ZipFile, name: str, signed: bool = False) -> array:
    """An integer .npy member of ``archive`` (unsigned unless ``signed``) as a stdlib
    array, read in pieces."""
    with archive.open(f"{name}.npy") as handle:
        version = np.lib.format.read_magic(handle)
        read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                       else np.lib.format.read_array_header_2_0)
        shape, _, dtype = read_header(handle)
        kind = "i" if signed else "u"
        if dtype.kind != kind or dtype.byteorder == ">" or dtype.itemsize not in _TYPECODES:
            raise ValueError(f"py3langid model: {name} is {dtype}, not a little-endian "
                             f"{'signed' if signed else 'unsigned'} integer array")
        count = int(np.prod(shape))
        typecode = _TYPECODES[dtype.itemsize]
        out = array(typecode.lower() if signed else typecode, [0]) * count  # once, exact
        target = memoryview(out).cast("B")
        done = 0
        while done < len(target):
            piece = handle.read(min(_PIECE, len(target) - done))
            if not piece:
                raise ValueError(f"py3langid model: {name} is truncated")
            target[done:done + len(piece)] = piece
            done += len(piece)
        target.release()
        return out


@functools.cache
def identifier() -> Any:
    """py3langid's ``LanguageIdentifier`` over its shipped model, probabilities
    normalized (loaded once a process)."""
    from py3langid.langid import MODEL_DIR, MODEL_FILE, LanguageIdentifier

    # the archive is LZMA-compressed; unpacked to a temporary file, as py3langid does, so
    # that the uncompressed arrays are never held twice
    with tempfile.TemporaryFile(suffix=".npz") as tmp:
        with lzma.open(MODEL_DIR / MODEL_FILE) as source:
            shutil.copyfileobj(source, tmp, length=_PIECE)
        tmp.seek(0)
        with zipfile.ZipFile(tmp) as archive:
            ptc, pc = _read(archive, "ptc"), _read(archive, "pc")
            classes = _read(archive, "classes").tolist()
            nextmove = _read_into_array(archive, "nextmove")
            rows = _read_into_array(archive, "nextmove_row")
            output = _read_into_array(archive, "out_feat", signed=True)
    found = LanguageIdentifier(ptc, pc, classes, nextmove, output, norm_probs=True,
                               tk_row=rows)
    # its DFA walk's row offsets: py3langid makes them a list of Python ints (3.8 MB); the
    # same values in an array (0.4 MB) walk as fast
    found._rowbase = array("I", (row << 8 for row in rows))
    return found
