"""Where a rank is in its epochs, as a position every world size understands.

An epoch is one global order — the sampler's, padded or cut to a multiple of the world size by
``partition``'s rule — cut into global batches of ``batch × world`` samples; rank r takes every
world-th sample of each global batch, starting at r (exactly ``partition``'s strided slice,
batched). After k steps the ranks together have consumed precisely the first
``k × batch × world`` positions of that order, so a position is global: (epoch, samples
consumed, where the epoch ends, and the world size and global batch that built the order).

Resuming at another world size W' (or per-rank batch B') keeps the epoch's order and its end,
and cuts the positions not yet consumed into global batches of ``B' × W'``; a last, shorter
global batch takes the rest, split over the ranks as evenly as strides allow (sizes differ by
at most one). So the samples of that epoch seen before and after the resize are exactly those
of the uninterrupted run — none twice, none skipped. The epochs after it use the new world
size's own order and cut. Resizing more than once inside an epoch works the same way.

An epoch's length is one number for every epoch (``n``: one split's sampler), or, for a loader
whose epochs differ in length (a mixture whose weights changed between runs: ``loader``),
``length(epoch)``; a saved position carries its epoch's end, so it resumes either way.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Literal

import numpy as np

from sluice.errors import LoaderError

Partition = Literal["pad", "drop"]


def pad_to_world(order: np.ndarray, world: int, mode: Partition = "pad") -> np.ndarray:
    """The epoch's order made a multiple of ``world`` long: ``pad`` repeats its first indices
    (nothing is dropped), ``drop`` leaves out the last ``len % world``."""
    n = len(order)
    if mode == "pad":
        total = math.ceil(n / world) * world
        if total > n:
            reps = math.ceil((total - n) / max(n, 1))
            return np.concatenate([order] + [order] * reps)[:total]
        return order
    return order[: (n // world) * world]


@dataclasses.dataclass(frozen=True)
class _Carried:
    """The rest of an epoch begun at another world size or batch, cut for this one."""
    epoch: int
    order_world: int  # the world size whose padding made the epoch's order
    order_batch: int  # the global batch the sampler ordered the epoch for (curriculum pacing)
    start: int  # positions consumed before the resize
    end: int
    bounds: tuple[int, ...]  # global batch edges from start to end
    rank_order: np.ndarray


class EpochCursor:
    """This rank's place in its epochs, and a state that resumes it at any world size.

    ``order_for(epoch, global_batch)`` is the sampler's global order of an epoch (the same on
    every rank); ``n`` its length; ``drop_last`` leaves out a last per-rank batch shorter than
    ``batch``; ``mode`` is the partition rule for an order that does not divide by the world.
    ``length(epoch)``, where given, is each epoch's own length (``n`` is then epoch 0's).
    """

    def __init__(self, order_for: Callable[[int, int], np.ndarray], n: int, *, rank: int,
                 world: int, batch: int, drop_last: bool, mode: Partition = "pad",
                 length: Callable[[int], int] | None = None):
        if not 0 <= rank < world:
            raise LoaderError(f"rank {rank} is outside world size {world}")
        self.order_for, self.n, self._length = order_for, n, length
        self.rank, self.world, self.batch = rank, world, batch
        self.drop_last, self.mode = drop_last, mode
        self.epoch = 0
        self.next_batch = 0  # batches of the current epoch already handed out
        self._carried: _Carried | None = None

    # ------------------------------------------------------------------ geometry
    @property
    def global_batch(self) -> int:
        return self.batch * self.world

    def epoch_length(self, epoch: int | None = None) -> int:
        """Samples in an epoch's global order (before padding or cutting to the world size)."""
        if self._length is None:
            return self.n
        return int(self._length(self.epoch if epoch is None else epoch))

    def _per_rank(self) -> int:
        n = self.epoch_length()
        return -(-n // self.world) if self.mode == "pad" else n // self.world

    def _fresh_batches(self) -> int:
        per = self._per_rank()
        return per // self.batch if self.drop_last else -(-per // self.batch)

    def _fresh_end(self) -> int:
        return min(self._fresh_batches() * self.global_batch, self._per_rank() * self.world)

    def carried(self, epoch: int | None = None) -> _Carried | None:
        e = self.epoch if epoch is None else epoch
        return self._carried if self._carried is not None and self._carried.epoch == e else None

    def batches(self) -> int:
        """Batches this rank takes in the current epoch (the same on every rank)."""
        c = self.carried()
        return len(c.bounds) - 1 if c is not None else self._fresh_batches()

    def rank_order(self, epoch: int | None = None) -> tuple[np.ndarray, bool]:
        """This rank's indices for an epoch, in order, and whether a short last batch must be
        dropped (a resumed epoch is already cut to its batches)."""
        e = self.epoch if epoch is None else epoch
        c = self.carried(e)
        if c is not None:
            return c.rank_order, False
        order = pad_to_world(self.order_for(e, self.global_batch), self.world, self.mode)
        return np.ascontiguousarray(order[self.rank::self.world]), self.drop_last

    # ------------------------------------------------------------------ movement
    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.epoch, self.next_batch = int(epoch), 0

    def iteration_start(self) -> tuple[int, int]:
        """(epoch, first batch) an iteration begins at: a finished epoch moves on to the next one
        (its first batch), an unfinished one continues where it stopped."""
        if self.next_batch >= self.batches():
            self.set_epoch(self.epoch + 1)
        return self.epoch, self.next_batch

    def advance(self) -> None:
        self.next_batch += 1

    def restart(self, epoch: int) -> None:
        """Go to the first batch of ``epoch``, cut for this world size (whatever was carried)."""
        self.epoch, self.next_batch, self._carried = int(epoch), 0, None

    def consumed(self) -> int:
        c = self.carried()
        if c is not None:
            return c.bounds[min(self.next_batch, len(c.bounds) - 1)]
        return min(self.next_batch * self.global_batch, self._fresh_end())

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        c = self.carried()
        return {"epoch": self.epoch, "next_batch": self.next_batch, "consumed": self.consumed(),
                "end": c.end if c is not None else self._fresh_end(),
                "order_world": c.order_world if c is not None else self.world,
                "order_batch": c.order_batch if c is not None else self.global_batch,
                "partition": self.mode}

    def load_state_dict(self, state: dict[str, Any], world: int, batch: int) -> None:
        """Resume from ``state`` written by a run of ``world`` ranks with per-rank ``batch``."""
        epoch, nxt = int(state["epoch"]), int(state["next_batch"])
        if nxt < 0 or epoch < 0:
            raise LoaderError(f"loader state has epoch {epoch}, next_batch {nxt}: not a position")
        self.epoch, self.next_batch, self._carried = epoch, nxt, None
        if "consumed" not in state:  # a state from before world-size changes were possible
            if (world, batch) != (self.world, self.batch):
                raise LoaderError(f"this loader state (world size {world}, batch {batch}) predates "
                                  "resuming at another world size; resume it with the same ones")
            return
        same = (world, batch) == (self.world, self.batch) and state["order_world"] == self.world \
            and state["order_batch"] == self.global_batch and state["end"] == self._fresh_end()
        if same:
            return
        self._carry(epoch, int(state["consumed"]), int(state["end"]), int(state["order_world"]),
                    int(state["order_batch"]), state.get("partition", self.mode))

    def _carry(self, epoch: int, start: int, end: int, order_world: int, order_batch: int,
               mode: Partition) -> None:
        order = pad_to_world(self.order_for(epoch, order_batch), order_world, mode)
        if not 0 <= start <= end <= len(order):
            raise LoaderError(f"loader state says {start} of {end} samples of epoch {epoch} were "
                              f"consumed, but the epoch's order has {len(order)}")
        rest, g = end - start, self.global_batch
        full, tail = divmod(rest, g)
        if 0 < tail < self.world:
            raise LoaderError(
                f"the last {tail} samples of epoch {epoch} cannot be split over {self.world} ranks "
                f"(each needs one); resume with a world size or batch that divides the "
                f"{rest} samples left, or keep the global batch ({order_batch})")
        bounds = [start + j * g for j in range(full + 1)] + ([end] if tail else [])
        mine = [order[lo:hi][self.rank::self.world] for lo, hi in zip(bounds, bounds[1:])]
        flat = np.concatenate(mine) if mine else np.empty(0, np.int64)
        self._carried = _Carried(epoch, order_world, order_batch, start, end, tuple(bounds),
                                 np.ascontiguousarray(flat, dtype=np.int64))
        self.next_batch = 0
