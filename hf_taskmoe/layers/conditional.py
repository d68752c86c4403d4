"""Task-conditioned modules of CA-MTL (section 2.1): FiLM, conditional attention bias, conditional
alignment, conditional layer norm and the conditional bottleneck.

Every module is conditioned on a task embedding `z` through `FiLM`, which maps `z` to `gamma(z)` and
`beta(z)` (Definition 1: `phi(W | z) = gamma(z) W + beta(z)`). `FiLM` is written `gamma = 1 + W_g z + b_g`,
`beta = W_b z + b_b` and its weights start at zero, so that every module starts as its unconditioned
counterpart: CLN as BERT's LayerNorm, alignment as the identity, bottleneck as zero, attention bias as
the fixed block-diagonal `A` (or zero with `init_std = 0`). Training moves them per task from there.

Conditioning is computed once per task (on the `(tasks, task_dim)` embedding table), then gathered per
row, so a batch may mix tasks at no extra cost.

Shapes: `hidden` is `(batch, seq, d)`; `cond` is a `Conditioning` holding the batch's task ids and the
embedding table.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F


@dataclass
class Conditioning:
    """The task embedding table `(tasks, task_dim)` and each row's task id `(batch,)`; `rows`, when given, is each
    row's task embedding `table[task_ids]` `(batch, task_dim)`, gathered once for every module of a forward
    (`Conditioning.gathered`) so that each FiLM applies to it directly instead of gathering its own output."""

    table: torch.Tensor
    task_ids: torch.LongTensor
    rows: torch.Tensor | None = None
    films: dict | None = None  # FiLM -> each row's (gamma, beta), made for many FiLMs at once (`many_films`)
    biases: dict | None = None  # ConditionalAttentionBias -> each row's M(z), made for all at once (`many_biases`)

    @classmethod
    def gathered(cls, table: torch.Tensor, task_ids: torch.LongTensor, films=(), biases=(),
                 length: int | None = None) -> Conditioning:
        """A conditioning whose rows are gathered now: make it once per forward, outside any checkpointed layer, and
        share it between the layers. `films`: FiLMs whose output of each row is made now, all in one product;
        `biases`: conditional attention biases (of one shape) whose matrices of each row, cropped to `length`
        tokens, are made now, all together."""
        rows = table.index_select(0, task_ids)
        fits = biases and length is not None and length <= biases[0].max_length  # else each layer's own path (errors)
        made = many_biases(biases, table, task_ids, length) if fits else None
        return cls(table, task_ids, rows, many_films(films, rows.unsqueeze(1)) if films else None, made)


class FiLM(nn.Linear):
    """`z -> (gamma(z), beta(z))`, each of size `features`, for every task of the table: `(tasks, features)`.

    `gamma(z) = 1 + W_g z + b_g`, `beta(z) = W_b z + b_b`: one Linear `task_dim -> 2 features` produces both.
    Zero-initialised (in the model's `_init_weights`), so `gamma = 1`, `beta = 0` until training moves them.
    """

    def __init__(self, task_dim: int, features: int, device=None, dtype=None):
        super().__init__(task_dim, 2 * features, device=device, dtype=dtype)
        self.features = features

    def forward(self, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gamma, beta = super().forward(table).chunk(2, dim=-1)  # (tasks, features) each
        return 1.0 + gamma, beta


def many_films(films, z: torch.Tensor) -> dict:
    """Each FiLM's `(gamma(z), beta(z))`, `(..., features)` each, for many FiLMs in one product of the task embeddings
    `z` (`(..., task_dim)`) with their weights side by side: one cast and one matrix product
    (and one of each in the backward) instead of one per FiLM, what a model's dozens of small FiLMs cost a GPU in
    launches."""
    weight = torch.cat([film.weight for film in films])  # (sum of 2 features, task_dim)
    bias = torch.cat([film.bias for film in films])
    parts = F.linear(z, weight, bias).split([film.features for film in films for _ in "gb"], -1)
    return {film: (1.0 + parts[2 * i], parts[2 * i + 1]) for i, film in enumerate(films)}


def film_per_row(film: FiLM, cond: Conditioning) -> tuple[torch.Tensor, torch.Tensor]:
    """`gamma(z)`, `beta(z)` of each row's task: `(batch, 1, features)` each. Made already with the model's other
    FiLMs (`cond.films`), or else: with `cond.rows` the FiLM applies to the rows' embeddings gathered once per
    forward; otherwise it is computed once per task and gathered per row as one `(batch, 2 features)` tensor (a
    third fewer operations than gathering gamma and beta apart)."""
    made = cond.films.get(film) if cond.films is not None else None
    if made is not None:
        return made
    if cond.rows is not None:
        both = F.linear(cond.rows, film.weight, film.bias)  # (batch, 2 features)
    else:
        both = F.linear(cond.table, film.weight, film.bias).index_select(0, cond.task_ids)  # FiLM.forward, per row
    gamma, beta = both.unsqueeze(1).chunk(2, dim=-1)  # (batch, 1, features) each
    return 1.0 + gamma, beta


def _transformed_product(x: torch.Tensor, xw: torch.Tensor, film: FiLM, cond: Conditioning) -> torch.Tensor:
    """`x (W diag(gamma(z)) + 1 beta(z)^T)` given `xw = x W`: `(x W) * gamma + (sum_k x_k) beta` (eq. 2's weight
    transform, without forming a matrix per task)."""
    gamma, beta = film_per_row(film, cond)
    return xw * gamma + x.sum(-1, keepdim=True) * beta


class ConditionalLayerNorm(nn.LayerNorm):
    """Conditional Layer Normalization (eq. 3): `h = norm(a) * (gamma' * gamma(z)) + beta' + beta(z)`.

    `weight`/`bias` are `gamma'`/`beta'` and keep LayerNorm's names, so BERT's LayerNorm loads into them
    one to one; with the FiLM at its zero start the module computes exactly that LayerNorm. (Eq. 3 as
    printed, `gamma^ = gamma' gamma(z) + beta'`, would not reduce to BERT's LayerNorm, which the paper says
    CLN is initialised as; we read the `+ beta'` as the LayerNorm's own bias.)
    """

    def __init__(self, hidden_size: int, task_dim: int, eps: float = 1e-12):
        super().__init__(hidden_size, eps=eps)
        self.film = FiLM(task_dim, hidden_size)

    def forward(self, hidden: torch.Tensor, cond: Conditioning | None = None) -> torch.Tensor:
        if cond is None:
            return super().forward(hidden)
        return film_layer_norm(self, hidden, *film_per_row(self.film, cond))


def film_layer_norm(norm: nn.LayerNorm, hidden: torch.Tensor, gamma: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """`norm(hidden) * gamma + beta` for a LayerNorm's own `weight` (`gamma'`, inside the fused norm) and `bias`
    (`beta'`, added to `beta`; a norm without one keeps none): `norm(a) gamma' gamma(z) + beta' + beta(z)`, eq. 3
    reassociated. `gamma`, `beta`: `(batch, 1, d)`. (One `addcmul` for the product and the shift was measured and
    dropped: its backward of the broadcast operands adds kernels, `benchmarks/cost_proxies.py` CA-MTL 1.414 -> 1.425
    of dense's per training step.)"""
    shift = beta if norm.bias is None else norm.bias + beta
    return F.layer_norm(hidden, norm.normalized_shape, norm.weight, None, norm.eps) * gamma + shift


class ConditionalAlignment(nn.Module):
    """Conditional Alignment (eq. 2) between the embeddings and the first layer: `x R^(z)`, with
    `R^(z) = R diag(gamma(z)) + 1 beta(z)^T` (gamma scales R's columns, beta is added to every row).

    By linearity `x R^(z) = (x R) * gamma(z) + (sum_k x_k) beta(z)`, computed without forming `R^` per
    task. `R` starts as the identity, so a fresh module passes its input through unchanged.
    """

    def __init__(self, hidden_size: int, task_dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size, hidden_size))  # R, (d_in, d_out)
        self.film = FiLM(task_dim, hidden_size)

    def forward(self, hidden: torch.Tensor, cond: Conditioning) -> torch.Tensor:
        return _transformed_product(hidden, hidden @ self.weight, self.film, cond)


class ConditionalAttentionBias(nn.Module):
    """The block-diagonal conditional matrix `M(z) = diag(A'_1, ..., A'_N)`, `A'_n = A_n gamma(z) + beta(z)`
    (section 2.1.1), added to `QK^T / sqrt(d)` before the softmax.

    `A_n` are `N` trainable `(b, b)` blocks, `b = ceil(max_length / N)`; `gamma, beta: R^task_dim ->
    R^(b*b)` modulate every block element-wise (the paper's `R^(L^2/N^2)`). A sequence of length
    `L <= max_length` uses the top-left `L x L` of `M`, so any length up to the maximum works.
    """

    def __init__(self, max_length: int, num_blocks: int, task_dim: int):
        super().__init__()
        self.max_length = max_length
        self.num_blocks = num_blocks
        self.block_size = math.ceil(max_length / num_blocks)
        self.blocks = nn.Parameter(torch.empty(num_blocks, self.block_size, self.block_size))  # A_1..A_N
        self.film = FiLM(task_dim, self.block_size * self.block_size)

    def task_matrices(self, table: torch.Tensor, length: int) -> torch.Tensor:
        """`M(z_t)` of every task, cropped to `length`: `(tasks, length, length)`."""
        full = self._full_matrices(table)[:, 0]  # (tasks, N*b, N*b)
        return full if length == full.shape[-1] else full[:, :length, :length]

    def _full_matrices(self, table: torch.Tensor, flat: bool = False) -> torch.Tensor:
        """`M(z_t)` of every task at the full size `N*b`: `(tasks, 1, N*b, N*b)` (the head axis of the attention mask
        made by the reshape that builds the matrices, rather than by one more operation on every row's); `flat`: the
        same values flattened, `(tasks * N*b * N*b,)`."""
        b, n = self.block_size, self.num_blocks
        gamma, beta = self.film(table)  # (tasks, b*b)
        blocks = self.blocks * gamma.view(-1, 1, b, b) + beta.view(-1, 1, b, b)  # (tasks, n, b, b), broadcast
        # direct sum of the blocks: block n on the diagonal of a (n, n) grid of (b, b) blocks, zeros elsewhere
        full = torch.diag_embed(blocks.permute(0, 2, 3, 1), dim1=1, dim2=3)  # (tasks, n, b, n, b)
        return full.reshape(-1) if flat else full.reshape(-1, 1, n * b, n * b)

    @property
    def full_size(self) -> int:
        """`N * b`, the side of the uncropped `M(z)` (at least `max_length`)."""
        return self.num_blocks * self.block_size

    def forward(
        self, cond: Conditioning, key_mask: torch.Tensor | None, length: int, dtype: torch.dtype,
        padded_keys: torch.Tensor | None = None, positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The additive attention mask of the batch: `M(z)` of each row's task, with padded keys at the dtype's
        minimum. `(batch, 1, length, length)`. `padded_keys`: `padded_keys(key_mask)`, when the caller made it once
        for every layer; `positions`: `bias_positions(cond.task_ids, length, self.full_size)`, likewise."""
        if length > self.max_length:
            raise ValueError(
                f"Conditional attention covers sequences of at most `conditional_attention_max_length` = "
                f"{self.max_length} tokens, got {length}; raise it in the config or truncate the inputs."
            )
        # each row's task matrix cropped to `length` by one gather of positions in the flattened matrices (not a
        # slice: a view whose contiguity depends on whether `length` equals the full size, which torch.export would
        # turn into a guard on the sequence length; not an advanced index: its backward accumulates with a sort on a
        # GPU); the positions depend on the rows' tasks and the length only, so the caller makes them once for every
        # layer
        bias = cond.biases.get(self) if cond.biases is not None else None  # made with the other layers'
        if bias is None or bias.shape[-1] != length:
            if positions is None:
                positions = bias_positions(cond.task_ids, length, self.full_size)
            full = self._full_matrices(cond.table, flat=True)  # (tasks * N*b * N*b,)
            bias = full.index_select(0, positions).view(-1, 1, length, length)  # (batch, 1, L, L)
        bias = bias.to(dtype)
        if key_mask is not None:
            bias = bias.masked_fill(padded_keys if padded_keys is not None else padded_key_mask(key_mask),
                                    torch.finfo(dtype).min)
        return bias


def many_biases(biases, table: torch.Tensor, task_ids: torch.LongTensor, length: int) -> dict:
    """`ConditionalAttentionBias.forward`'s `M(z)` of each row cropped to `length` (before the cast and the key
    mask), `(batch, 1, length, length)`, for many biases of one shape (a model's layers') made together: their FiLMs
    in one product of the table, their blocks modulated, set on the diagonal and gathered as one stack, a handful of
    operations for every layer instead of a handful per layer."""
    first = biases[0]
    b, layers = first.block_size, len(biases)
    weight = torch.cat([bias.film.weight for bias in biases])  # (layers * 2 b*b, task_dim)
    films = F.linear(table, weight, torch.cat([bias.film.bias for bias in biases]))  # (tasks, layers * 2 b*b)
    films = films.view(-1, layers, 2, b, b).transpose(0, 1)  # (layers, tasks, gamma / beta, b, b)
    gamma, beta = 1.0 + films[:, :, :1], films[:, :, 1:]  # (layers, tasks, 1, b, b): broadcast over the n blocks
    blocks = torch.stack([bias.blocks for bias in biases]).unsqueeze(1) * gamma + beta  # (layers, tasks, n, b, b)
    full = torch.diag_embed(blocks.permute(0, 1, 3, 4, 2), dim1=2, dim2=4)  # (layers, tasks, n, b, n, b)
    positions = bias_positions(task_ids, length, first.full_size)  # the crops in one task-major flat matrix
    crops = full.reshape(layers, -1).index_select(1, positions).view(layers, -1, 1, length, length)
    return dict(zip(biases, crops.unbind()))


def bias_positions(task_ids: torch.LongTensor, length: int, full_size: int) -> torch.LongTensor:
    """Where each row's `(length, length)` crop of its task's `M(z)` lies in the flattened `(tasks, 1, full_size,
    full_size)` matrices of `ConditionalAttentionBias._full_matrices`: `(batch * length * length,)`, row-major."""
    keep = torch.arange(length, device=task_ids.device)
    within = (keep * full_size).unsqueeze(1) + keep  # (L, L): row i, column j of a task's matrix
    return (task_ids * (full_size * full_size)).view(-1, 1, 1).add(within).view(-1)


def padded_key_mask(key_mask: torch.Tensor) -> torch.Tensor:
    """`(batch, seq)` 0/1 padding mask -> `(batch, 1, 1, seq)` bool, True where a key is padding."""
    return ~key_mask.bool().reshape(key_mask.shape[0], 1, 1, key_mask.shape[-1])  # one view, not two unsqueezes


class ConditionalBottleneck(nn.Module):
    """The task-conditioned two-layer feed-forward bottleneck (section 2.1.4): `up^(z)(act(down^(z)(x)))`, whose
    `down`/`up` weights are transformed like eq. 2 (`W^(z) = W diag(gamma(z)) + 1 beta(z)^T`).

    `up` starts at zero, so a fresh bottleneck adds nothing to the residual stream it is placed on.
    """

    def __init__(self, hidden_size: int, bottleneck_size: int, task_dim: int, activation: str = "gelu"):
        super().__init__()
        self.down = nn.Linear(hidden_size, bottleneck_size)
        self.up = BottleneckUp(bottleneck_size, hidden_size)
        self.down_film = FiLM(task_dim, bottleneck_size)
        self.up_film = FiLM(task_dim, hidden_size)
        self.activation = activation

    def forward(self, hidden: torch.Tensor, cond: Conditioning) -> torch.Tensor:
        x = _transformed_product(hidden, F.linear(hidden, self.down.weight), self.down_film, cond) + self.down.bias
        x = F.gelu(x) if self.activation == "gelu" else F.relu(x)
        return _transformed_product(x, F.linear(x, self.up.weight), self.up_film, cond) + self.up.bias


class BottleneckUp(nn.Linear):
    """The bottleneck's up-projection; its own class so the model's `_init_weights` can zero it."""
