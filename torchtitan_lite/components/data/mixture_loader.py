"""The loader of a weighted mixture (``data.sources``): the windows of several token stores in one order.

Each source is read as a single source is (``window_loader.py``): its own store, checked before the first
batch, and its own window order and epochs, seeded by ``mixture.source_seed(seed, name)``. ``MixtureOrder``
maps every global position to a source and that source's next position, so the state is again the number
of positions read, the same on every rank: a resume on any data-parallel degree, micro-batching or global
batch reads on exactly where the run stopped, and every source's windows are its own order's prefix.

Validation reads each source's held-out split on its own (``validation_loaders``), so that each gets its
loss.
"""
from __future__ import annotations

import functools
import logging
import os
import re
from collections.abc import Callable, Iterator
from typing import Any, Literal

import numpy as np

from torchtitan_lite.components.data.batch import Batch, to_batch
from torchtitan_lite.components.data.errors import DataSourceError
from torchtitan_lite.components.data.live_iterator import SingleLiveIterator
from torchtitan_lite.components.data.loader_args import check_build_args
from torchtitan_lite.components.data.mixture import MixtureOrder, source_seed
from torchtitan_lite.components.data.window_loader import STATE_FORMAT, WindowLoader

logger = logging.getLogger(__name__)
_SOURCE_FIELDS = re.compile(r"\bdata\.(dataset_config|dataset|data_format|text_field|train_split|validation_split|"
                            r"validation_files|token_store)\b")


def for_source(error: DataSourceError, index: int, name: str) -> DataSourceError:
    """``error`` of one source's single-source config, naming the source and its own fields."""
    text = _SOURCE_FIELDS.sub(lambda m: f"data.sources.{index}.{m.group(1)}", str(error))
    return type(error)(f"source {name!r} (data.sources.{index}): {text}")


def source_loader(config: Any, index: int, **runtime: Any) -> WindowLoader:
    """Source ``index`` of ``config.sources`` read alone, its errors naming the source."""
    try:
        return WindowLoader(config.source_config(index), **runtime)
    except DataSourceError as error:
        raise for_source(error, index, config.sources[index].name) from None


def validation_loaders(config: Any, **runtime: Any) -> dict[str, Callable[[], WindowLoader]]:
    """Name -> a fresh finite pass over that source's validation split, for each source."""
    return {source.name: functools.partial(source_loader, config, i, split="validation", infinite=False, **runtime)
            for i, source in enumerate(config.sources)}


class MixtureLoader(SingleLiveIterator):
    """Batches of windows of several sources by weight (``Batch``: inputs, labels, document starts)."""

    def __init__(
        self,
        config: Any,
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
        check_build_args(dp_rank, dp_world_size, seq_len, local_batch_size, split)
        if split != "train" or not infinite:
            raise ValueError("a mixture is a training order; validate each source on its own "
                             "(mixture_loader.validation_loaders)")
        if seed is None and dp_world_size > 1:
            raise ValueError(f"data.sources on {dp_world_size} data-parallel ranks needs one seed shared by every rank "
                             f"(they read strides of one order); pass seed= (the trainer draws one on rank 0 when "
                             f"training.seed is None)")
        self.config = config
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size
        self.seq_len, self.local_batch_size = seq_len, local_batch_size
        self.split, self.shuffle = split, config.shuffle
        self.names = [source.name for source in config.sources]
        self.weights = [float(source.weight) for source in config.sources]
        self._runtime = dict(tokenizer=tokenizer, dp_rank=dp_rank, dp_world_size=dp_world_size, seq_len=seq_len,
                             local_batch_size=local_batch_size, batches_per_step=batches_per_step,
                             vocab_size=vocab_size)
        # Without a seed the order is still random, and recorded, so a resumed run continues it.
        self.seed = seed if seed is not None else int.from_bytes(os.urandom(4), "big")
        self.loaders = [source_loader(config, i, seed=source_seed(self.seed, name), **self._runtime)
                        for i, name in enumerate(self.names)]
        self.order = MixtureOrder(self.weights, self.seed)
        self.consumed = 0
        """Positions of the global order read so far, by all ranks together."""
        logger.info("data: a mixture of %s (token shares %s), %s",
                    ", ".join(f"{n} ({loader.n_windows} windows per epoch)" for n, loader in
                              zip(self.names, self.loaders, strict=True)),
                    ", ".join(f"{n} {float(w):.1%}" for n, w in zip(self.names, self.order.shares, strict=True)),
                    f"windows read in data.shuffle={self.shuffle!r} order per source")

    def tokens_per_source(self) -> dict[str, int]:
        """Input tokens each source has given (all ranks together), from the position alone."""
        counts = self.order.counts(self.consumed)
        return {name: int(c) * self.seq_len for name, c in zip(self.names, counts, strict=True)}

    def _batches(self, token: object) -> Iterator[Batch]:
        from torchtitan_lite.components.data.windows import rank_positions

        while True:
            self._check_live(token)
            positions = rank_positions(self.consumed, self.local_batch_size, self.dp_rank, self.dp_world_size)
            self.consumed += self.local_batch_size * self.dp_world_size
            yield self._read(positions)

    def _read(self, positions: np.ndarray) -> Batch:
        sources, local = self.order.locate(positions)
        rows = []
        for source, q in zip(sources.tolist(), local.tolist(), strict=True):
            index = self.loaders[source].index
            epochs, windows = index.locate(np.asarray([q], dtype=np.int64))
            rows.append(index.read(int(epochs[0]), int(windows[0])))
        return to_batch(np.stack([tokens for tokens, _ in rows]), [starts for _, starts in rows])

    # ----------------------------------------------------------------------------------------------
    # Checkpointing

    def state_dict(self) -> dict[str, Any]:
        return {
            "format": STATE_FORMAT, "split": self.split, "seq_len": self.seq_len, "shuffle": self.shuffle,
            "seed": self.seed, "consumed": self.consumed,
            "sources": {name: {"weight": weight, "store": loader.store.identity}
                        for name, weight, loader in zip(self.names, self.weights, self.loaders, strict=True)},
            # Informative only: the position does not depend on the layout it was written under.
            "dp_rank": self.dp_rank, "dp_world_size": self.dp_world_size, "local_batch_size": self.local_batch_size,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position, whatever data-parallel layout or batch size wrote it."""
        self._check_compatible(state)
        self.seed = int(state["seed"])
        for loader, name in zip(self.loaders, self.names, strict=True):
            loader.load_state_dict(loader.state_dict() | {"seed": source_seed(self.seed, name)})
        self.order = MixtureOrder(self.weights, self.seed)
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
        self.load_state_dict(states[0])

    def _check_compatible(self, state: dict[str, Any]) -> None:
        restart = "start the data from the beginning by excluding 'dataloader' from checkpoint loading"
        if state.get("format") != STATE_FORMAT or "sources" not in state:
            raise ValueError(f"data loader state is not a mixture's (data.sources) position; this run reads a mixture "
                             f"of {', '.join(self.names)}: restore the run's data settings, or {restart}")
        now = self.state_dict()["sources"]
        if state["sources"] != now:
            raise ValueError(
                f"data loader state was saved for the sources {state['sources']}, this run reads {now}: a mixture's "
                f"position is only valid for the same sources, weights and tokens (data.sources). Restore them, or "
                f"{restart}")
        for key, option in (("seq_len", "training.seq_len"), ("shuffle", "data.shuffle")):
            if state[key] != getattr(self, key):
                raise ValueError(f"data loader state was saved with {key}={state[key]!r}, this loader has "
                                 f"{key}={getattr(self, key)!r} ({option}). Restore that setting, or {restart}")
