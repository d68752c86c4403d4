"""Projected Attention Layers (Stickland & Murray 2019; PALs paper section 3.2).

For layer l and task (group) t:

    PAL_{l,t}(x) = D_t MultiHead_{l,t}(E_t x),    E_t in R^{s x d},  D_t in R^{d x s}

`E_t`/`D_t` are shared by every layer of task t; the multi-head attention works in dimension s and has
no output matrix W^O. The BERT layer adds `GELU(PAL_{l,t}(x))` inside its second layer norm (eq. 7).
No biases, so a task costs exactly `L * 3 s^2 + 2 s d` parameters (the paper's count).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class PALAttention(nn.Module):
    """Multi-head self-attention in the projected dimension `s`, without output matrix (paper eq. 6)."""

    def __init__(self, pal_size: int, num_heads: int, dropout: float = 0.0):
        super().__init__()
        if pal_size % num_heads:
            raise ValueError(f"`pal_size` ({pal_size}) must be a multiple of `pal_num_heads` ({num_heads}).")
        self.num_heads = num_heads
        self.dropout = dropout
        self.query = nn.Linear(pal_size, pal_size, bias=False)
        self.key = nn.Linear(pal_size, pal_size, bias=False)
        self.value = nn.Linear(pal_size, pal_size, bias=False)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        batch, seq, size = x.shape

        def heads(proj: nn.Linear) -> torch.Tensor:
            return proj(x).view(batch, seq, self.num_heads, size // self.num_heads).transpose(1, 2)  # (B, h, T, s/h)

        out = F.scaled_dot_product_attention(
            heads(self.query), heads(self.key), heads(self.value),
            attn_mask=key_mask,  # (B, 1, 1, T) bool: True = attend
            dropout_p=self.dropout if self.training else 0.0,
        )  # (B, h, T, s/h)
        return out.transpose(1, 2).reshape(batch, seq, size)  # heads concatenated, no W^O


class PALDecoder(nn.Linear):
    """`D_t`: a bias-free `nn.Linear(s, d)` of its own class so that `_init_weights` can find it (models start it
    at zero: a module without parameters of its own is never visited by transformers' init for custom code)."""

    def __init__(self, pal_size: int, hidden_size: int):
        super().__init__(pal_size, hidden_size, bias=False)


class ProjectedAttentionLayers(nn.Module):
    """Every PAL of a model: per group g (a task, or tasks sharing PALs) an encoder `E_g` and decoder `D_g`
    shared by all layers, and one `PALAttention` per (PAL layer, group).

    Parameter names: `encoders.<g>.weight` (s, d), `decoders.<g>.weight` (d, s),
    `attention.<layer>.<g>.{query,key,value}.weight` (s, s).
    """

    def __init__(
        self, hidden_size: int, pal_size: int, num_heads: int, num_groups: int, layers: list[int], dropout: float = 0.0
    ):
        super().__init__()
        self.layers = list(layers)
        self.encoders = nn.ModuleList(nn.Linear(hidden_size, pal_size, bias=False) for _ in range(num_groups))
        self.decoders = nn.ModuleList(PALDecoder(pal_size, hidden_size) for _ in range(num_groups))
        self.attention = nn.ModuleDict(
            {
                str(layer): nn.ModuleList(PALAttention(pal_size, num_heads, dropout) for _ in range(num_groups))
                for layer in layers
            }
        )

    @property
    def num_groups(self) -> int:
        return len(self.encoders)

    def has_layer(self, layer_idx: int) -> bool:
        return str(layer_idx) in self.attention

    def forward(
        self,
        x: torch.Tensor,
        layer_idx: int,
        group_rows: list[tuple[int, torch.Tensor | None]],
        key_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """`GELU(PAL_{l,g}(x))` for each row's group: `x` `(batch, seq, d)` is the layer's input.

        `group_rows` (from `split_groups`) lists each group present with its row indices (None = all rows),
        so a task-homogeneous batch runs one PAL on the whole batch, and a mixed one gathers rows per group.
        """
        attention = self.attention[str(layer_idx)]
        if len(group_rows) == 1 and group_rows[0][1] is None:
            g = group_rows[0][0]
            return F.gelu(self.decoders[g](attention[g](self.encoders[g](x), key_mask)))
        out = None
        for g, rows in group_rows:
            mask = key_mask.index_select(0, rows) if key_mask is not None else None
            pal = F.gelu(
                self.decoders[g](attention[g](self.encoders[g](x.index_select(0, rows)), mask))
            )  # (rows, seq, d)
            # in the PAL's dtype: under autocast the projections give bf16/fp16 while `x` is fp32
            out = (pal.new_zeros(x.shape) if out is None else out).index_copy(0, rows, pal)
        return out


def split_groups(group_ids: torch.LongTensor) -> list[tuple[int, torch.Tensor | None]]:
    """`[(group, row indices)]` of the groups present in a batch; one group -> `[(group, None)]` (no gather).
    Host syncs (`unique`, `nonzero`): the encoder on its own uses it; the task models pass `rows_by_group`'s."""
    present = torch.unique(group_ids).tolist()
    if len(present) == 1:
        return [(present[0], None)]
    return [(g, (group_ids == g).nonzero(as_tuple=True)[0]) for g in present]


def rows_by_group(
    task_rows: dict[int, torch.Tensor], task_groups: list[int], batch: int
) -> list[tuple[int, torch.Tensor | None]]:
    """`split_groups` from the rows of each task present (host-side structure, no sync): each group's rows are its
    tasks' rows concatenated; a group holding every row -> `[(group, None)]` (no gather)."""
    groups: dict[int, list[torch.Tensor]] = {}
    for t, rows in task_rows.items():
        groups.setdefault(task_groups[t], []).append(rows)
    if len(groups) == 1:
        (g, parts), = groups.items()
        if sum(len(r) for r in parts) == batch:
            return [(g, None)]
    return [(g, parts[0] if len(parts) == 1 else torch.cat(parts)) for g, parts in sorted(groups.items())]


def pal_key_mask(attention_mask: torch.Tensor | None, encoder_mask: torch.Tensor | None) -> torch.Tensor | None:
    """`(batch, seq)` 0/1 padding mask -> `(batch, 1, 1, seq)` bool for the PALs' attention, None when nothing is
    padded. Whether anything is padded is read from `encoder_mask`, the BERT layers' own mask from
    `create_bidirectional_mask` (None when no key is masked; finding that out is transformers' host sync), so the
    PALs add none."""
    if attention_mask is None or encoder_mask is None:
        return None
    return attention_mask.bool()[:, None, None, :]
