"""The loader of random-access sources: windows of a token store in one global order.

The store is ``data.token_store``'s (``<folder>/train``, ``<folder>/validation``), or the source tokenised
into the cache on first use (``tokenize_store.py``). Before the first batch it is checked: written by this
run's tokenizer, every file matching its checksum, no id beyond the model's vocabulary (the files are read
through once per machine until one changes: ``verify_once``). Any of these stops the run before training
starts, naming the file and the fix.

Every local batch reads the next ``local_batch_size x dp_world_size`` positions of the global order, rank
``r`` taking a stride of them (``windows.rank_positions``); the state is the number of positions read (the
same on every rank), so it continues exactly on any data-parallel degree, micro-batching or global batch.
Training (``infinite=True``) reads epoch after epoch in ``data.shuffle`` order; a finite pass (validation)
reads every full window once in source order, split across the ranks (the last batch may be short, and
ranks may read different numbers of batches).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import numpy as np

from torchtitan_lite.components.data.batch import Batch, to_batch
from torchtitan_lite.components.data.cache import build_once, cache_root
from torchtitan_lite.components.data.errors import DataSourceError
from torchtitan_lite.components.data.live_iterator import SingleLiveIterator
from torchtitan_lite.components.data.loader_args import LoaderConfig, check_build_args
from torchtitan_lite.components.data.token_store import TokenStore, TokenStoreError, open_store
from torchtitan_lite.components.data.tokenize_store import cached_store, tokenizer_fingerprint
from torchtitan_lite.components.data.windows import WindowIndex, rank_positions

STATE_FORMAT = 3
"""3: a count of windows read in a global order (2: documents read per rank, streams' format)."""

logger = logging.getLogger(__name__)


def run_store(config: LoaderConfig, split: Literal["train", "validation"], tokenizer: Any) -> TokenStore:
    """The store a run reads ``split`` from: data.token_store's, or the cache's (written on first use)."""
    if config.token_store is None:
        return cached_store(config, split, tokenizer)
    folder = Path(config.token_store).expanduser() / split
    if not folder.is_dir() and split == "validation":
        raise TokenStoreError(
            f"data.token_store={config.token_store!r} has no validation/ store ({folder} does not exist); "
            f"pretokenise the validation split too (scripts/pretokenize.py writes train/ and validation/), or "
            f"set --validation.enable false")
    return open_store(folder, what=f"data.token_store={config.token_store!r}", output=config.token_store)


def checked_store(config: LoaderConfig, split: Literal["train", "validation"], tokenizer: Any,
                  vocab_size: int) -> TokenStore:
    """``run_store``, refused unless written by ``tokenizer``, intact, within the model's ``vocab_size`` and
    holding more than empty documents."""
    store = run_store(config, split, tokenizer)
    store.check_tokenizer(*tokenizer_fingerprint(tokenizer))
    verify_once(store, vocab_size)
    framing = len(store.tokenizer["bos"]) + len(store.tokenizer["eos"])
    if store.n_tokens <= framing * store.n_documents:  # BOS + EOS alone trains on nothing
        skipped = sum(store.index["source"]["skipped_records"].values())
        also = f" or a skipped bad record ({skipped}, data.on_bad_record=skip)" if skipped else ""
        raise DataSourceError(f"every document of split {split!r} of data.dataset={config.dataset!r} is empty (only "
                              f"BOS/EOS tokens){also}; check data.text_field and the data")
    return store


def verify_once(store: TokenStore, vocab_size: int) -> None:
    """``store.verify``, once per machine for the same files: every rank of a node would otherwise read the whole
    store at every start (and a validation pass builds a loader each time). The first caller verifies under the
    cache's lock while the others wait; a file rewritten, replaced or copied since (another inode, size or
    modification time) is verified again. A store that fails leaves no record, so every rank refuses it."""
    key = json.dumps([str(store.folder.resolve()), store.identity, vocab_size, store.file_stamps()])
    record = cache_root() / "verified_tokens" / hashlib.sha256(key.encode()).hexdigest()[:32]

    def verify(out: Path) -> None:
        store.verify(vocab_size=vocab_size)
        out.write_text(key + "\n")

    build_once(record, verify)


class WindowLoader(SingleLiveIterator):
    """Batches of windows of a token store (``Batch``: inputs, labels, document starts)."""

    def __init__(
        self,
        config: LoaderConfig,
        *,
        tokenizer: Any,
        dp_rank: int,
        dp_world_size: int,
        seq_len: int,
        local_batch_size: int,
        split: Literal["train", "validation"] = "train",
        infinite: bool = True,
        seed: int | None = None,
        batches_per_step: int = 1,
        vocab_size: int | None = None,
    ) -> None:
        """``vocab_size``: the model's vocabulary (default: the tokenizer's), which every stored id must be below.
        ``batches_per_step``: local batches one optimizer step reads; only the warning about a split smaller
        than one step uses it."""
        check_build_args(dp_rank, dp_world_size, seq_len, local_batch_size, split)
        self.config = config
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size
        self.seq_len, self.local_batch_size = seq_len, local_batch_size
        self.split, self.infinite = split, infinite
        self.store = checked_store(config, split, tokenizer,
                                   int(tokenizer.vocab_size if vocab_size is None else vocab_size))
        self.shuffle = config.shuffle if split == "train" else "none"
        if self.shuffle != "none" and seed is None and dp_world_size > 1:
            raise ValueError(f"data.shuffle={self.shuffle!r} on {dp_world_size} data-parallel ranks needs one seed "
                             f"shared by every rank (they read strides of one order); pass seed= (the trainer draws "
                             f"one on rank 0 when training.seed is None)")
        # Without a seed the order is still random, and recorded, so a resumed run continues it.
        self.seed = None if self.shuffle == "none" else seed if seed is not None else \
            int.from_bytes(os.urandom(4), "big")
        self.index = WindowIndex(self.store, seq_len, self.shuffle, self.seed)
        self.n_windows = self.index.n_windows
        if self.n_windows == 0:
            raise DataSourceError(
                f"split {split!r} of data.dataset={config.dataset!r} holds {self.store.n_tokens} tokens, fewer than "
                f"one window of training.seq_len + 1 = {seq_len + 1}; add data or lower training.seq_len")
        per_step = local_batch_size * dp_world_size * batches_per_step
        if infinite and self.n_windows < per_step:
            logger.warning(
                "split %r of data.dataset=%r holds %d window(s) of %d tokens per epoch, fewer than one step reads "
                "(training.local_batch_size x data-parallel ranks x local batches per step = %d x %d x %d = %d), so "
                "every step reads the same windows about %.1f times; add data, or lower training.local_batch_size / "
                "training.seq_len / training.global_batch_size", split, config.dataset, self.n_windows, seq_len + 1,
                local_batch_size, dp_world_size, batches_per_step, per_step, per_step / self.n_windows)
        self.consumed = 0
        """Positions of the global order read so far, by all ranks together."""

    def _batches(self, token: object) -> Iterator[Batch]:
        while True:
            self._check_live(token)
            positions = rank_positions(self.consumed, self.local_batch_size, self.dp_rank, self.dp_world_size)
            if not self.infinite:
                positions = positions[positions < self.n_windows]
                if not len(positions):
                    return
            self.consumed += self.local_batch_size * self.dp_world_size
            yield self._read(positions)

    def _read(self, positions: np.ndarray) -> Batch:
        epochs, windows = self.index.locate(positions)
        rows = [self.index.read(int(e), int(w)) for e, w in zip(epochs, windows, strict=True)]
        return to_batch(np.stack([tokens for tokens, _ in rows]), [starts for _, starts in rows])

    # ----------------------------------------------------------------------------------------------
    # Checkpointing

    def state_dict(self) -> dict[str, Any]:
        return {
            "format": STATE_FORMAT, "dataset": self.config.dataset, "split": self.split, "store": self.store.identity,
            "seq_len": self.seq_len, "shuffle": self.shuffle, "seed": self.seed, "consumed": self.consumed,
            # Informative only: the position does not depend on the layout it was written under.
            "dp_rank": self.dp_rank, "dp_world_size": self.dp_world_size, "local_batch_size": self.local_batch_size,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position, whatever data-parallel layout or batch size wrote it."""
        self._check_compatible(state)
        self.seed = state["seed"]
        self.index = WindowIndex(self.store, self.seq_len, self.shuffle, self.seed)
        self.consumed = int(state["consumed"])
        self._live_iterator = None

    def load_rank_states(self, states: list[dict[str, Any]]) -> None:
        """Continue from the states every rank of a checkpoint saved: they hold one position."""
        for state in states:
            self._check_compatible(state)
        counts = {int(s["consumed"]) for s in states}
        if len(counts) != 1:
            raise ValueError(f"the data positions the ranks of the checkpoint saved disagree ({sorted(counts)} "
                             f"windows read); start the data from the beginning by excluding 'dataloader' from "
                             f"checkpoint loading")
        saved = int(states[0]["dp_world_size"]), int(states[0]["local_batch_size"])
        if saved != (self.dp_world_size, self.local_batch_size):
            logger.info("data position: %d window(s) of the global order read (saved by %d data-parallel rank(s) of "
                        "local batch %d); continuing on %d of local batch %d", counts.pop(), *saved,
                        self.dp_world_size, self.local_batch_size)
        self.load_state_dict(states[0])

    def _check_compatible(self, state: dict[str, Any]) -> None:
        restart = "start the data from the beginning by excluding 'dataloader' from checkpoint loading"
        if state.get("format") != STATE_FORMAT:
            raise ValueError(
                f"data loader state has format {state.get('format')}, this loader reads format {STATE_FORMAT} (the "
                f"windows of a token store in one global order); an older position counts documents per rank and "
                f"names no window: {restart}")
        now = {"store": self.store.identity, "seq_len": self.seq_len, "shuffle": self.shuffle, "split": self.split}
        options = {"store": "data.dataset / data.token_store / the tokenizer", "seq_len": "training.seq_len",
                   "shuffle": "data.shuffle", "split": "the split"}
        for key, value in now.items():
            if state[key] != value:
                raise ValueError(
                    f"data loader state was saved with {key}={state[key]!r}, this loader has {key}={value!r}: a data "
                    f"position is only valid for the same tokens, seq_len and order ({options[key]}). Restore that "
                    f"setting, or {restart}")
