"""Where a token loader is in its epochs, as a position every world size, batch and row length
understands: the token loader's ``cursor`` (the image loaders' is ``epochs.EpochCursor``; both
make the same moves for ``base.LoaderBase``).

An epoch is a virtual stream of T tokens (``token_rows.EpochStream``); a position is the tokens
of it consumed. Rows of a step (``row_order``): ``lanes`` cuts the epoch's ``T - 1`` inputs into
``K = batch × world`` lanes when the epoch begins, and a global step of row length L takes the
next L tokens of every lane (rank r: lanes r, r + W, ...; its last rows padding where W does not
divide K); ``consecutive`` takes G rows back to back from the position and advances it by G × L,
the last step taking the rest. Either way every input of the epoch is trained once. An epoch
keeps the lanes it began with, so a resume at another world size, batch or row length continues
from the same tokens. The row length is ``seq_len``, or the curriculum's (``SeqLenSchedule``)
at the step.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Iterator, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from sluice.errors import LoaderError
from sluice.stages.load.token_rows import EpochStream


class SeqLenSchedule(BaseModel):
    """Sequence-length warm-up: ``start`` → ``end`` over ``warmup_tokens`` or ``warmup_steps``,
    rounded down to a multiple of ``step`` (never below ``start``)."""
    model_config = ConfigDict(extra="forbid")
    start: int = Field(64, ge=1)
    end: int = Field(1024, ge=1)
    warmup_tokens: int | None = Field(None, ge=1)
    warmup_steps: int | None = Field(None, ge=1)
    step: int = Field(8, ge=1)
    kind: Literal["linear", "root"] = "linear"

    @model_validator(mode="after")
    def _check(self) -> "SeqLenSchedule":
        if (self.warmup_tokens is None) == (self.warmup_steps is None):
            raise ValueError("seq_len_schedule needs exactly one of warmup_tokens, warmup_steps")
        if self.end < self.start:
            raise ValueError(f"seq_len_schedule end ({self.end}) must be >= start ({self.start})")
        return self

    def at(self, step: int, tokens: int) -> int:
        """The length of the global step ``step`` beginning after ``tokens`` trained tokens."""
        t = step / self.warmup_steps if self.warmup_steps else tokens / self.warmup_tokens
        t = min(max(t, 0.0), 1.0)
        if self.kind == "root":
            t = math.sqrt(t)
        L = self.start + (self.end - self.start) * t
        return int(min(self.end, max(self.start, L // self.step * self.step)))

    def done(self, step: int, tokens: int) -> bool:
        return (step >= self.warmup_steps) if self.warmup_steps else tokens >= self.warmup_tokens


@dataclasses.dataclass(frozen=True)
class Step:
    """One global step: where it begins, its row length, and this rank's row starts (-1: padding)."""
    epoch: int
    position: int
    seq_len: int
    advance: int
    starts: np.ndarray
    limits: np.ndarray | None = None  # lanes: where each row's tokens stop (its lane's end + 1)


class TokenCursor:
    """This rank's place in the token epochs (see the module docstring). ``stream(epoch)`` gives
    an epoch's document table; ``batch`` rows per rank and step; ``seq_len`` or ``schedule``."""

    def __init__(self, stream: Callable[[int], EpochStream], *, rank: int, world: int, batch: int, seq_len: int,
                 schedule: SeqLenSchedule | None, row_order: str):
        if not 0 <= rank < world:
            raise LoaderError(f"rank {rank} is outside world size {world}")
        self.stream, self.rank, self.world, self.batch = stream, rank, world, batch
        self.seq_len, self.schedule, self.row_order = seq_len, schedule, row_order
        self.epoch = 0
        self.position = 0  # tokens of this epoch consumed (global)
        self.lanes: int | None = None  # lanes: rows per global step the epoch began with
        self.lane_position = 0  # lanes: tokens consumed of each lane
        self.step = 0  # global steps handed out since the run began
        self.epoch_step = 0  # of them, in this epoch
        self.tokens_before = 0  # tokens consumed in earlier epochs

    # ------------------------------------------------------------------ geometry
    def seq_len_at(self, step: int, tokens: int) -> int:
        return self.schedule.at(step, tokens) if self.schedule else self.seq_len

    def _lane_geometry(self, epoch: int) -> tuple[int, np.ndarray, np.ndarray]:
        """(lane length, each lane's first input, each lane's inputs) of the epoch's lanes."""
        end, K = self.stream(epoch).end, self.lanes or self.batch * self.world
        span = -(-end // K)
        first = np.arange(K, dtype=np.int64) * span
        return span, first, np.clip(end - first, 0, span)

    def _lane_steps(self, epoch: int, lane_pos: int, step: int) -> Iterator[Step]:
        """The global steps from ``lane_pos`` into every lane to the epoch's end: rank r takes
        lanes r, r + W, ... (its last rows padding where W does not divide the lanes)."""
        span, first, lens = self._lane_geometry(epoch)
        K, W, T = len(first), self.world, self.stream(epoch).total
        mine = np.arange(self.rank, -(-K // W) * W, W)
        real = mine < K
        lane = np.where(real, mine, 0)
        limits = np.minimum(first[lane] + lens[lane] + 1, T)
        p = lane_pos
        while p < span:
            done = int(np.minimum(p, lens).sum())
            L = self.seq_len_at(step, self.tokens_before + done)
            starts = np.where(real & (p < lens[lane]), first[lane] + p, -1)
            yield Step(epoch, done, L, int(np.minimum(p + L, lens).sum()) - done, starts, limits)
            p += L
            step += 1

    def steps(self) -> Iterator[Step]:
        """The global steps from the current position to the epoch's end, this rank's rows of each."""
        epoch, position, step = self.epoch, self.position, self.step
        if self.row_order == "lanes":
            yield from self._lane_steps(epoch, self.lane_position, step)
            return
        end, W, B = self.stream(epoch).end, self.world, self.batch
        while position < end:
            L = self.seq_len_at(step, self.tokens_before + position)
            rest = end - position
            rows = min(B * W, -(-rest // L))
            per = -(-rows // W)
            r = self.rank  # its rows: r, r + W, ... of the step's per·W (those from ``rows`` on: padding)
            starts = np.arange(position + r * L, position + (r + per * W) * L, W * L, dtype=np.int64)
            starts[len(range(r, rows, W)):] = -1
            adv = min(B * W * L, rest)
            yield Step(epoch, position, L, adv, starts)
            position += adv
            step += 1

    def _steps_left(self) -> int:
        """Steps from here to the epoch's end: the curriculum's stepped through one by one, then
        the fixed length's counted. The cursor is the lanes' offset (each step moves it by L) or
        the stream position (by G × L); ``trained`` turns it into the epoch's tokens consumed."""
        if self.row_order == "lanes":
            limit, _, lens = self._lane_geometry(self.epoch)
            x, per_step = self.lane_position, 1
            trained = lambda x: int(np.minimum(x, lens).sum())  # noqa: E731
        else:
            limit, x = self.stream(self.epoch).end, self.position
            per_step = self.batch * self.world
            trained = lambda x: x  # noqa: E731
        step, n, sch = self.step, 0, self.schedule
        while x < limit:
            t = self.tokens_before + trained(x)
            L = self.seq_len_at(step, t)
            if sch is None or sch.done(step, t):
                return n + -(-(limit - x) // (per_step * L))
            x += per_step * L
            step += 1
            n += 1
        return n

    # ------------------------------------------------------------------ movement
    def batches(self) -> int:
        """Steps in this epoch (the same on every rank): those taken and those left."""
        return self.epoch_step + self._steps_left()

    def restart(self, epoch: int) -> None:
        """Go to ``epoch``'s first token; the tokens consumed of the one left count as trained."""
        self.tokens_before += self.position
        self.epoch, self.position, self.epoch_step = int(epoch), 0, 0
        self.lanes, self.lane_position = None, 0

    def finished(self) -> bool:
        return self.position >= self.stream(self.epoch).end

    def iteration_start(self) -> tuple[int, int]:
        """(epoch, position) an iteration begins at: a finished epoch moves on to the next one;
        an epoch's lanes are fixed when it begins."""
        if self.finished():
            self.restart(self.epoch + 1)
        if self.lanes is None:
            self.lanes = self.batch * self.world
        return self.epoch, self.position

    def advance(self, st: Step) -> None:
        self.position += st.advance
        self.lane_position += st.seq_len
        self.step += 1
        self.epoch_step += 1

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position, "row_order": self.row_order, "lanes": self.lanes,
                "lane_position": self.lane_position, "end": self.stream(self.epoch).end, "step": self.step,
                "epoch_step": self.epoch_step, "tokens_before": self.tokens_before}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (its epoch's stream already rebuilt over the counts it began with)."""
        epoch, pos = int(state["epoch"]), int(state["position"])
        if epoch < 0 or pos < 0:
            raise LoaderError(f"token loader state has epoch {epoch}, position {pos}: not a position")
        order = state.get("row_order", "consecutive")
        if pos > 0 and order != self.row_order:
            raise LoaderError(f"epoch {epoch} began with row_order {order!r} and this loader has "
                              f"{self.row_order!r}: resume at an epoch boundary to change it")
        self.epoch, self.position = epoch, pos
        self.lanes = int(state["lanes"]) if pos > 0 and state.get("lanes") else None
        self.lane_position = int(state.get("lane_position", 0)) if pos > 0 else 0
        self.step, self.epoch_step = int(state["step"]), int(state["epoch_step"])
        self.tokens_before = int(state["tokens_before"])
        end = self.stream(epoch).end
        if pos > 0 and int(state["end"]) != end:
            raise LoaderError(f"epoch {epoch} of the saved state ends at token {state['end']}, "
                              f"rebuilt here at {end}: the sources are not those it began over")
        if pos > end:
            raise LoaderError(f"token loader state is at token {pos} of an epoch of {end}")
