"""The tokenize stage's pre-flight checks and the check of its published output.

Each reads no more than the start of a file and writes nothing; each raises a ``ValueError``
subclass whose message names the setting and the fix. Imports stay light (no torch, datasets
or MLflow), so a bad input costs a second.
"""
from __future__ import annotations

from typing import Any

from stages.config import PipelineConfig


def check_tokenize(cfg: PipelineConfig, reused: dict[str, Any] | None = None) -> None:
    """The sources and the tokenizer can be used.

    Reads only the start of each input file (``data_prep.checks``): every local source exists
    and holds non-empty UTF-8 text, JSON and parquet records have ``data.text_field``;
    ``tokenizer.path`` (when set) loads, knows the eos token and its ids fit
    ``data.token_dtype`` and ``model.vocab_size``. On a Slurm site a hub source needs a
    budget (``hub_budget_problem``). Raises ``DataError`` naming the key and the fix.
    """
    from data_prep import checks
    from data_prep.errors import DataError
    from model.config import vocab_fit_problem

    check_sources(cfg)
    vocab = checks.check_tokenizer(cfg.tokenizer, cfg.data)
    problem = vocab_fit_problem(vocab, cfg.model.vocab_size)
    if problem:
        where = f"tokenizer.path {cfg.tokenizer.path!r}: " if cfg.tokenizer.path else ""
        raise DataError(f"{where}{problem}")


def check_sources(cfg: PipelineConfig) -> None:
    """Every source can be read (the start of each file: ``data_prep.checks``) and a hub
    source has a budget on a Slurm site (``hub_budget_problem``); ``DataError`` otherwise."""
    from data_prep import checks
    from data_prep.errors import DataError

    problem = hub_budget_problem(cfg)
    if problem:
        raise DataError(problem)
    checks.check_sources(cfg.data)


def token_store_problem(outputs: dict[str, Any]) -> str | None:
    """What makes a published tokenize output unusable, from its manifest and part
    directories alone (no chunk is read): a missing manifest or part; None when whole.

    A part removed after its chunk failed its checksum is found here, so the next run
    re-encodes just that part (``stages.mechanism.attempt.begin``)."""
    from data_prep.errors import StoreError
    from data_prep.store import open_store

    store = outputs.get("store")
    if not store:
        return None
    try:
        open_store(store)
    except StoreError as error:
        return str(error)
    return None


def hub_budget_problem(cfg: PipelineConfig) -> str | None:
    """A hub source (``hf:``) with no document budget on a Slurm site, or None.

    Tokenize streams a hub dataset in its prepare step, on a compute node, inside the
    compute block's walltime: without ``data.max_documents`` it would read the whole split
    there. Locally (a laptop with internet) streaming the whole split is allowed.
    """
    data = cfg.data
    sources = [data.source] if data.source else list(data.sources.values())
    hub = [source for source in sources if source.startswith("hf:")]
    if not hub or data.max_documents is not None or cfg.site.name == "local":
        return None
    return (f"data.source {', '.join(hub)}: a hub dataset on site {cfg.site.name!r} needs a "
            "budget, or tokenize streams the whole split inside one compute job; set "
            "data.max_documents=N (the first N documents are streamed), or download it first "
            "where the site allows the network and point data.source at the copy")
