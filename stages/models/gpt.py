"""``gpt``: a small decoder-only transformer (nanoGPT's shape: pre-norm blocks, GELU MLP, tied
embeddings) over packed token rows. Attention is causal and stays within a document: where the
batch says which document each token belongs to (``TokenInputs.segment_ids``), a token attends
only to earlier tokens of its own document, and positions restart at each document
(``position_ids``), so packing several documents into a row changes nothing a document sees.

In the model registry a factory takes ``(in_channels, num_classes)``; for a language model
``num_classes`` is the vocabulary size (``in_channels`` is unused)."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from sluice.stages.contracts import TokenInputs
from sluice.stages.models.base import MODELS


class Block(nn.Module):
    """Pre-norm attention and MLP, each added to the residual stream."""

    def __init__(self, d_model: int, n_head: int, dropout: float):
        super().__init__()
        self.n_head, self.dropout = n_head, dropout
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        B, L, D = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(D, dim=2)
        q, k, v = (t.view(B, L, self.n_head, D // self.n_head).transpose(1, 2) for t in (q, k, v))
        p = self.dropout if self.training else 0.0
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, is_causal=mask is None)
        x = x + self.drop(self.proj(a.transpose(1, 2).reshape(B, L, D)))
        return x + self.drop(self.mlp(self.ln2(x)))


@MODELS.register("gpt")
class GPT(nn.Module):
    """Token ids (B, L) or ``TokenInputs`` → next-token logits (B, L, vocab)."""
    task = "language_model"  # what the trainer trains it for (``stages/train/tasks.py``)

    def __init__(self, in_channels: int = 1, num_classes: int = 256, *, n_layer: int = 4, n_head: int = 4,
                 d_model: int = 128, max_len: int = 1024, dropout: float = 0.0):
        super().__init__()
        if d_model % n_head:
            raise ValueError(f"d_model {d_model} must divide by n_head {n_head}")
        self.vocab_size, self.max_len = num_classes, max_len
        self.tok = nn.Embedding(num_classes, d_model)
        self.pos = nn.Embedding(max_len, d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(d_model, n_head, dropout) for _ in range(n_layer))
        self.ln = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, num_classes, bias=False)
        self.head.weight = self.tok.weight  # tied, as GPT-2
        self.apply(self._init)
        for name, p in self.named_parameters():  # GPT-2's scaled init of the residual projections
            if name.endswith("proj.weight") or name.endswith("mlp.2.weight"):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, 0.0, 0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor | TokenInputs) -> torch.Tensor:
        inputs = x if isinstance(x, TokenInputs) else TokenInputs(x)
        ids = inputs.input_ids
        B, L = ids.shape
        if L > self.max_len:
            raise ValueError(f"rows of {L} tokens are longer than the model's max_len {self.max_len}")
        pos = inputs.position_ids if inputs.position_ids is not None else \
            torch.arange(L, device=ids.device).expand(B, L)
        h = self.drop(self.tok(ids) + self.pos(pos.clamp(0, self.max_len - 1)))
        mask = None
        if inputs.segment_ids is not None:  # causal, and within one document
            seg = inputs.segment_ids
            causal = torch.ones(L, L, dtype=torch.bool, device=ids.device).tril()
            mask = (causal & (seg[:, :, None] == seg[:, None, :]))[:, None]
        for block in self.blocks:
            h = block(h, mask)
        return self.head(self.ln(h))
