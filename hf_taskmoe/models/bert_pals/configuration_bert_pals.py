"""Configuration of `BertWithPALs` (BERT + Projected Attention Layers)."""

from __future__ import annotations

from ...utils import check_choice, check_float, check_int
from ..multitask_bert import MultiTaskBertConfig

PAL_DECODER_INITS = ("zeros", "normal")
PAL_DISPATCHES = ("auto", "per_group", "batched")


class BertPALsConfig(MultiTaskBertConfig):
    r"""
    Configuration of a BERT encoder with task-specific Projected Attention Layers (PALs paper, section 3.2)
    and one head per task. Every field of `BertConfig` and of `MultiTaskBertConfig` (`tasks`,
    `classifier_pooling`, `scale_loss_by_num_classes`) is accepted. The others:

    Args:
        pal_size (`int`, *optional*, defaults to 204):
            The projected dimension `s` (the paper uses 204, then 324, with BERT-base's d = 768).
        pal_num_heads (`int`, *optional*, defaults to 12):
            Attention heads of each PAL (the paper: 12); must divide `pal_size`.
        pal_layers (`list[int]`, *optional*):
            Layers that carry PALs; defaults to every layer (as in the paper). `E_t`/`D_t` are shared by them.
        pal_task_groups (`list[list[str]]`, *optional*):
            Groups of task names that share one set of PALs (encoder, decoder and attention), keeping their
            own heads: the paper's "additional parameter-sharing" between similar tasks (section 3.4). A task
            in no group has PALs of its own.
        pal_decoder_init (`str`, *optional*, defaults to `"zeros"`):
            `"zeros"`: `D_t = 0`, so `GELU(PAL(x)) = 0` and a model built from a dense BERT computes exactly
            the dense BERT until training moves `D_t` (the gradient reaches `D_t` at once, `E_t` and the PAL
            attention from the second step). `"normal"`: `N(0, initializer_range)` like the other weights.
        pal_attention_dropout (`float`, *optional*):
            Dropout on the attention probabilities inside each PAL; defaults to `attention_probs_dropout_prob`
            (as BERT's own attention). The paper places dropout on BERT's attention and FFN outputs and says
            nothing of the PAL's inside; 0 saves one random mask of `(batch, heads, seq, seq)` per PAL layer: on MiniLM
            the training step went from 1.39x to 1.25x dense (`benchmarks/pals_vs_dense.py`).
        pal_dispatch (`str`, *optional*, defaults to `"auto"`):
            How an eager forward runs a batch that mixes PAL groups. `"per_group"`: each group's PAL on its rows (one
            call per group and layer; the fastest on a CPU). `"batched"`: every row through its group's PAL at once,
            the groups' weights gathered per row (no shape that depends on the mix, fewer kernel launches: for a GPU
            and compiled steps; on 2 CPU cores a MiniLM step is about 8% slower). `"auto"`: `"per_group"` on a CPU,
            `"batched"` on an accelerator and under `torch.compile`. A captured forward (torch.export, ONNX) is always
            batched. The numbers are the same either way.
    """

    model_type = "taskmoe_bert_pals"

    pal_size: int = 204
    pal_num_heads: int = 12
    pal_layers: list | None = None
    pal_task_groups: list | None = None
    pal_decoder_init: str = "zeros"
    pal_attention_dropout: float | None = None
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
        check_choice(self.pal_dispatch, PAL_DISPATCHES, "pal_dispatch")
        if self.pal_attention_dropout is not None:
            check_float(self.pal_attention_dropout, "pal_attention_dropout", minimum=0.0, maximum=1.0)
        self.pal_layers = self._check_layer_list("pal_layers")
        if self.pal_task_groups is not None:
            self.pal_task_groups = self._check_groups(self.pal_task_groups)

    @property
    def pal_attention_dropout_rate(self) -> float:
        """`pal_attention_dropout`, or BERT's `attention_probs_dropout_prob` when unset."""
        return self.attention_probs_dropout_prob if self.pal_attention_dropout is None else self.pal_attention_dropout

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
