"""``infobatch`` over packed token rows, its table keyed by document.

A packed row is no stable sample: the token loader re-packs the stream every epoch (a mixture
draws and orders documents per (seed, epoch)), so a row's start names other tokens each epoch.
Documents are stable, so the table is: each document's last training loss (the mean over its
tokens trained since the previous gather; under DDP over every rank's) and the tokens behind it.
A row's stale score is the token-weighted mean of its documents' losses; the threshold is the
token-weighted mean over the seen documents, which is the mean row score (a row is L tokens), so
"below the mean" splits rows as InfoBatch splits samples. A row holding a document never trained
is never pruned, as an unseen image is not; nor is a row of padding only.

Everything else is the image selector's (``infobatch.InfoBatchSelector``, this class's base):
the pruned count ``round(prune * f * B)`` per rank (``f``: the share of the epoch's rows expected
eligible, here the token share of the seen documents below the mean times the share of documents
seen), the drawn rows, the weights ``eligible / (eligible - dropped)`` scaled by ``kept / B``
(drop mode) or weight 0 for the dropped rows (mask mode), annealing and ``sync_every``.

The language-model task gives it what it needs (``train.tasks.TokenTask``): as indices each
input token's document key (``TokenLoader(doc_keys=True)``; -1 where the token counts for
nothing: padding, an ignored target) and, to ``observe``, the (B, L) per-token losses. Observing
adds them into per-document sums on the device (nothing read); a gather (every ``sync_every``
observes) all-gathers each rank's (document, loss sum, token count) triples and sets the table.
Its checkpoint state names its tables ``doc_loss``/``doc_seen``/``doc_tokens``, so an image
selector's state (or the warm run's carried per-sample table) is never taken for it.
"""
from __future__ import annotations

import math

import torch

from sluice.errors import SelectionError
from sluice.stages.contracts import SelectedBatch, SelectionStats
from sluice.stages.select.base import ROW_FORMS, BaseSelector, SelectorContext
from sluice.stages.select.collectives import all_gather_1d
from sluice.stages.select.infobatch import InfoBatchSelector


def token_row_selector(selector: InfoBatchSelector) -> "InfoBatchRows":
    """An infobatch selector's form for packed token rows, keyed by document (its config and
    table size, the token loader's ``n_doc_keys``); refused once its table holds per-sample
    losses, carried from an image champion or observed. Registered as infobatch's row form
    (``base.ROW_FORMS``): ``selector.for_token_rows()`` makes it."""
    if isinstance(selector, InfoBatchRows):
        return selector
    if selector._pending or bool(selector.seen.any()):
        raise SelectionError("this infobatch table already holds per-sample losses (carried from a "
                             "champion, or observed on images): it cannot key the documents of token rows")
    return InfoBatchRows(selector.config, SelectorContext(split_size=selector.n, device=selector.device))


class InfoBatchRows(InfoBatchSelector):
    """InfoBatch over packed token rows (``for_token_rows`` of an infobatch selector): indices are
    (B, L) document keys in ``0 .. split_size - 1`` (the token loader's ``n_doc_keys``), -1 for a
    token that counts for nothing; ``observe`` takes (B, L) per-token losses. Its threshold is the
    table's at each epoch's start (``epoch_threshold``: measured, the running mean prunes a third
    as many rows of a language model, whose loss falls fast within an epoch)."""

    epoch_threshold = True

    def __init__(self, config, ctx: SelectorContext):
        if ctx.carried is not None:
            raise SelectionError("infobatch on token rows keys documents: a carried per-sample table "
                                 "(a warm run's, over image samples) cannot be given to it")
        super().__init__(config, ctx)
        n, dev = self.n, self.device
        self._tokens = torch.zeros(n + 1, dtype=torch.float32, device=dev)  # tokens behind each loss
        # this rank's observations since the last gather: per-document loss sums and token counts
        # (the spare slot n takes what counts for nothing), so observing reads nothing
        self._sum = torch.zeros(n + 1, dtype=torch.float64, device=dev)
        self._count = torch.zeros(n + 1, dtype=torch.float64, device=dev)

    def for_token_rows(self) -> "InfoBatchRows":
        return self

    @property
    def tokens(self) -> torch.Tensor:
        """The tokens each document's loss was the mean of (valid where ``seen``)."""
        return self._tokens[:self.n]

    def _place(self, device: torch.device) -> None:
        if device == self.device:
            return
        super()._place(device)
        self._tokens, self._sum, self._count = (t.to(device) for t in (self._tokens, self._sum, self._count))

    # ------------------------------------------------------------------ selection
    def __call__(self, model, inputs, targets, keys) -> SelectedBatch:
        if keys.ndim != 2 or keys.shape[0] != len(inputs):
            raise SelectionError(f"infobatch on token rows takes each token's document key (rows, length), got "
                                 f"indices of shape {tuple(keys.shape)}: build the token loader with doc_keys=True")
        return super().__call__(model, inputs, targets, keys)

    def _eligible(self, keys: torch.Tensor) -> torch.Tensor:
        """Rows whose documents are all seen and whose token-weighted stale loss is below the
        mean, on the device (nothing read; a key outside the table is flagged, raised at the
        next gather). A row of padding only is not eligible."""
        k = keys.detach().to(self.device)
        lo, hi = torch.aminmax(k)
        self._outside |= (lo < -1) | (hi >= self.n)
        valid = k >= 0
        slot = k.clamp(0, self.n - 1)
        counted = valid.sum(1)
        score = torch.where(valid, self.loss[slot], 0.0).sum(1) / counted.clamp(min=1)
        known = (self.seen[slot] | ~valid).all(1) & (counted > 0)
        return known & (score < self._mean)

    def _eligible_positions(self, keys: torch.Tensor) -> torch.Tensor:
        eligible = self._eligible(keys)
        if bool(self._outside):  # drop mode reads anyway: say it now
            self._raise_outside()
        return eligible.nonzero().squeeze(1)

    def _stats(self, indices: torch.Tensor, pos: torch.Tensor, loss: torch.Tensor | None) -> SelectionStats:
        """Counts in rows (no IL scores or noise masks over documents)."""
        return SelectionStats({"n_candidates": float(len(indices)), "n_selected": float(pos.numel())})

    # ------------------------------------------------------------------ the table
    def observe(self, keys: torch.Tensor, losses: torch.Tensor) -> None:
        """Add the trained rows' per-token losses into their documents' sums (on the device).
        A NaN/inf loss counts for nothing (its document keeps its entry); a mask-mode batch's
        dropped rows count for nothing, as drop mode never trains them."""
        if keys.shape != losses.shape or keys.ndim != 2:
            raise SelectionError(f"infobatch on token rows observes (rows, length) document keys and per-token "
                                 f"losses, got {tuple(keys.shape)} and {tuple(losses.shape)}")
        self._place(losses.device)
        val = losses.detach().to(self.device, torch.float64)
        for k, (handed, keep) in enumerate(self._masks):
            if handed is keys:  # this draw's; older ones were never observed
                del self._masks[:k + 1]
                val = torch.where(keep.to(self.device)[:, None], val, math.nan)
                break
        k = keys.detach().to(self.device, torch.int64)
        lo, hi = torch.aminmax(k)
        self._outside |= (lo < -1) | (hi >= self.n)
        ok = (k >= 0) & (k < self.n) & torch.isfinite(val)
        slot = torch.where(ok, k, self.n).reshape(-1)
        self._sum.index_add_(0, slot, torch.where(ok, val, 0.0).reshape(-1))
        self._count.index_add_(0, slot, ok.reshape(-1).to(torch.float64))
        self._pending_calls += 1
        if self._pending_calls >= self.params.sync_every:
            self.flush()

    def _pending_triples(self) -> torch.Tensor:
        """This rank's pending observations as (document, loss sum, token count) rows (a read)."""
        hit = (self._count[:self.n] > 0).nonzero().squeeze(1)
        return torch.stack([hit.to(torch.float64), self._sum[hit], self._count[hit]], 1)

    def flush(self) -> None:
        """All-gather every rank's (document, loss sum, token count) triples and set each
        document's loss to the mean over its tokens (a collective under DDP, at the same step on
        every rank; float64 holds document keys exactly below 2**53)."""
        mine = self._pending_triples().reshape(-1)
        self._sum.zero_()
        self._count.zero_()
        self._pending_calls = 0
        both = all_gather_1d(mine, ragged=True).reshape(-1, 3)
        self._merge(both[:, 0].to(torch.int64), both[:, 1], both[:, 2])

    def _merge(self, doc: torch.Tensor, sums: torch.Tensor, counts: torch.Tensor) -> None:
        """Documents' summed losses and token counts (a document may come twice: two ranks'
        rows of it) into the table."""
        n = self.n
        s = torch.zeros(n + 1, dtype=torch.float64, device=self.device).index_add_(0, doc, sums)
        c = torch.zeros(n + 1, dtype=torch.float64, device=self.device).index_add_(0, doc, counts)
        got = c[:n] > 0
        self._loss[:n] = torch.where(got, s[:n] / c[:n].clamp(min=1), self._loss[:n].double()).float()
        self._tokens[:n] = torch.where(got, c[:n].float(), self._tokens[:n])
        self._seen[:n] |= got
        self._refresh()

    def _refresh(self) -> None:
        """The token-weighted mean over the seen documents, and ``f``: the token share of the seen
        documents below it times the share of documents seen (one read per gather)."""
        seen = self.seen
        w = torch.where(seen, self.tokens.double(), 0.0)
        total = w.sum()
        mean = (w * self.loss.double()).sum() / total.clamp(min=1e-300)
        below = torch.where(self.loss.double() < mean, w, 0.0).sum()
        total, mean, below, n_seen, outside = torch.stack(
            [total, mean, below, seen.sum().double(), self._outside.double()]).tolist()
        if outside:
            self._raise_outside()
        self._set_threshold(*((mean, below / total * n_seen / self.n) if total > 0 else (math.inf, 0.0)))

    def _raise_outside(self) -> None:
        raise SelectionError(f"a document key outside the table of {self.n} documents reached infobatch: "
                             "build the selector with split_size = the token loader's n_doc_keys")

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """The table and this rank's pending sums as CPU tensors (``weights_only`` checkpoints);
        no collective here, so a resumed run gathers them at the step the uninterrupted one would.
        A rank of a resize takes rank ``r mod W``'s (``train.checkpointer.rank_part``): the table
        is every rank's; a lost rank's pending sums only delay those documents' update."""
        t = self._pending_triples().cpu()
        gen, kind = self._mask_state
        if self._mask_gen is not None:
            gen, kind = self._mask_gen.get_state(), self._mask_gen.device.type
        return {**BaseSelector.state_dict(self), "unit": "documents",
                "doc_loss": self.loss.cpu().clone(), "doc_seen": self.seen.cpu().clone(),
                "doc_tokens": self.tokens.cpu().clone(),
                "pending_doc": t[:, 0].to(torch.int64), "pending_sum": t[:, 1], "pending_count": t[:, 2],
                "pending_calls": self._pending_calls,
                "threshold_epoch": self._epoch, "threshold": None if self._snap is None else list(self._snap),
                "mask_generator": None if gen is None else gen.cpu().clone(), "mask_generator_device": kind}

    def load_state_dict(self, state: dict) -> None:
        if "doc_loss" not in state:
            raise SelectionError("this infobatch state keys samples, not documents (an image run's "
                                 "checkpoint): a language model's rows cannot resume from it")
        if state["doc_loss"].numel() != self.n:
            raise SelectionError(f"infobatch state is for {state['doc_loss'].numel()} documents, the token "
                                 f"loader has {self.n}")
        BaseSelector.load_state_dict(self, state)
        n, dev = self.n, self.device
        self._loss[:n] = state["doc_loss"].float().to(dev)
        self._seen[:n] = state["doc_seen"].to(dev)
        self._tokens[:n] = state["doc_tokens"].float().to(dev)
        self._sum.zero_()
        self._count.zero_()
        doc = state["pending_doc"].to(dev, torch.int64)
        self._sum.index_add_(0, doc, state["pending_sum"].to(dev, torch.float64))
        self._count.index_add_(0, doc, state["pending_count"].to(dev, torch.float64))
        self._pending_calls = int(state.get("pending_calls", 0))
        snap = state.get("threshold")
        self._epoch, self._snap = state.get("threshold_epoch"), None if snap is None else (snap[0], snap[1])
        self._refresh()
        self._mask_gen, self._masks = None, []
        self._mask_state = (state.get("mask_generator"), state.get("mask_generator_device"))


ROW_FORMS["infobatch"] = token_row_selector
