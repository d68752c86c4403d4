"""Projected Attention Layers (Stickland & Murray 2019; PALs paper section 3.2).

For layer l and task (group) t:

    PAL_{l,t}(x) = D_t MultiHead_{l,t}(E_t x),    E_t in R^{s x d},  D_t in R^{d x s}

`E_t`/`D_t` are shared by every layer of task t; the multi-head attention works in dimension s and has
no output matrix W^O. The BERT layer adds `GELU(PAL_{l,t}(x))` inside its second layer norm (eq. 7).
No biases, so a task costs exactly `L * 3 s^2 + 2 s d` parameters (the paper's count).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ..utils import compute_dtype, is_capturing, one_hot


class PALAttention(nn.Module):
    """Multi-head self-attention in the projected dimension `s`, without output matrix (paper eq. 6)."""

    def __init__(self, pal_size: int, num_heads: int, dropout: float = 0.0):
        super().__init__()
        if pal_size % num_heads:
            raise ValueError(f"`pal_size` ({pal_size}) must be a multiple of `pal_num_heads` ({num_heads}).")
        self.num_heads = num_heads
        self.dropout = dropout
        # W^Q, W^K, W^V as one (3s, s) projection (rows: query, key, value): one product per PAL, and one weight per
        # group for the batched path to gather
        self.qkv = nn.Linear(pal_size, 3 * pal_size, bias=False)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        return self.attend_packed(self.qkv(x), key_mask)

    def attend_packed(self, qkv: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        """The attention of the projected queries, keys and values side by side in one `(B, T, 3s)` tensor; heads
        concatenated, no W^O. For sdpa the three split into `(B, h, T, s/h)` views of `qkv` (no copy); written out
        (`explicit_attention_wins`) they are copied into the heads' layout at once (`explicit_packed_attention`)."""
        if key_mask is not None and key_mask.dtype != torch.bool and key_mask.dtype != qkv.dtype:
            key_mask = key_mask.to(qkv.dtype)  # an additive mask made for another dtype (0 and -inf stay exact)
        dropout = self.dropout if self.training else 0.0
        if explicit_attention_wins(qkv, dropout):
            return explicit_packed_attention(qkv, self.num_heads, key_mask, dropout)
        batch, seq, size = qkv.shape[0], qkv.shape[1], qkv.shape[2] // 3
        # split, then each viewed as heads: the backward joins the three gradients with one `cat` (a view and permute
        # of the packed tensor would stack them and copy the permuted stack back: two copies)
        heads = (batch, seq, self.num_heads, size // self.num_heads)
        query, key, value = (part.view(heads).transpose(1, 2) for part in qkv.split(size, -1))
        out = F.scaled_dot_product_attention(
            query, key, value,
            attn_mask=key_mask,  # (B, 1, 1, T) bool (True = attend) or additive (`pal_key_mask`)
            dropout_p=dropout,
        )  # (B, h, T, s/h)
        return out.transpose(1, 2).reshape(batch, seq, size)


def explicit_attention_wins(query: torch.Tensor, dropout: float) -> bool:
    """Whether `PALAttention` writes its attention out (`explicit_packed_attention`) instead of calling
    `scaled_dot_product_attention`: on a CPU, with dropout on the probabilities (training), when not captured for
    export. There sdpa has no fused kernel and runs its composite math fallback, whose 4-D matmuls expand and copy
    their operands; the explicit form is the same attention (the same dropout draws, `_safe_softmax`) with fewer
    operations: `python benchmarks/op_count.py`, PALs 2,049 -> 2,007 aten ops per training step (7 fewer for each of
    its 6 PAL attentions). Its CPU step time is sdpa's within the noise of a 2-core machine: `python
    benchmarks/pals_vs_dense.py --rounds 9 --with-sdpa`, PALs/dense training step 1.357 and 1.359 written out, 1.330
    and 1.337 through sdpa (two runs); the two alone side by side (13 rounds), written out / sdpa 1.003 and 0.977.
    Everywhere else sdpa stays: its fused CPU kernel without dropout, the accelerators' fused kernels with it, the
    single operator an exported program keeps."""
    return dropout > 0.0 and query.device.type == "cpu" and _HAS_SAFE_SOFTMAX and not is_capturing()


_HAS_SAFE_SOFTMAX = hasattr(torch.ops.aten, "_safe_softmax")  # torch >= 2.5


def explicit_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_mask: torch.Tensor | None, dropout: float
) -> torch.Tensor:
    """`scaled_dot_product_attention(query, key, value, key_mask, dropout)` of `(B, h, T, s/h)` heads, written as
    sdpa's math fallback computes it but with 3-D products: the heads flattened into `bmm`'s batch (no broadcast,
    expand and copy of a 4-D matmul), the key mask and the scale applied by one `add`, `_safe_softmax` (as sdpa: a
    row whose keys are all masked attends to nothing, zeros and no NaN; `softmax` without a mask, where no row is),
    `F.dropout` on the probabilities (sdpa's draws), `bmm` with the values. `key_mask`: `(B, 1, 1, T)` bool
    (True = attend) or additive (`pal_key_mask`)."""
    batch, heads, seq, head_size = query.shape
    flat = (batch * heads, seq, head_size)
    out = _explicit_heads(query.reshape(flat), key.reshape(flat), value.reshape(flat), heads, key_mask, dropout)
    return out.view(batch, heads, seq, head_size)


def explicit_packed_attention(qkv: torch.Tensor, heads: int, key_mask: torch.Tensor | None, dropout: float):
    """`explicit_attention` of the queries, keys and values side by side in one `(B, T, 3s)` tensor (`PALAttention`'s
    projection), heads concatenated: `(B, T, s)`. The three are copied into the heads' layout `(3, B h, T, s/h)` by
    one `reshape` and cut by `unbind` (split, view, transpose and a reshape of each, ten operations more, would make
    the same three tensors); the backward stacks their gradients back with one `stack` and one copy."""
    batch, seq, size = qkv.shape[0], qkv.shape[1], qkv.shape[2] // 3
    head_size = size // heads
    query, key, value = (qkv.view(batch, seq, 3, heads, head_size).permute(2, 0, 3, 1, 4)
                         .reshape(3, batch * heads, seq, head_size).unbind(0))
    out = _explicit_heads(query, key, value, heads, key_mask, dropout)  # (B h, T, s/h)
    return out.view(batch, heads, seq, head_size).transpose(1, 2).reshape(batch, seq, size)


def _explicit_heads(query, key, value, heads: int, key_mask: torch.Tensor | None, dropout: float) -> torch.Tensor:
    """The written-out attention of `(B h, T, s/h)` heads (contiguous), `(B h, T, s/h)`; B may be 0 (a group with no
    rows, which ZeRO-3's every-group forward runs)."""
    flat, seq, head_size = query.shape
    scores = torch.bmm(query, key.transpose(1, 2))  # (B h, T, T)
    if key_mask is None:
        # no key masked: no row without a key to attend, so `softmax` is `_safe_softmax` (which also looks for them)
        probs = (scores * head_size ** -0.5).softmax(-1)
    else:
        if key_mask.dtype == torch.bool:  # the additive mask sdpa makes of it (a (B, 1, 1, T) tensor: cheap)
            key_mask = torch.full_like(key_mask, float("-inf"), dtype=scores.dtype).masked_fill_(key_mask, 0.0)
        # mask + q k^T / sqrt(s/h), one operation
        scores = torch.add(key_mask, scores.view(flat // heads, heads, seq, seq), alpha=head_size ** -0.5)
        # torch.ops.aten: `torch._safe_softmax` cannot be traced by torch.compile
        probs = torch.ops.aten._safe_softmax(scores, -1).view(flat, seq, seq)
    return torch.bmm(torch.dropout(probs, dropout, True), value)  # `F.dropout(probs, dropout)` without its checks


class PALDecoder(nn.Linear):
    """`D_t`: a bias-free `nn.Linear(s, d)` of its own class so that `_init_weights` can find it (models start it
    at zero: a module without parameters of its own is never visited by transformers' init for custom code)."""

    def __init__(self, pal_size: int, hidden_size: int):
        super().__init__(pal_size, hidden_size, bias=False)


class RowGroups(NamedTuple):
    """Each row's group, as `ProjectedAttentionLayers.select` prepares it for every layer of one forward."""

    groups: list[int]  # the groups taking part, ascending
    index: torch.LongTensor  # (batch,) each row's position in `groups`
    encoder: torch.Tensor  # (batch, d, s) each row's E_g, transposed, in the compute dtype: x E_g^T = bmm(x, encoder)
    decoder: torch.Tensor  # (batch, s, d) each row's D_g, transposed, in the compute dtype
    rows: torch.Tensor  # (batch, groups) each row's position in `groups`, one-hot, in the compute dtype
    qkv: dict[int, torch.Tensor]  # each PAL layer's (batch, 3s, s): each row's W^Q, W^K, W^V (not transposed)


class ProjectedAttentionLayers(nn.Module):
    """Every PAL of a model: per group g (a task, or tasks sharing PALs) an encoder `E_g` and decoder `D_g`
    shared by all layers, and one `PALAttention` per (PAL layer, group).

    Parameter names: `encoders.<g>.weight` (s, d), `decoders.<g>.weight` (d, s),
    `attention.<layer>.<g>.qkv.weight` (3s, s): the query, key and value projections, in that order.

    `runs_every_task` (default False): an eager forward runs every group's PALs, in group order, each on its rows --
    none for a group absent from the batch --, one module call per group: every forward then calls the same modules
    in the same order whatever the batch's mix, and an absent group's PALs get a zero gradient (as under DDP's static
    graph). What DeepSpeed needs (`hf_taskmoe.training.sharding.run_every_task` sets it, which says why).
    """

    runs_every_task = False

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

    def select(self, group_ids: torch.LongTensor, groups: list[int] | None = None) -> RowGroups:
        """Each row's group for `forward`, prepared once per model forward: `group_ids` `(batch,)` are the rows' groups
        and `groups` the groups present (ascending; known on the host from the split of the batch), None for every
        group (a captured forward, which reads nothing back). Only the groups listed take part in the graph, so the
        PALs of absent groups get no gradient (a zero one would still be moved by AdamW's momentum and weight decay).
        The encoders and decoders are shared by every layer: they are cast to the compute dtype (autocast's) and
        gathered per row here, once, so no layer casts a per-row copy again (under autocast a gathered weight is no
        parameter, which autocast's cast cache would keep). Rows select their group's weights by a one-hot product,
        whose backward is a product: `index_select`'s would scatter the rows' gradients into the groups with atomic
        adds."""
        if groups is None or len(groups) == self.num_groups:
            groups, index = list(range(self.num_groups)), group_ids
        else:  # each row's position among the groups present, on the device (no host read)
            present = torch.zeros(self.num_groups, dtype=torch.long, device=group_ids.device)
            present = present.scatter(0, group_ids, torch.ones_like(group_ids))
            index = (present.cumsum(0) - 1).index_select(0, group_ids)  # (batch,)
        rows = one_hot(index, len(groups), compute_dtype(self.encoders[0].weight))  # (batch, groups)
        # every layer's attention weights in one product (one stack, cast and product a forward, not one a layer), cut
        # by `unbind`, whose backward is one `stack` of the layers' gradients
        # the modules as Python lists: indexing a list, not an `nn.ModuleList` (a few Python calls each)
        attention = [list(self.attention[str(layer)]) for layer in self.layers]
        encoders, decoders = list(self.encoders), list(self.decoders)
        qkv = self.row_weights(rows, [per_layer[g].qkv for g in groups for per_layer in attention], len(attention))
        return RowGroups(groups, index, self.row_weights(rows, [encoders[g] for g in groups]),
                         self.row_weights(rows, [decoders[g] for g in groups]), rows,
                         dict(zip(self.layers, qkv.unbind(1))))

    @staticmethod
    def row_weights(rows: torch.Tensor, linears, per_group: int | None = None) -> torch.Tensor:
        """`(batch, in, out)`: each row's weight among `linears`' (one per group present, in `rows`' column order),
        transposed, in `rows`' dtype: one cast of the stack and one product. With `per_group`: `linears` holds that
        many weights of each group in turn (group-major), and the result is `(batch, per_group, out, in)`, not
        transposed: each layer transposes its own (a view), so the backward stacks the layers' gradients in the
        product's layout, with no copy of the whole stack to transpose it back."""
        stacked = torch.stack([linear.weight for linear in linears]).to(rows.dtype)  # (groups * per_group, out, in)
        out_features, in_features = stacked.shape[1:]
        product = rows @ stacked.view(rows.shape[1], -1)  # (batch, per_group * out * in)
        if per_group is None:
            return product.view(-1, out_features, in_features).transpose(1, 2)
        return product.view(-1, per_group, out_features, in_features)

    def plan(self, group_ids: torch.LongTensor, task_rows: dict | None, task_groups: list[int], dispatch: str):
        """How one model forward runs its PALs, worked out once for every layer. `group_ids` `(batch,)`: each row's
        group; `task_rows` (`{task id: rows}`, an eager forward's split of the batch, None when captured) and
        `task_groups` (each task's group) name the groups present. One group present: its PALs on the whole batch;
        several: batched across them or one call per group (`dispatch`, `batched_dispatch`); captured: every row
        through its group's PALs, every group taking part, nothing read back."""
        if task_rows is None:
            return self.select(group_ids)
        if self.runs_every_task:  # every group, a module call each (no weights read outside a call: ZeRO-3)
            return rows_by_group(task_rows, task_groups, group_ids.shape[0], every_group=self.num_groups)
        present = sorted({task_groups[t] for t in task_rows})
        if len(present) == 1:
            return [(present[0], None)]
        if batched_dispatch(dispatch, group_ids.device):
            return self.select(group_ids, present)
        return rows_by_group(task_rows, task_groups, group_ids.shape[0])

    def forward(
        self,
        x: torch.Tensor,
        layer_idx: int,
        group_rows: RowGroups | list[tuple[int, torch.Tensor | None]] | torch.LongTensor,
        key_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """`GELU(PAL_{l,g}(x))` for each row's group: `x` `(batch, seq, d)` is the layer's input.

        `group_rows` is either `RowGroups` (from `select`): every row runs through its own group's PAL at once, one
        batched product per projection, with no shape that depends on the batch's mix of groups; or each row's
        group id `(batch,)`, the same over every group; or the list (from `rows_by_group`) of each group present with
        its row indices (None = all rows): a task-homogeneous batch runs one PAL on the whole batch, a mixed one
        gathers its rows grouped by group once and runs one PAL call per group on its slice (many more operations
        than `RowGroups`, but plain products: faster on a CPU, `batched_dispatch`).
        """
        if isinstance(group_rows, torch.Tensor):
            group_rows = self.select(group_rows)
        if isinstance(group_rows, RowGroups):
            return self._batched(x, layer_idx, group_rows, key_mask)
        attention = self.attention[str(layer_idx)]
        if len(group_rows) == 1 and group_rows[0][1] is None:
            g = group_rows[0][0]
            return F.gelu(self.decoders[g](attention[g](self.encoders[g](x), key_mask)))
        # the rows grouped by group with one gather, each group's a contiguous slice of it (the sizes are the row
        # tensors' lengths: known on the host), and put back in batch order with one copy
        order = torch.cat([rows for _, rows in group_rows])  # (batch,) every row once: the groups cover the batch
        sizes = [rows.shape[0] for _, rows in group_rows]
        inputs = x.index_select(0, order).split(sizes)
        masks = key_mask.index_select(0, order).split(sizes) if key_mask is not None else [None] * len(sizes)
        pal = torch.cat([
            F.gelu(self.decoders[g](attention[g](self.encoders[g](rows_x), mask)))  # (rows, seq, d)
            for (g, _), rows_x, mask in zip(group_rows, inputs, masks)
        ])  # (batch, seq, d) in `order`; in the PAL's dtype (under autocast bf16/fp16 while `x` is fp32)
        return pal.new_empty(pal.shape).index_copy_(0, order, pal)

    def _batched(self, x: torch.Tensor, layer_idx: int, rows: RowGroups, key_mask) -> torch.Tensor:
        """Every row through its own group's PAL in one batched product per projection: the groups' weights are
        stacked and gathered per row (the query, key and value weights of a group as one `(3s, s)` matrix). No host
        sync and no data-dependent shape (what `torch.export`, ONNX and a sync-free training step need); the same
        numbers as the per-group path."""
        attention = self.attention[str(layer_idx)]
        # bmm, not einsum: the same products with a third of the operations (einsum adds permutes and reshapes)
        h = torch.bmm(x.to(rows.rows.dtype), rows.encoder)  # (B, T, s): E_g x
        # (B, T, 3s) -> (B, T, s); the groups' attentions share their settings
        out = attention[0].attend_packed(torch.bmm(h, rows.qkv[layer_idx].mT), key_mask)  # rows.qkv: (B, 3s, s)
        return F.gelu(torch.bmm(out, rows.decoder))  # (B, T, d): D_g


def batched_dispatch(choice: str, device: torch.device) -> bool:
    """Whether an eager forward runs a mixed batch's PALs batched across groups (`pal_dispatch`): always for
    `"batched"`; for `"auto"` on an accelerator or under `torch.compile` (where launches count and a shape may not
    depend on the mix), not on a CPU (where one product per group is faster)."""
    return choice == "batched" or (choice == "auto" and (device.type != "cpu" or torch.compiler.is_compiling()))


def rows_by_group(
    task_rows: dict[int, torch.Tensor], task_groups: list[int], batch: int, every_group: int | None = None
) -> list[tuple[int, torch.Tensor | None]]:
    """`[(group, row indices)]` of the groups present, from the rows of each task present (host-side structure, no
    sync): each group's rows are its tasks' rows concatenated; a group holding every row -> `[(group, None)]` (no
    gather). `every_group` (the number of groups): every group, an absent one with no row."""
    groups: dict[int, list[torch.Tensor]] = {}
    for t, rows in task_rows.items():
        groups.setdefault(task_groups[t], []).append(rows)
    if every_group is not None:
        none = next(iter(task_rows.values())).new_zeros(0)
        for g in range(every_group):
            groups.setdefault(g, [none])
    if len(groups) == 1:
        (g, parts), = groups.items()
        if sum(len(r) for r in parts) == batch:
            return [(g, None)]
    return [(g, parts[0] if len(parts) == 1 else torch.cat(parts)) for g, parts in sorted(groups.items())]


def pal_key_mask(
    attention_mask: torch.Tensor | None, encoder_mask: torch.Tensor | None, dtype: torch.dtype | None = None
) -> torch.Tensor | None:
    """`(batch, seq)` 0/1 padding mask -> `(batch, 1, 1, seq)` for the PALs' attention, None when nothing is
    padded. Whether anything is padded is read from `encoder_mask`, the BERT layers' own mask from
    `create_bidirectional_mask` (None when no key is masked; finding that out is transformers' host sync), so the
    PALs add none.

    Without `dtype`: bool, True = attend. With `dtype` (the PALs' compute dtype: the hidden states' outside autocast,
    autocast's inside): the additive mask `scaled_dot_product_attention` would make of the bool one in every
    layer (0 where a key is attended, -inf where it is padding), made once for every layer."""
    if attention_mask is None or encoder_mask is None:
        return None
    keep = attention_mask.bool().reshape(attention_mask.shape[0], 1, 1, attention_mask.shape[-1])  # one view
    if dtype is None:
        return keep
    dtype = compute_dtype(attention_mask, default=dtype)
    return torch.full_like(keep, float("-inf"), dtype=dtype).masked_fill_(keep, 0.0)
