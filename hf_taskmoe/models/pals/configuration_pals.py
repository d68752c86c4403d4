"""Configuration of `PALsForMultiTask`: Projected Attention Layers on any declared encoder."""

from __future__ import annotations

from ...utils import check_choice, check_float, check_int
from ..encoder import TaskEncoderConfig

__all__ = ["PAL_DECODER_INITS", "PAL_DISPATCHES", "PAL_SITES", "PALsConfig"]

#: where a PAL's output joins the layer (`PALsConfig.pal_site`)
PAL_SITES = ("ffn", "attention")
#: how the PAL decoders `D_t` start (`PALsConfig.pal_decoder_init`)
PAL_DECODER_INITS = ("zeros", "normal")
#: how an eager forward runs a batch mixing PAL groups (`PALsConfig.pal_dispatch`)
PAL_DISPATCHES = ("auto", "per_group", "batched")


class PALsConfig(TaskEncoderConfig):
    r"""
    Configuration of a dense encoder of any declared architecture (RoBERTa, XLM-R, ELECTRA, DistilBERT, DeBERTa-v2/v3,
    ModernBERT, BERT: `hf_taskmoe.backbones.backbone_names("encoder")`) with task-specific Projected Attention Layers
    (PALs paper, section 3.2) beside its layers, plus one head per task. The fields of `TaskEncoderConfig`
    (`dense_config`, `tasks`, `classifier_pooling`, ...) and the PAL fields:

    Args:
        pal_size (`int`, *optional*, defaults to 204): the projected dimension `s`.
        pal_num_heads (`int`, *optional*, defaults to 12): attention heads of each PAL; must divide `pal_size`.
        pal_layers (`list[int]`, *optional*): layers that carry PALs (default: every layer); `E_t` / `D_t` are shared
            by them.
        pal_task_groups (`list[list[str]]`, *optional*): groups of task names sharing one set of PALs (section 3.4);
            a task in no group has PALs of its own.
        pal_decoder_init (`str`, *optional*, defaults to `"zeros"`): `"zeros"` (`D_t = 0`: the model built by
            `from_dense` computes exactly the dense model) or `"normal"` (`N(0, initializer_range)`).
        pal_attention_dropout (`float`, *optional*): dropout on the PALs' attention probabilities; defaults to the
            dense model's attention dropout (`attention_probs_dropout_prob`, DistilBERT's and ModernBERT's
            `attention_dropout`). The paper places dropout on the layer's attention and FFN outputs and says nothing
            of the PAL's inside; 0 saves one random mask of `(batch, heads, seq, seq)` per PAL layer: on MiniLM the
            training step went from 1.39x to 1.25x dense (`benchmarks/pals_vs_dense.py`).
        pal_dispatch (`str`, *optional*, defaults to `"auto"`): how an eager forward runs a batch that mixes PAL
            groups. `"per_group"`: each group's PAL on its rows (one call per group and layer; the fastest on a CPU).
            `"batched"`: every row through its group's PAL at once, the groups' weights gathered per row (no shape
            that depends on the mix, fewer kernel launches: for a GPU and compiled steps; on 2 CPU cores a MiniLM
            step is about 8% slower). `"auto"`: `"per_group"` on a CPU, `"batched"` on an accelerator and under
            `torch.compile`. A captured forward (torch.export, ONNX) is always batched. The numbers are the same
            either way.
        pal_site (`str`, *optional*, defaults to `"ffn"`): where `GELU(PAL_{l,t}(x))` joins the layer.
            `"ffn"`: the paper's eq. 7, beside the feed-forward block -- in a post-norm layer (BERT, RoBERTa, XLM-R,
            ELECTRA, DeBERTa-v2, DistilBERT) it is added inside the second layer norm,
            `LN_2(MHN(x) + FFN(MHN(x)) + g(PAL(x)))`; in a pre-norm layer (ModernBERT) it is added to the FFN's
            output, so the layer computes `h + FFN(LN(h)) + g(PAL(x))` with `h = x + Attn(LN(x))`. `"attention"`:
            beside the attention's output projection (`Backbone.attention_output`), `LN_1(x + SA(x) + g(PAL(x)))`
            in a post-norm layer (not the paper's place; the FFN then reads the PAL's contribution), added to the
            attention branch in a pre-norm one; the PAL output passes through the dropout the architecture applies
            after that projection.
    """

    model_type = "taskmoe_pals"
    method_name = "PALs (PALsForMultiTask)"

    pal_size: int = 204
    pal_num_heads: int = 12
    pal_layers: list | None = None
    pal_task_groups: list | None = None
    pal_decoder_init: str = "zeros"
    pal_attention_dropout: float | None = None
    pal_site: str = "ffn"
    pal_dispatch: str = "auto"

    def _validate(self) -> None:
        super()._validate()
        check_int(self.pal_size, "pal_size", minimum=1)
        check_int(self.pal_num_heads, "pal_num_heads", minimum=1)
        if self.pal_size % self.pal_num_heads:
            raise ValueError(
                f"`pal_size` ({self.pal_size}) must be a multiple of `pal_num_heads` ({self.pal_num_heads})."
            )
        check_choice(self.pal_decoder_init, PAL_DECODER_INITS, "pal_decoder_init")
        check_choice(self.pal_site, PAL_SITES, "pal_site")
        check_choice(self.pal_dispatch, PAL_DISPATCHES, "pal_dispatch")
        if self.pal_attention_dropout is not None:
            check_float(self.pal_attention_dropout, "pal_attention_dropout", minimum=0.0, maximum=1.0)
        self.pal_layers = self._check_layer_list("pal_layers")
        if self.pal_task_groups is not None:
            self.pal_task_groups = self._check_groups(self.pal_task_groups)

    @property
    def pal_attention_dropout_rate(self) -> float:
        """`pal_attention_dropout`, or the dense model's attention dropout when unset (0 where it has none)."""
        if self.pal_attention_dropout is not None:
            return self.pal_attention_dropout
        for name in ("attention_probs_dropout_prob", "attention_dropout"):  # BERT-like; DistilBERT, ModernBERT
            rate = getattr(self.dense_config, name, None)
            if rate is not None:
                return float(rate)
        return 0.0

    def _check_groups(self, groups) -> list[list[str]]:
        if isinstance(groups, (str, bytes)) or not hasattr(groups, "__iter__"):
            raise ValueError(f"`pal_task_groups` must be a list of lists of task names, got {groups!r}.")
        names, seen, out = self.task_names, set(), []
        for group in groups:
            if isinstance(group, (str, bytes)) or not hasattr(group, "__iter__") or not list(group):
                raise ValueError(
                    f"`pal_task_groups`: each group must be a non-empty list of task names, got {group!r}."
                )
            for name in group:
                if name not in names:
                    raise ValueError(f"`pal_task_groups`: unknown task {name!r}; the tasks are {names}.")
                if name in seen:
                    raise ValueError(f"`pal_task_groups`: task {name!r} is in more than one group.")
                seen.add(name)
            out.append(list(group))
        return out

    # ------------------------------------------------------------------ views
    @property
    def pal_layer_indices(self) -> list[int]:
        return list(range(self.num_hidden_layers)) if self.pal_layers is None else list(self.pal_layers)

    @property
    def task_group_ids(self) -> list[int]:
        """PAL group of each task (groups numbered by the first task of each, in task order)."""
        group_of = {}
        for group in self.pal_task_groups or []:
            for name in group:
                group_of[name] = tuple(group)
        ids, numbering = [], {}
        for name in self.task_names:
            key = group_of.get(name, (name,))
            ids.append(numbering.setdefault(key, len(numbering)))
        return ids

    @property
    def pal_groups(self) -> list[list[str]]:
        """Task names of each PAL group, in group order."""
        groups: list[list[str]] = [[] for _ in range(max(self.task_group_ids) + 1)]
        for name, g in zip(self.task_names, self.task_group_ids):
            groups[g].append(name)
        return groups

    def pal_parameters_per_group(self) -> int:
        """`len(pal_layers) * 3 s^2 + 2 s d`: the paper's per-task count (12(3s^2) + 2sd for BERT-base)."""
        s, d = self.pal_size, self.hidden_size
        return len(self.pal_layer_indices) * 3 * s * s + 2 * s * d
