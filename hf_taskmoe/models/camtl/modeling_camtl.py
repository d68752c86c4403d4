"""CA-MTL (Pilault et al. 2021) on any declared encoder, by conditioning the dense model's own modules on a learned
task embedding: `CAMTLForMultiTask` (`CAMTLModel`, its BERT variant, is in `bert.py`).

The dense model (`AutoModel.from_config(config.dense_config)`) runs its own forward -- its attention kernels, masks,
rotary positions, local/global layers. The surgery (`_wrap_backbone`) touches only the modules its `Backbone`
declaration names:

- conditional layer norm: each declared LayerNorm of a conditional layer is replaced in place by a `TaskLayerNorm`
  (the dense norm's `weight` / `bias` under their own names, plus a FiLM of the task embedding, eq. 3);
- conditional attention: a forward pre-hook on the declared self-attention module adds the task's block-diagonal
  `M(z)` to the attention mask it receives (a float additive mask, a boolean keep-mask made additive, or None: the
  bias alone), so padding and ModernBERT's sliding windows still apply (section 2.1.1);
- conditional alignment (eq. 2): a forward pre-hook on the first layer aligns its input, i.e. the embeddings'
  output after whatever the architecture does between them (ELECTRA's projection to the hidden size);
- conditional bottleneck (section 2.1.4): BASE runs in parallel with the FFN of the top layer(s), reads the FFN's
  input and is added to the FFN's output after the FFN's dropout (the bottleneck itself has none, as in the authors'
  code), so the layer's norm sees `dropout(FFN(a)) + a + CFF(a)`; LARGE is a skip connection alongside every layer,
  `s_j = CFF_j(h_j + s_{j-1})`, added to the last layer's output.

Every conditional module starts as its unconditioned counterpart (`hf_taskmoe.layers.conditional`), so with
`conditional_attention_init_std=0` a model built by `from_dense` computes exactly the dense model. The hooks are
bound methods of the conditional modules, so `copy.deepcopy` of the model keeps each hook on its own copy.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import initialization as init

from ...backbones import Backbone, TaskContext, layer_hidden_input, replace_module
from ...contract import ParameterRoles
from ...layers.conditional import (
    BottleneckUp,
    ConditionalAlignment,
    ConditionalAttentionBias,
    ConditionalBottleneck,
    Conditioning,
    FiLM,
    bias_positions,
    film_layer_norm,
    film_per_row,
)
from ...modeling_utils import MultiTaskPreTrainedModel, grow_embedding
from ..encoder import TaskEncoderMixin
from .configuration_camtl import CAMTLBackboneConfig, check_attention_implementation

try:
    from torch.distributed.tensor import DTensor  # FSDP2's sharded parameters
except ImportError:  # a torch built without torch.distributed: nothing is sharded
    DTensor = ()

#: CA-MTL's parameter roles: the task embeddings, the conditional modules (FiLMs, attention bias, alignment,
#: bottlenecks, the skip's) and the heads are task-specific and new on upcycling; the conditional modules run for every
#: row's task embedding, so only heads may sit idle
CAMTL_PARAMETER_ROLES = ParameterRoles(
    roles={
        "task_embedding": r"(^|\.)task_embeddings\.",
        "conditional": r"(\.film\.|\.attention_bias\.|(^|\.)alignment\.|\.bottleneck\.|(^|\.)skip\.)",
    },
    task_specific=("task_embedding", "conditional"),
    new=("task_embedding", "conditional"),
)

#: name parts of the conditional modules inside a layer (they stay trainable in a frozen layer)
_CONDITIONAL_PARTS = (".film.", ".attention_bias.", ".bottleneck.")


class _TaskConditioned:
    """A module the task model put inside the dense model: it reads the batch's conditioning (the task-embedding table,
    the task ids and each row's embedding, gathered once per forward before any layer runs) from the model's
    `TaskContext` (`context.flags["conditioning"]`)."""

    task_conditioned = True  # initialised by the task model, not by the dense model's `_init_weights`
    context: TaskContext

    def conditioning(self) -> Conditioning:
        self.context.require_task_ids()  # a clear error when run outside the model's forward
        return self.context.flags["conditioning"]


class TaskLayerNorm(_TaskConditioned, nn.LayerNorm):
    """Conditional Layer Norm (eq. 3) in the place of a dense LayerNorm: `norm(a) * (gamma' * gamma(z)) + beta' +
    beta(z)`. `weight` / `bias` are the dense norm's `gamma'` / `beta'` under their own names (a norm without a bias,
    as ModernBERT's, keeps none), so upcycling copies them one to one; the FiLM starts at zero, so the module starts
    as the dense LayerNorm."""

    def __init__(self, dense: nn.LayerNorm, task_dim: int, context: TaskContext):
        weight = dense.weight
        super().__init__(dense.normalized_shape, eps=dense.eps, bias=dense.bias is not None, device=weight.device,
                         dtype=weight.dtype)
        with torch.no_grad():
            self.weight.copy_(weight)
            if self.bias is not None:
                self.bias.copy_(dense.bias)
        # made where the dense norm is (not moved there: `.to` swaps parameters, which a FakeTensorMode refuses)
        self.film = FiLM(task_dim, self.normalized_shape[-1], device=weight.device, dtype=weight.dtype)
        self.context = context

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return film_layer_norm(self, hidden, *film_per_row(self.film, self.conditioning()))


class TaskAttentionBias(_TaskConditioned, ConditionalAttentionBias):
    """The block-diagonal `M(z)` of a layer; `add_to_mask` is a forward pre-hook (with kwargs) on the layer's
    self-attention module that adds it to the attention mask the module receives."""

    def __init__(self, max_length: int, num_blocks: int, task_dim: int, context: TaskContext, model_type: str):
        super().__init__(max_length, num_blocks, task_dim)
        self.context = context
        self.model_type = model_type

    def add_to_mask(self, module: nn.Module, args: tuple, kwargs: dict):
        cond = self.conditioning()
        flags = self.context.flags
        config = getattr(module, "config", None)
        if config is None or config is not flags.get("camtl_checked_config"):  # the model's forward checked its own
            check_attention_implementation(getattr(config, "_attn_implementation", None), self.model_type)
        hidden = layer_hidden_input(args, kwargs)  # (batch, seq, hidden)
        positional = "attention_mask" not in kwargs and len(args) > 1
        mask = args[1] if positional else kwargs.get("attention_mask")
        if mask is not None and mask.is_floating_point():
            dtype = mask.dtype
        else:
            dtype = hidden.dtype
        length = hidden.shape[1]
        # where each row's crop lies in the task matrices: the same for every layer (one config, one sequence length in
        # a forward), made once a forward. The length is not in the key: exported, it is a symbol, which cannot hash
        key = ("camtl_bias_positions", self.full_size)
        positions = flags.get(key)
        if positions is None and (cond.biases is None or self not in cond.biases):  # not made with the others'
            positions = flags[key] = bias_positions(cond.task_ids, length, self.full_size)
        bias = self(cond, None, length, dtype, positions=positions)  # (batch, 1, seq, seq)
        lowest = torch.finfo(dtype).min
        if mask is None:  # nothing padded (sdpa / eager leave the mask out): the bias alone
            combined = bias
        elif mask.dtype == torch.bool:  # sdpa's keep-mask (True = attend): masked keys at the dtype's minimum
            combined = torch.where(mask, bias, lowest)
        else:  # an additive float mask (eager): padding / window at the minimum stays there
            combined = (mask + bias).clamp(min=lowest)
        if positional:
            return (args[0], combined, *args[2:]), kwargs
        return args, {**kwargs, "attention_mask": combined}


class TaskBottleneck(_TaskConditioned, ConditionalBottleneck):
    """CA-MTL BASE's conditional bottleneck beside a layer's FFN: it reads the FFN's input and its output is added to
    the FFN's output after the FFN's dropout. For a whole FFN module (DistilBERT, whose module ends with its dropout;
    ModernBERT) one forward hook does it (`beside`); for a split FFN (BERT and descendants: `intermediate`, then
    `output.dense`, dropout and the norm of the residual sum) a pre-hook on the FFN module keeps its input
    (`keep_input`) and a pre-hook on the norm after the FFN adds the bottleneck of that input to what the norm reads
    (`add_to_norm_input`): `norm(dropout(FFN(a)) + a + CFF(a))`; in a pre-norm split FFN (XLM-R-XL, no norm after
    it) a forward hook on the output projection adds it to the FFN's output (`add_to_output`), before its dropout."""

    def __init__(self, hidden_size: int, bottleneck_size: int, task_dim: int, context: TaskContext):
        super().__init__(hidden_size, bottleneck_size, task_dim)
        self.context = context
        self._ffn_input = None

    def beside(self, module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        return output + self(args[0], self.conditioning())

    def keep_input(self, module: nn.Module, args: tuple) -> None:
        self._ffn_input = args[0]  # (batch, seq, hidden): the FFN's input, read by the norm's pre-hook

    def add_to_norm_input(self, module: nn.Module, args: tuple) -> tuple:
        ffn_input, self._ffn_input = self._ffn_input, None
        return (args[0] + self(ffn_input, self.conditioning()), *args[1:])

    def add_to_output(self, module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        ffn_input, self._ffn_input = self._ffn_input, None
        return output + self(ffn_input, self.conditioning())


class TaskSkipBottleneck(ConditionalBottleneck):
    """One step of CA-MTL LARGE's skip connection, a forward hook on layer `index`: `s_j = CFF_j(h_j + s_{j-1})`;
    the last layer's output becomes `h_L + s_L`. The running `s` lives in the forward's `context.flags` (emptied
    with the context after the forward)."""

    def __init__(self, hidden_size: int, bottleneck_size: int, task_dim: int, context: TaskContext, index: int,
                 last: bool):
        super().__init__(hidden_size, bottleneck_size, task_dim)
        self.context = context
        self.index = index
        self.last = last

    def after_layer(self, module: nn.Module, args: tuple, output):
        hidden = output[0] if isinstance(output, tuple) else output  # (batch, seq, hidden)
        flags = self.context.flags
        cond = self.context.flags["conditioning"]
        previous = flags.get("camtl_skip") if self.index > 0 else None
        skip = self(hidden if previous is None else hidden + previous, cond)
        # a new dict, not an update: activation checkpointing snapshots `flags` as a layer starts and restores it
        # when the layer is recomputed, so each layer must find s_{j-1} there, not the last layer's s
        self.context.flags = {**flags, "camtl_skip": skip}
        if not self.last:
            return None
        hidden = hidden + skip
        return (hidden, *output[1:]) if isinstance(output, tuple) else hidden


class TaskAlignment(ConditionalAlignment):
    """Conditional alignment (eq. 2) of what the first layer reads: a forward pre-hook (with kwargs) on layer 0."""

    def __init__(self, hidden_size: int, task_dim: int, context: TaskContext):
        super().__init__(hidden_size, task_dim)
        self.context = context

    def align_input(self, module: nn.Module, args: tuple, kwargs: dict):
        cond = self.context.flags["conditioning"]
        if "hidden_states" in kwargs:
            return args, {**kwargs, "hidden_states": self(kwargs["hidden_states"], cond)}
        return (self(args[0], cond), *args[1:]), kwargs


class CAMTLForMultiTask(TaskEncoderMixin, MultiTaskPreTrainedModel):
    """CA-MTL (conditional attention, alignment, layer norm and bottleneck; frozen bottom half) on a dense encoder of
    any declared architecture, with one head per task. Build one with `CAMTLForMultiTask.from_dense(checkpoint,
    tasks)`; it loads with `AutoModel` after `import hf_taskmoe`. Train it with `MultiTaskTrainer(...,
    args=MultiTaskTrainingArguments(task_sampling="uncertainty"))` for MT-Uncertainty sampling.

    DeBERTa-v2/v3 takes every module but conditional attention (`conditional_attention=False`); conditional attention
    needs the `"eager"` or `"sdpa"` attention implementation (flash attention takes no additive mask).

    Example:

    ```python
    >>> from hf_taskmoe import CAMTLForMultiTask, TaskSpec
    >>> tasks = [TaskSpec(name="sst2", num_labels=2), TaskSpec(name="stsb", problem_type="regression")]
    >>> model = CAMTLForMultiTask.from_dense("path/to/a-roberta", tasks=tasks)
    ```
    """

    config_class = CAMTLBackboneConfig
    _keys_to_ignore_at_inference = ["task_losses", "task_logits", "task_ids", "hidden_states", "attentions"]
    parameter_roles = CAMTL_PARAMETER_ROLES

    def __init__(self, config: CAMTLBackboneConfig):
        super().__init__(config)
        self.task_embeddings = nn.Embedding(config.num_tasks, config.task_dim) if config.uses_task_embedding else None
        self.alignment = None
        self.skip = None
        self._build_backbone(config)
        self.post_init()
        self.apply_freezing()

    # ------------------------------------------------------------------ surgery
    def _wrap_backbone(self, config: CAMTLBackboneConfig, backbone: Backbone, layers: nn.ModuleList) -> None:
        context, task_dim, hidden = self.task_context, config.task_dim, config.hidden_size
        size = config.bottleneck_size or hidden // 3
        conditional = set(config.conditional_layer_indices)
        #: whether some layer adds `M(z)` to its attention (the structure built here; read by every forward)
        self._uses_conditional_attention = config.uses_conditional_attention
        if config.uses_conditional_attention:
            check_attention_implementation(self.backbone.config._attn_implementation, backbone.model_type)
        for index, layer in enumerate(layers):
            if index in conditional and config.conditional_layer_norm:
                for path in backbone.norms:
                    norm = layer.get_submodule(path)
                    if isinstance(norm, nn.LayerNorm):  # ModernBERT's layer 0 has an Identity: nothing to condition
                        replace_module(layer, path, TaskLayerNorm(norm, task_dim, context))
            if index in conditional and config.conditional_attention:
                bias = TaskAttentionBias(config.conditional_attention_max_length, config.attention_blocks, task_dim,
                                         context, backbone.model_type)
                _attach(layer, "attention_bias", bias)
                layer.get_submodule(backbone.attention).register_forward_pre_hook(bias.add_to_mask, with_kwargs=True)
            if config.conditional_bottleneck == "base" and index in config.bottleneck_layer_indices:
                bottleneck = _attach(layer, "bottleneck", TaskBottleneck(hidden, size, task_dim, context))
                ffn = layer.get_submodule(backbone.ffn.module)
                if backbone.ffn.split:
                    ffn.register_forward_pre_hook(bottleneck.keep_input)
                    if backbone.post_norm and backbone.norms:  # BERT-like: its last declared norm follows the FFN
                        layer.get_submodule(backbone.norms[-1]).register_forward_pre_hook(bottleneck.add_to_norm_input)
                    else:  # pre-norm (XLM-R-XL): the output projection's output is the FFN's, before the residual
                        layer.get_submodule(backbone.ffn.w_out).register_forward_hook(bottleneck.add_to_output)
                else:
                    ffn.register_forward_hook(bottleneck.beside)
        if config.conditional_alignment:
            self.alignment = TaskAlignment(hidden, task_dim, context)
            layers[0].register_forward_pre_hook(self.alignment.align_input, with_kwargs=True)
        if config.conditional_bottleneck == "large":
            last = len(layers) - 1
            self.skip = nn.ModuleList(
                [TaskSkipBottleneck(hidden, size, task_dim, context, i, i == last) for i in range(len(layers))]
            )
            for step, layer in zip(self.skip, layers):
                layer.register_forward_hook(step.after_layer)

    def _run_encoder(self, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, task_ids,
                     output_attentions=None, output_hidden_states=None, *family_flags, **kwargs):
        # each row's task embedding gathered once per forward, outside any (checkpointed) layer, for every module's FiLM
        table = self.task_embeddings.weight if self.task_embeddings is not None else None
        length = (input_ids if input_ids is not None else inputs_embeds).shape[1]
        cond = Conditioning.gathered(table, task_ids, *self._made_together(), length) if table is not None else None
        return super()._run_encoder(input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds, task_ids,
                                    output_attentions, output_hidden_states, cond, *family_flags, **kwargs)

    def _made_together(self) -> tuple[tuple[FiLM, ...], tuple[TaskAttentionBias, ...]]:
        """The FiLMs applied to each row's task embedding (all but the attention biases'), made in one product once
        per forward (`many_films`), and the layers' attention biases, made together (`many_biases`, when they share a
        shape); none while a sharding engine holds the weights (FSDP2's DTensors, DeepSpeed ZeRO-3's partitions),
        which it gathers only inside each layer's forward."""
        made = self.__dict__.get("_modules_made_together")
        if made is None:
            biases = tuple(module for module in self.modules() if isinstance(module, TaskAttentionBias))
            of_biases = {id(bias.film) for bias in biases}
            films = tuple(m for m in self.modules() if isinstance(m, FiLM) and id(m) not in of_biases)
            if len({(bias.num_blocks, bias.block_size, bias.max_length) for bias in biases}) > 1:
                biases = ()  # each computes its own
            made = self._modules_made_together = (films, biases)
        films, biases = made
        # the weights as they are now (a sharding engine swaps its own parameters in after the model was built)
        weights = [w for film in films for w in (film.weight, film.bias)]
        weights += [w for bias in biases for w in (bias.blocks, bias.film.weight, bias.film.bias)]
        if any(isinstance(w, DTensor) or hasattr(w, "ds_id") for w in weights):
            return (), ()
        return made

    def _context_flags(self, conditioning: Conditioning | None = None, *family_flags) -> dict:
        flags = {} if conditioning is None else {"conditioning": conditioning}
        if self._uses_conditional_attention:  # before any layer runs (the hooks check a module's other config)
            config = self.backbone.config  # the dense model's (its model type the backbone declaration's)
            check_attention_implementation(config._attn_implementation, config.model_type)
            flags["camtl_checked_config"] = config
        return flags

    # ------------------------------------------------------------------ initialisation, freezing
    @torch.no_grad()
    def _init_weights(self, module):
        super()._init_weights(module)
        config = self.config
        if isinstance(module, (FiLM, BottleneckUp)):
            init.zeros_(module.weight)  # gamma = 1, beta = 0; the bottleneck adds 0: every module starts neutral
            init.zeros_(module.bias)
        elif isinstance(module, ConditionalAttentionBias):
            std = config.conditional_attention_init_std
            init.normal_(module.blocks, mean=0.0, std=config.initializer_range if std is None else std)
        elif isinstance(module, ConditionalAlignment):
            init.copy_(module.weight, torch.eye(module.weight.shape[0]))
        elif isinstance(module, ConditionalBottleneck):
            init.normal_(module.down.weight, mean=0.0, std=config.initializer_range)
            init.zeros_(module.down.bias)
        elif module is getattr(self, "task_embeddings", None):
            init.normal_(module.weight, mean=0.0, std=config.initializer_range)

    def apply_freezing(self) -> None:
        """Freeze the dense embeddings (`freeze_embeddings`) and the dense weights of the bottom `num_frozen_layers`
        layers (appendix A.8); their conditional modules, if any, stay trainable."""
        config, backbone = self.config, self.config.backbone
        if config.freeze_embeddings:
            self.backbone.get_submodule(backbone.embeddings).requires_grad_(False)
        layers = backbone.layer_list(self.backbone)
        for index in range(config.frozen_layers):
            for name, param in layers[index].named_parameters():
                if not any(part in f".{name}" for part in _CONDITIONAL_PARTS):
                    param.requires_grad_(False)

    # ------------------------------------------------------------------ tasks
    def max_input_length(self) -> int | None:
        """Conditional attention covers `conditional_attention_max_length` tokens: longer inputs are refused."""
        limit = self.config.max_position_embeddings
        if self._uses_conditional_attention:
            length = self.config.conditional_attention_max_length
            limit = length if limit is None else min(limit, length)
        return limit

    def _input_limit_name(self) -> str:
        c = self.config
        limit = c.max_position_embeddings
        short = c.uses_conditional_attention and (limit is None or c.conditional_attention_max_length < limit)
        return "conditional_attention_max_length" if short else "max_position_embeddings"

    def _grow_for_task(self, new_id: int, source: int | None) -> None:
        """One more row in the task-embedding table (appendix A.4); the conditional modules are shared."""
        if self.task_embeddings is not None:
            self.task_embeddings = grow_embedding(self.task_embeddings, new_id, source, self.config.initializer_range)

    @classmethod
    def from_dense(cls, dense, tasks, output_loading_info: bool = False, strict: bool = True,
                   hub_kwargs: dict | None = None, **config_kwargs):
        """Keep a dense encoder's weights (its LayerNorms become the CLNs' `gamma'`, `beta'` under their own names);
        add task embeddings, conditional modules and heads; freeze the bottom half. `**config_kwargs` are fields of
        `CAMTLBackboneConfig`; `conditional_attention_init_std=0` makes the new model compute the dense one."""
        # the constructor froze the bottom layers; upcycling copies weights in place and keeps that
        return super().from_dense(dense, tasks, output_loading_info=output_loading_info, strict=strict,
                                  hub_kwargs=hub_kwargs, **config_kwargs)


def _attach(layer: nn.Module, name: str, module: nn.Module) -> nn.Module:
    """Add a conditional module to a dense layer under `name` (a new attribute: the dense weights keep their names)."""
    if hasattr(layer, name):
        raise ValueError(f"{type(layer).__name__} already has an attribute {name!r}; cannot attach CA-MTL's {name}.")
    layer.add_module(name, module)
    return module
