"""TaskMoEForMultiTask: MT-TaG on any declared encoder, by wrapping the dense model's own FFNs.

The dense model (`AutoModel.from_config(config.dense_config)`) keeps every module but the feed-forward block of each
MoE layer, which becomes a `BackboneTaskMoE`: `num_experts` copies of that very FFN behind a task-aware or shared
gate. A split FFN (BERT, RoBERTa, XLM-R, ELECTRA, DeBERTa-v2) becomes an `ExpertBank` (transformers' experts layout
and interface: `up_proj`, `down_proj` and their biases, `config.experts_implementation` picks the implementation)
whose stacked projections are copies of `intermediate.dense` and `output.dense` (the latter then an identity inside
`output`, which still adds the residual and normalises; one expert: an `ExpertFFN` in `experts.0`); a whole FFN
module (DistilBERT's `ffn`, ModernBERT's gated `mlp`) is copied whole into each expert, and its experts run MT-TaG's
loop over the sorted tokens.

With `config.expert_rank` (low-rank experts) nothing is copied: the dense FFN stays, one copy, in `experts.0` of the
`BackboneTaskMoE` (a split FFN's projections as an `ExpertFFN`, `output.dense` an identity as above; a whole FFN
module itself), its linears wrapped as `TokenLowRankExperts` holding each expert's LoRA delta (`lora_A`, `lora_B`,
`B = 0` at upcycling), and every dense weight frozen unless `config.train_base`.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from transformers import initialization as init
from transformers.utils import ModelOutput

from ...backbones import Backbone, TaskContext, replace_module
from ...compat import experts_class_elsewhere
from ...contract import ParameterRoles
from ...layers.low_rank import LowRankSpec, TokenLowRankExperts
from ...layers.moe import (
    AUTO,
    EXPERT_BANK_WEIGHTS,
    SORTED,
    SORTED_IMPLEMENTATIONS,
    ExpertBank,
    ExpertFFN,
    MoEOutput,
    SharedGate,
    TaskGate,
    TaskMoE,
)
from ...modeling_utils import MultiTaskModelOutput, MultiTaskPreTrainedModel, heads_to_output_fields
from ..encoder import TaskEncoderMixin, layer_rule
from .configuration_task_moe import TaskMoEConfig


@dataclass
class TaskMoEEncoderOutput(ModelOutput):
    """What the encoder of `TaskMoEForMultiTask` gives its heads (`_run_encoder`).

    Args:
        last_hidden_state (`torch.FloatTensor` of shape `(batch, seq, hidden)`): last layer's output.
        pooler_output (`torch.FloatTensor` of shape `(batch, hidden)`): the sequence representation the heads
            read (`config.classifier_pooling`).
        hidden_states, attentions: the dense model's, when asked.
        router_logits (`tuple(torch.FloatTensor)`, when `output_router_logits=True`): per MoE layer,
            `(batch, seq, num_experts)` fp32 gate logits.
        expert_indices (`tuple(torch.LongTensor)`, when `output_router_logits=True`): per MoE layer,
            `(batch, seq, top_k)` chosen experts.
        routing_counts (`torch.LongTensor` of shape `(num_moe_layers, num_tasks, num_experts)`, when
            `output_router_logits=True`): real (non-padding) tokens each expert received, per task and layer.
        aux_loss / z_loss (`torch.FloatTensor` of shape `()`): mean over MoE layers of the load-balancing /
            router z-loss, when the config's coefficient is set.
    """

    last_hidden_state: torch.FloatTensor | None = None
    pooler_output: torch.FloatTensor | None = None
    hidden_states: tuple[torch.FloatTensor, ...] | None = None
    attentions: tuple[torch.FloatTensor, ...] | None = None
    router_logits: tuple[torch.FloatTensor, ...] | None = None
    expert_indices: tuple[torch.LongTensor, ...] | None = None
    routing_counts: torch.LongTensor | None = None
    aux_loss: torch.FloatTensor | None = None
    z_loss: torch.FloatTensor | None = None


@dataclass
class TaskMoEOutput(MultiTaskModelOutput):
    """Output of `TaskMoEForMultiTask`: `MultiTaskModelOutput` plus the routing fields of `TaskMoEEncoderOutput`."""

    router_logits: tuple[torch.FloatTensor, ...] | None = None
    expert_indices: tuple[torch.LongTensor, ...] | None = None
    routing_counts: torch.LongTensor | None = None
    aux_loss: torch.FloatTensor | None = None
    z_loss: torch.FloatTensor | None = None


def moe_encoder_fields(moe_outputs: list[MoEOutput], routed: bool) -> dict:
    """The routing fields of `TaskMoEEncoderOutput` from each layer's `MoEOutput` (dense layers route nothing):
    router logits, chosen experts and per-task counts when `routed`; the mean aux and z losses when computed."""
    moe_layers = [moe for moe in moe_outputs if moe.router_logits is not None]
    aux = [moe.aux_loss for moe in moe_layers if moe.aux_loss is not None]
    z = [moe.z_loss for moe in moe_layers if moe.z_loss is not None]
    return dict(
        router_logits=tuple(moe.router_logits for moe in moe_layers) if routed else None,
        expert_indices=tuple(moe.expert_index for moe in moe_layers) if routed else None,
        routing_counts=torch.stack([moe.routing_counts for moe in moe_layers]) if routed and moe_layers else None,
        aux_loss=torch.stack(aux).mean() if aux else None,
        z_loss=torch.stack(z).mean() if z else None,
    )


#: MT-TaG's parameter roles with whole experts (a copy of the FFN per expert)
TASK_MOE_ROLES = ParameterRoles(
    roles={"expert": r"\.experts\.", "gating": r"\.router\."}, task_specific=("gating",), new=("gating",),
    also_new=(r"\.lora_[AB]$",),  # low-rank experts' deltas (`expert_rank`): new on upcycling
)
#: with low-rank experts (`expert_rank`): the deltas are the experts, the one dense FFN is shared
LOW_RANK_TASK_MOE_ROLES = ParameterRoles(
    roles={"expert": r"\.lora_[AB]$", "gating": r"\.router\."}, task_specific=("gating",), new=("gating", "expert"),
)


class _MoERoles:
    """`TASK_MOE_ROLES`, or `LOW_RANK_TASK_MOE_ROLES` on a model with `expert_rank` set (read on the class: the
    former)."""

    def __get__(self, obj, owner=None):
        config = getattr(obj, "config", None) if obj is not None else None
        return LOW_RANK_TASK_MOE_ROLES if getattr(config, "low_rank", False) else TASK_MOE_ROLES


class BackboneTaskMoE(TaskMoE):
    """A `TaskMoE` in the place of a dense model's FFN: called as the FFN was (hidden states in, hidden states out),
    it reads the batch's task ids from the model's `TaskContext` and reports its `MoEOutput` there."""

    task_conditioned = True  # initialised by the task model, not by the dense model's `_init_weights`

    def __init__(self, config, layer_idx: int, experts: ExpertBank | list[torch.nn.Module] | None,
                 context: TaskContext, low_rank_ffn: torch.nn.Module | None = None):
        super().__init__(config, layer_idx, experts, low_rank_ffn=low_rank_ffn, context=context)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        context = self.context
        out = super().forward(
            hidden_states, context.require_task_ids(), context.token_mask, context.flags.get("output_routing", False)
        )
        context.reports.append(out)
        return out.hidden_states

    def shared_tensor(self, key, make) -> torch.Tensor:
        """Made once per forward, by the first MoE layer that asks, and kept in the forward's context flags
        (`moe_shared`, emptied with the forward, restored with the flags when a checkpointed layer is recomputed)."""
        memo = self.context.flags.get("moe_shared")
        if memo is None:  # a context filled by other code than `TaskMoEForMultiTask`
            return make()
        value = memo.get(key)
        if value is None:
            value = memo[key] = make()
        return value


def ffn_experts(layer: torch.nn.Module, backbone: Backbone,
                config: TaskMoEConfig) -> ExpertBank | list[torch.nn.Module]:
    """`config.num_experts` copies of a layer's FFN; a split FFN's output projection becomes an identity in place,
    its experts an `ExpertBank` (one expert: an `ExpertFFN`)."""
    site, num_experts = backbone.ffn, config.num_experts
    if site.split:
        w_in, act, w_out = (layer.get_submodule(p) for p in (site.w_in, site.act, site.w_out))
        replace_module(layer, site.w_out, torch.nn.Identity())
        if num_experts == 1:
            return [ExpertFFN.copy_of(w_in, act, w_out)]
        return ExpertBank.copy_of(config, w_in, act, w_out, num_experts)
    ffn = layer.get_submodule(site.module)
    return [copy.deepcopy(ffn) for _ in range(num_experts)]


def low_rank_ffn(layer: torch.nn.Module, backbone: Backbone, config: TaskMoEConfig) -> torch.nn.Module:
    """A layer's dense FFN, not copied, with its targeted linears (`config.expert_targets`, names relative to the
    layer; default every linear of the FFN) wrapped as `TokenLowRankExperts`; a split FFN's output projection becomes
    an identity in place and its projections an `ExpertFFN` (the same modules)."""
    site = backbone.ffn
    spec = LowRankSpec(config.num_experts, config.expert_rank, config.lora_alpha, config.expert_dropout,
                       tuple(config.expert_targets) if config.expert_targets is not None else None)
    if site.split:
        w_in, act, w_out = (layer.get_submodule(p) for p in (site.w_in, site.act, site.w_out))
        replace_module(layer, site.w_out, torch.nn.Identity())
        ffn = ExpertFFN.__new__(ExpertFFN)
        torch.nn.Module.__init__(ffn)
        ffn.w_in, ffn.act, ffn.w_out = w_in, act, w_out
        linears = {site.w_in: (ffn, "w_in"), site.w_out: (ffn, "w_out")}
    else:
        ffn = layer.get_submodule(site.module)
        linears = {}
        for name, module in ffn.named_modules():
            if isinstance(module, torch.nn.Linear) and name:
                parent, _, child = name.rpartition(".")
                linears[f"{site.module}.{name}"] = (ffn.get_submodule(parent) if parent else ffn, child)
    chosen = [name for name in linears if spec.targeted(name)]
    unmatched = [t for t in spec.targets or () if not any(n == t or n.endswith(f".{t}") for n in linears)]
    if not chosen or unmatched:
        raise ValueError(
            f"`expert_targets` {unmatched or list(spec.targets)!r} match no linear of the FFN of this "
            f"{config.dense_config.model_type} layer; its FFN's linears are {sorted(linears)} (names relative to the "
            "layer, or suffixes of them), or leave it None for every one."
        )
    for name in chosen:
        owner, child = linears[name]
        setattr(owner, child, TokenLowRankExperts(getattr(owner, child), spec.num_experts, spec.rank, spec.alpha,
                                                  spec.dropout))
    return ffn


class TaskMoEForMultiTask(TaskEncoderMixin, MultiTaskPreTrainedModel):
    """MT-TaG (task-aware gates), MT-Switch (`gating="shared"`) or MT-Dense (`num_experts=1`) on a dense encoder of
    any declared architecture, with one head per task. Build one with `TaskMoEForMultiTask.from_dense(checkpoint,
    tasks, num_experts=4)`; it loads with `AutoModel` after `import hf_taskmoe`. Its `forward` is the heads' forward
    (`TaskHeadsMixin.forward`, `hf_taskmoe.models.encoder`) plus `output_router_logits=True`: also return the router
    logits, chosen experts and per-task routing counts.

    Example:

    ```python
    >>> from hf_taskmoe import TaskMoEForMultiTask, TaskSpec
    >>> tasks = [TaskSpec(name="sst2", num_labels=2), TaskSpec(name="stsb", problem_type="regression")]
    >>> model = TaskMoEForMultiTask.from_dense("path/to/a-roberta", tasks=tasks, num_experts=4)
    ```
    """

    config_class = TaskMoEConfig
    encoder_output_class = TaskMoEEncoderOutput
    _keys_to_ignore_at_inference = [
        "task_losses", "task_logits", "task_ids", "hidden_states", "attentions", "router_logits", "expert_indices",
        "routing_counts", "aux_loss", "z_loss",
    ]
    parameter_roles = _MoERoles()
    stacked_weights = EXPERT_BANK_WEIGHTS
    # `config.experts_implementation` is settable (`from_pretrained`, `set_experts_implementation`): the experts class
    # declared with `use_experts_implementation` is `hf_taskmoe.layers.moe.ExpertBank`
    _can_set_experts_implementation = experts_class_elsewhere()

    def __init__(self, config: TaskMoEConfig):
        super().__init__(config)
        self._build_backbone(config)
        self.post_init()
        self.apply_freezing()

    def apply_freezing(self) -> None:
        """With low-rank experts and `train_base=False`, freeze every dense weight: only the deltas, the gates and the
        heads train."""
        config = self.config
        if config.low_rank and not config.train_base:
            for name, param in self.named_parameters():
                param.requires_grad_(name.startswith("heads.") or ".router." in name
                                     or name.endswith((".lora_A", ".lora_B")))

    family_flags = ("output_router_logits",)

    def _task_output(self, task_ids, encoded: TaskMoEEncoderOutput, heads_out) -> TaskMoEOutput:
        """The heads' output, the routing fields and, with a loss, the router's auxiliary losses weighted into it."""
        loss = heads_out.loss
        if loss is not None:
            if encoded.aux_loss is not None:
                loss = loss + self.config.router_aux_loss_coef * encoded.aux_loss
            if encoded.z_loss is not None:
                loss = loss + self.config.router_z_loss_coef * encoded.z_loss
        routing = ("router_logits", "expert_indices", "routing_counts", "aux_loss", "z_loss")
        return TaskMoEOutput(loss=loss, task_ids=task_ids, hidden_states=encoded.hidden_states,
                             attentions=encoded.attentions, **{name: getattr(encoded, name) for name in routing},
                             **heads_to_output_fields(heads_out))

    # ------------------------------------------------------------------ tasks
    def _grow_for_task(self, new_id: int, source: int | None) -> None:
        """MT-TaG section 5.2: with task-aware gating, a gate per MoE layer copied from the related task `source`
        (or drawn from N(0, router_init_std)); the shared gate of MT-Switch serves the new task as it is."""
        for moe in self.moe_layers():
            moe.add_task(source, self.config.router_init_std)

    def moe_layers(self) -> list[TaskMoE]:
        """Every layer's `TaskMoE` (a dense layer's too: one expert, no gate), in layer order."""
        return [module for module in self.modules() if isinstance(module, TaskMoE)]

    def _wrap_backbone(self, config: TaskMoEConfig, backbone: Backbone, layers) -> None:
        for index in config.moe_layer_indices:
            layer = layers[index]
            if config.low_rank:
                moe = BackboneTaskMoE(config, index, None, self.task_context, low_rank_ffn(layer, backbone, config))
            else:
                moe = BackboneTaskMoE(config, index, ffn_experts(layer, backbone, config), self.task_context)
            replace_module(layer, backbone.ffn.module, moe)

    def get_correct_experts_implementation(self, requested_experts: str | None) -> str:
        """transformers' check of `experts_implementation`, and MT-TaG's: experts that are whole FFN modules
        (DistilBERT, ModernBERT) run MT-TaG's own loop only; low-rank experts (`expert_rank`) take none but the
        default."""
        self.config.check_low_rank_experts_implementation(requested_experts)
        if (requested_experts not in (None, AUTO, *SORTED_IMPLEMENTATIONS) and self.config.num_experts > 1
                and not self.config.backbone.ffn.split):
            raise ValueError(
                f"`experts_implementation={requested_experts!r}` runs stacked two-projection experts; a "
                f"{self.config.backbone.model_type} FFN is a whole module, whose experts are copies of it and run "
                f"MT-TaG's loop over the sorted tokens: use '{AUTO}' (the default) or '{SORTED}'."
            )
        return super().get_correct_experts_implementation(requested_experts)

    def _dense_rules(self):
        backbone = self.config.backbone
        site = backbone.ffn
        if site.split:
            low_rank = (  # the dense projections in place, wrapped with their deltas (`expert_rank`)
                layer_rule(backbone, rf"{site.module}\.experts\.0\.w_in\.base_layer\.(.+)", rf"{site.w_in}.\2"),
                layer_rule(backbone, rf"{site.module}\.experts\.0\.w_out\.base_layer\.(.+)", rf"{site.w_out}.\2"),
            )
            return (
                *low_rank,
                # stacked experts (`experts.up_proj`, `experts.up_proj_bias`: every slice a copy) or one
                # (`experts.0.w_in.*`)
                *(
                    layer_rule(backbone, rf"{site.module}\.experts\.{proj}{suffix}", f"{path}.{kind}")
                    for proj, path in (("up_proj", site.w_in), ("down_proj", site.w_out))
                    for suffix, kind in (("", "weight"), ("_bias", "bias"))
                ),
                layer_rule(backbone, rf"{site.module}\.experts\.0\.w_in\.(.+)", rf"{site.w_in}.\2"),
                layer_rule(backbone, rf"{site.module}\.experts\.0\.w_out\.(.+)", rf"{site.w_out}.\2"),
            )
        return (
            layer_rule(backbone, rf"{site.module}\.experts\.0\.(.+)\.base_layer\.(.+)", rf"{site.module}.\2.\3"),
            layer_rule(backbone, rf"{site.module}\.experts\.\d+\.(.+)", rf"{site.module}.\2"),
        )

    @torch.no_grad()
    def _init_weights(self, module):
        if isinstance(module, TokenLowRankExperts):  # peft's init: A Kaiming-uniform, B zero (the dense FFN's output)
            module.reset_lora_parameters()
            return
        super()._init_weights(module)
        if isinstance(module, (TaskGate, SharedGate)):
            init.normal_(module.weight, mean=0.0, std=self.config.router_init_std)  # MT-TaG 4.4: N(0, 0.001)
        elif isinstance(module, ExpertBank):  # the dense model's Linear init, per expert
            module.init_weights(getattr(self.config.dense_config, "initializer_range", 0.02))

    def _context_flags(self, output_router_logits=None) -> dict:
        # `moe_shared`: what every MoE layer of the forward would derive alike (`BackboneTaskMoE.shared_tensor`)
        return {"output_routing": bool(output_router_logits), "moe_shared": {}}

    def _encoder_fields(self, reports, output_router_logits=None) -> dict:
        return moe_encoder_fields(reports, bool(output_router_logits))

    @classmethod
    def from_dense(cls, dense, tasks, num_experts: int = 4, gating: str = "task",
                   expert_weighting: str = "straight_through", output_loading_info: bool = False, strict: bool = True,
                   hub_kwargs: dict | None = None, **config_kwargs):
        """Upcycle a dense encoder checkpoint (MT-TaG section 4.3) of any declared architecture: every FFN of an MoE
        layer is copied into each of its `num_experts` experts, everything else is the dense model's own weights;
        gates N(0, router_init_std), heads the architecture's initialisation. With straight-through weighting (the
        default) the new model computes exactly what the dense model computed.

        With `expert_rank=r` (low-rank experts) the FFN is not copied: its linears get each expert's LoRA delta with
        `B = 0`, so every expert starts equal to the dense FFN (the model computes the dense model's outputs exactly
        under straight-through weighting) and the experts differ only through the tokens the router sends them; the
        dense weights are frozen unless `train_base=True`."""
        return super().from_dense(
            dense, tasks, output_loading_info=output_loading_info, strict=strict, hub_kwargs=hub_kwargs,
            num_experts=num_experts, gating=gating, expert_weighting=expert_weighting, **config_kwargs,
        )
