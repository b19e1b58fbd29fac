"""Training rows for ``dartree train-drafter`` (and the EAGLE-3 trainer): the featurized shards and
the deterministic, resumable order they are read in."""

from __future__ import annotations

import random
from pathlib import Path

import torch

HELDOUT_SHARD = "gen_00000"


def shard_paths(feat_dir: Path) -> list[Path]:
    """Finished featurized shards (``featurize`` output), held-out shard excluded."""
    return [p for p in sorted(feat_dir.glob("*.pt")) if p.stem != HELDOUT_SHARD]


class DataStream:
    """Deterministic, resumable order of training rows: epochs of shuffled shards, rows shuffled per shard.

    Epoch ``e`` fixes its shard list when it starts (shards featurized later join the next epoch);
    the shard order and each shard's row order are seeded by ``(seed, e, shard name)``, so the
    position ``state()`` = ``{epoch, shards, shard_index, row_index}`` is all a resume needs.
    """

    def __init__(self, feat_dir: Path, seed: int, state: dict | None = None):
        self.dir, self.seed = feat_dir, seed
        if state:
            self.epoch, self.names = state["epoch"], list(state["shards"])
            self.si, self.ri = state["shard_index"], state["row_index"]
        else:
            self.epoch, self.si, self.ri = 0, 0, 0
            self.names = self._order(0)
        self._rows: list[dict] | None = None
        self._row_order: list[int] = []
        if not self.names:
            raise FileNotFoundError(f"no training shards in {feat_dir} (run featurize first)")

    def _order(self, epoch: int) -> list[str]:
        names = [p.name for p in shard_paths(self.dir)]
        return random.Random(f"{self.seed}/{epoch}").sample(names, len(names))

    def state(self) -> dict:
        """Position of the next row (JSON-able)."""
        return {"epoch": self.epoch, "shards": list(self.names), "shard_index": self.si, "row_index": self.ri}

    def last(self) -> str:
        """Where the row ``next()`` returned last came from: ``"<shard> row <i> (epoch <e>)"``."""
        if self._rows is None or self.ri == 0:
            return f"epoch {self.epoch} position {self.si}/{self.ri}"
        return f"{self.names[self.si]} row {self._row_order[self.ri - 1]} (epoch {self.epoch})"

    def next(self) -> dict:
        """The next training row (a featurized sequence dict)."""
        while True:
            if self.si >= len(self.names):
                self.epoch, self.si, self.ri = self.epoch + 1, 0, 0
                self.names = self._order(self.epoch)
                self._rows = None
            if self._rows is None:
                name = self.names[self.si]
                self._rows = torch.load(self.dir / name)
                self._row_order = random.Random(f"{self.seed}/{self.epoch}/{name}").sample(
                    range(len(self._rows)), len(self._rows))
            if self.ri < len(self._rows):
                row = self._rows[self._row_order[self.ri]]
                self.ri += 1
                return row
            self.si, self.ri, self._rows = self.si + 1, 0, None

