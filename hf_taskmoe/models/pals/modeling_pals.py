"""PALsForMultiTask: Projected Attention Layers (PALs paper, section 3.2, eq. 6-7) on any declared encoder, beside
the dense model's own layers.

The dense model (`AutoModel.from_config(config.dense_config)`) keeps every module and every weight name. Each PAL
layer gets a parameterless `PALSite` (visible in `print(model)` as the layer's `task_pal`) that hooks two of the
layer's own modules, found through the architecture's `Backbone` declaration:

- *what the PAL reads*: a forward pre-hook on the layer's self-attention (`Backbone.attention`) keeps the hidden
  states it is called with in the model's `TaskContext`. In a post-norm layer (BERT, RoBERTa, XLM-R, ELECTRA,
  DeBERTa-v2, DistilBERT) that is the layer's input `x` of eq. 6; in a pre-norm layer (ModernBERT) it is `LN(x)`,
  the normalised input the layer's own attention reads (the raw residual stream grows with depth; a PAL's softmax
  would see its scale).
- *where its output joins* (`PALsConfig.pal_site`): `"ffn"` (default, eq. 7): in a post-norm layer a forward pre-hook
  on its last layer norm (`Backbone.norms[-1]`, BERT's `output.LayerNorm`, DistilBERT's `output_layer_norm`) adds
  `g(PAL(x))` to what it normalises, `LN_2(MHN(x) + FFN(MHN(x)) + g(PAL(x)))` exactly; in a pre-norm layer a forward
  hook on the FFN (`Backbone.ffn.module`) adds it to the FFN's output, joining the residual stream with it.
  `"attention"`: a forward hook on the attention's output projection (`Backbone.attention_output`) adds it there.

The PALs themselves (`E_t`, `D_t` shared by the layers, one attention per layer and group) are one
`ProjectedAttentionLayers` at the model level (`pals.`). With `D_t = 0` (the default) every PAL adds `GELU(0) = 0`:
the model `from_dense` builds computes exactly the dense model.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import initialization as init

from ...backbones import Backbone, TaskContext, layer_hidden_input
from ...contract import ParameterRoles
from ...layers.pals import PALAttention, PALDecoder, ProjectedAttentionLayers, pal_key_mask
from ...modeling_utils import MultiTaskPreTrainedModel
from ..encoder import TaskEncoderMixin
from .configuration_pals import PALsConfig


class BackbonePALs(ProjectedAttentionLayers):
    """Every PAL of a `PALsForMultiTask` (`ProjectedAttentionLayers`), plus each task's PAL group: on the device
    (`task_to_group`, `(num_tasks,)`, for a forward that reads nothing back) and on the host (`group_of_task`, to
    gather the rows of the groups present from the batch's split by task, which the heads already made)."""

    def __init__(self, config: PALsConfig):
        super().__init__(
            config.hidden_size, config.pal_size, config.pal_num_heads, max(config.task_group_ids) + 1,
            config.pal_layer_indices, config.pal_attention_dropout_rate,
        )
        self.group_of_task = list(config.task_group_ids)
        self.dispatch = config.pal_dispatch
        self.register_buffer("task_to_group", torch.tensor(self.group_of_task, dtype=torch.long), persistent=False)

    def set_task_groups(self, group_ids: list[int]) -> None:
        self.group_of_task = list(group_ids)
        self.task_to_group = torch.tensor(group_ids, dtype=torch.long, device=self.task_to_group.device)

    def rows(self, context: TaskContext):
        """Each row's group, worked out once per forward (kept in the context's flags for the next layers): with the
        batch's rows per task (`task_rows`, an eager forward) the groups present with their rows -- a batch of one
        group runs its PALs on the whole batch, and absent groups take no part (no gradient for AdamW to act on);
        without (a captured forward) each row's group id `(batch,)`, every row through its group's PALs at once,
        nothing read back from the device."""
        rows = context.flags.get("pal_rows")
        if rows is None:
            task_ids = context.require_task_ids()
            rows = self.plan(self.task_to_group.index_select(0, task_ids), context.flags.get("task_rows"),
                             self.group_of_task, self.dispatch)
            context.flags["pal_rows"] = rows
        return rows


class PALSite(nn.Module):
    """The PAL of one layer, hooked onto the dense layer's own modules (no parameters of its own: the PALs live in
    the model's `BackbonePALs`, referenced, not registered, so each weight has one name)."""

    def __init__(self, layer_idx: int, context: TaskContext, pals: BackbonePALs, joins: str):
        super().__init__()
        self.layer_idx = layer_idx
        self.context = context
        self._pals = (pals,)  # a tuple: not a submodule
        self.joins = joins

    def extra_repr(self) -> str:
        return f"layer={self.layer_idx}, joins={self.joins!r}"

    def read_input(self, module, args, kwargs):
        """Forward pre-hook on the layer's self-attention: keep what it reads, the PAL's `x`."""
        self.context.layer_input = layer_hidden_input(args, kwargs)

    def pal(self) -> torch.Tensor:
        """`GELU(PAL_{l,t}(x))` for each row's task `t`, `(batch, seq, hidden)`."""
        context = self.context
        x = context.layer_input  # (batch, seq, hidden)
        if x is None:
            raise RuntimeError(
                f"The PAL of layer {self.layer_idx} found no layer input: the layer's attention was not called before "
                "the module its output joins (a backbone declaration that does not match the architecture)."
            )
        if x.dim() != 3:
            raise ValueError(
                f"PALs need padded hidden states (batch, seq, hidden); layer {self.layer_idx} was called with shape "
                f"{tuple(x.shape)} (an unpadded attention implementation): use attn_implementation='sdpa' or 'eager'."
            )
        pals = self._pals[0]
        if "pal_key_mask" not in context.flags:
            # (batch, 1, 1, seq), 0 where a key is attended and -inf on padding, in the PALs' compute dtype: made once
            # for every layer (what `scaled_dot_product_attention` would make of the bool mask in each)
            context.flags["pal_key_mask"] = pal_key_mask(context.token_mask, context.token_mask, x.dtype)
        return pals(x, self.layer_idx, pals.rows(context), context.flags["pal_key_mask"])

    def add_to_input(self, module, args):
        """Forward pre-hook on a layer norm: `LN(sum + g(PAL(x)))` (eq. 7)."""
        return (args[0] + self.pal(), *args[1:])

    def add_to_output(self, module, args, output):
        """Forward hook on a projection or an FFN: its output `+ g(PAL(x))`."""
        return output + self.pal()


def attach_pal(layer: nn.Module, site: PALSite, backbone: Backbone, pal_site: str) -> None:
    """Hook `site` onto the dense layer's own modules (see the module docstring) and keep it as `layer.task_pal`."""
    if backbone.attention is None:
        raise ValueError(f"PALs need the self-attention of a {backbone.model_type} layer; its backbone declares none.")
    layer.get_submodule(backbone.attention).register_forward_pre_hook(site.read_input, with_kwargs=True)
    if pal_site == "attention":
        if backbone.attention_output is None:
            raise ValueError(
                f"`pal_site='attention'`: a {backbone.model_type} backbone declares no attention output projection; "
                "use pal_site='ffn'."
            )
        layer.get_submodule(backbone.attention_output).register_forward_hook(site.add_to_output)
    elif backbone.post_norm:
        if len(backbone.norms) < 2:
            raise ValueError(
                f"PALs join a post-norm {backbone.model_type} layer inside its second layer norm; its backbone "
                f"declares the norms {backbone.norms}."
            )
        layer.get_submodule(backbone.norms[-1]).register_forward_pre_hook(site.add_to_input)
    else:  # pre-norm: beside the FFN's output (a split FFN's: its output projection's), before the residual sum
        layer.get_submodule(backbone.ffn.w_out if backbone.ffn.split else backbone.ffn.module).register_forward_hook(
            site.add_to_output
        )
    layer.task_pal = site


class PALsForMultiTask(TaskEncoderMixin, MultiTaskPreTrainedModel):
    """BERT and PALs (Stickland & Murray 2019) on a dense encoder of any declared architecture, with one head per
    task. Build one with `PALsForMultiTask.from_dense(checkpoint, tasks, pal_size=204)`: with the default
    `pal_decoder_init="zeros"` it computes exactly what the dense model computes, and training grows the PALs from
    there. It loads with `AutoModel` after `import hf_taskmoe`. Where each architecture's PAL reads and joins:
    `hf_taskmoe.models.pals.modeling_pals` and `PALsConfig.pal_site`.

    Example:

    ```python
    >>> from hf_taskmoe import PALsForMultiTask, TaskSpec
    >>> tasks = [TaskSpec(name="sst", num_labels=5), TaskSpec(name="qqp", num_labels=2),
    ...          TaskSpec(name="sts", problem_type="regression")]
    >>> model = PALsForMultiTask.from_dense("path/to/a-roberta", tasks=tasks, pal_size=204,
    ...                                     pal_task_groups=[["qqp", "sts"]])
    ```
    """

    config_class = PALsConfig
    _keys_to_ignore_at_inference = ["task_losses", "task_logits", "task_ids", "hidden_states", "attentions"]
    # trained alone by the paper's best extension (section 3.4: task-specific training after joint training)
    # absent tasks' heads and PALs sit out a step
    parameter_roles = ParameterRoles(roles={"pal": r"^pals\."}, task_specific=("pal",), possibly_idle=("pal", "head"),
                                     new=("pal",))

    def __init__(self, config: PALsConfig):
        super().__init__(config)
        self.pals = BackbonePALs(config)  # before the surgery: the sites refer to it
        self._build_backbone(config)
        self.post_init()

    def _wrap_backbone(self, config: PALsConfig, backbone: Backbone, layers) -> None:
        for index in config.pal_layer_indices:
            attach_pal(layers[index], PALSite(index, self.task_context, self.pals, config.pal_site), backbone,
                       config.pal_site)
        self.backbone.register_forward_pre_hook(self._plan_pals)

    def _plan_pals(self, module, args) -> None:
        """Forward pre-hook on the dense model: each row's PAL group (`BackbonePALs.rows`) worked out before its
        first layer runs, for every layer. Under activation checkpointing that is outside every checkpointed layer:
        the rows with their gathered weights (the batched path) are made once and kept, not made inside the first
        layer and missing when that layer is run again in the backward (which `torch.utils.checkpoint` refuses)."""
        if self.task_context.task_ids is not None:  # the model's forward (not the dense model called on its own)
            self.pals.rows(self.task_context)

    @torch.no_grad()
    def _init_weights(self, module):
        super()._init_weights(module)
        std = self.config.initializer_range
        if isinstance(module, PALDecoder):
            if self.config.pal_decoder_init == "zeros":
                init.zeros_(module.weight)  # GELU(D_t(...)) = 0: the fresh model is the dense one
            else:
                init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, PALAttention):  # N(0, initializer_range) whatever the dense model's own init does
            init.normal_(module.qkv.weight, mean=0.0, std=std)
        elif isinstance(module, BackbonePALs):
            for encoder in module.encoders:
                init.normal_(encoder.weight, mean=0.0, std=std)
            init.copy_(module.task_to_group, torch.tensor(self.config.task_group_ids, dtype=torch.long))

    def _grow_for_task(self, new_id: int, source_task: int | None) -> None:
        """PALs of the new task's own (a new group): copies of task `source_task`'s group, or initialised like at
        construction (`D = 0` by default)."""
        pals, config = self.pals, self.config
        source = pals.group_of_task[source_task] if source_task is not None else None
        new_modules = [nn.Linear(config.hidden_size, config.pal_size, bias=False),
                       PALDecoder(config.pal_size, config.hidden_size)]
        pals.encoders.append(new_modules[0])
        pals.decoders.append(new_modules[1])
        for layer in pals.layers:
            attention = PALAttention(config.pal_size, config.pal_num_heads, config.pal_attention_dropout_rate)
            pals.attention[str(layer)].append(attention)
            new_modules.append(attention)
        group = pals.num_groups - 1
        dtype = pals.encoders[0].weight.dtype
        for module in new_modules:
            module.to(self.device, dtype).train(self.training)
            module.apply(self._init_weights)
        with torch.no_grad():
            if source is not None:
                for modules in (pals.encoders, pals.decoders):
                    modules[group].load_state_dict(modules[source].state_dict())
                for layer in pals.layers:
                    pals.attention[str(layer)][group].load_state_dict(pals.attention[str(layer)][source].state_dict())
        pals.set_task_groups(config.task_group_ids)

    @classmethod
    def from_dense(cls, dense, tasks, pal_size: int = 204, output_loading_info: bool = False, strict: bool = True,
                   hub_kwargs: dict | None = None, **config_kwargs):
        """Keep a dense encoder's every weight (any declared architecture); add PALs and heads. With
        `pal_decoder_init="zeros"` (the default) the new model computes exactly the dense model's hidden states.
        `pal_size` and `**config_kwargs` are fields of `PALsConfig` (`pal_num_heads`, `pal_layers`,
        `pal_task_groups`, `pal_site`, ...)."""
        return super().from_dense(
            dense, tasks, output_loading_info=output_loading_info, strict=strict, hub_kwargs=hub_kwargs,
            pal_size=pal_size, **config_kwargs,
        )
