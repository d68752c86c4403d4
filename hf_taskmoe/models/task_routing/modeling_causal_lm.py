"""TaskRoutedForCausalLM: task-level mixture of experts (Ye et al. 2022) over the layers of a decoder-only causal LM.

The model holds the dense causal LM itself (`AutoModelForCausalLM.from_config(config.dense_config)`: GPT-2, Llama,
Qwen2, Mistral, any architecture declared in `hf_taskmoe.backbones.decoders`) and forks its layers in place: every
routed layer becomes a `ContextRoutedLayer` holding `m` experts, each a whole copy of the layer (attention, FFN, norms),
as the paper forks BART's layers. A `TaskRouter` turns each task's embedding into decisions `D` and layer `i` outputs
`sum_j D_ij E^(i,j)(h)` (eq. 1). The dense model's own forward runs unchanged -- its embeddings, positions (learned or
rotary), masks, attention kernels, final norm and LM head -- and its layer loop calls the routed layers, which read the
decisions from the model's `TaskContext`.

Generation with a key/value cache. Each expert copy of a layer has its own cache slot (its attention's `layer_idx`):
expert 0 keeps the dense layer's slot, the others get slots after the dense ones (`fork_layers`). A forward runs every
expert on every row, so each slot holds the keys and values its expert computed from the mixed hidden states at that
layer's input -- exactly what a forward without a cache recomputes at every step, under a hard route (one-hot
decisions: the other experts' outputs are multiplied by 0) and under a soft one alike -- and nothing is read back from
the device (the forward exports). Sharing one slot between the copies would make them overwrite each other's history;
forking only the FFN would keep one slot per layer but is not the paper's method.

`generate` under hard routes costs the dense model's compute instead: a hard route is a function of the task, fixed for
the whole generation, so the first step reads the decisions once (`hard_route_plan`, the call's one host read) and
keeps the plan on the cache (`ExpertRowsCache`); each step then runs, per routed layer, only the experts some row uses,
each on its own rows (the whole batch, with the plain cache and no gather, when every row takes the same expert), and
each expert's slot keeps only its rows (translated for beam search's reordering). Each used expert runs its whole layer
on its row slice -- at most `m` calls per layer, one for a batch of one route -- rather than one grouped GEMM per
projection across experts: with a few experts the calls are few and each is the dense layer's own kernels (attention
included), which a grouped GEMM would have to split around. Soft routes keep the every-expert path (their cost is the
method's).

Weights: `backbone.<the dense model's own names>`, a routed layer's `<layers>.<i>.experts.<j>.*` (a plain layer is
`experts.0`), the router under `router.*`.

Low-rank experts (`config.expert_rank`): a routed layer is not forked but kept as `experts.0`, its linears wrapped
(`hf_taskmoe.layers.low_rank.LowRankExperts`: `<linear>.base_layer.*` the dense weights, `<linear>.lora_A` /
`lora_B` every expert's delta); the cache is the dense model's own (`DynamicCache`, one slot per layer), and
generation runs each layer once on every row, each row adding its own expert's delta (docs/task-routing-lm.md).
"""

from __future__ import annotations

import copy

import torch
from transformers import AutoModelForCausalLM, GenerationMixin
from transformers.cache_utils import Cache, DynamicCache

from ...input_checks import (
    check_batch_dim,
    check_generation_cache,
    check_generation_counts,
    check_input_shapes,
    check_token_ids,
    resolve_task_ids,
    token_table_sizes,
)
from ...layers.routing import ExpertRowsCache, RouteRecorder
from ...modeling_utils import MultiTaskPreTrainedModel
from ...problem_types.seq2seq import IGNORE_INDEX, Seq2Seq
from .configuration import TaskRoutedLMConfig
from .core import TaskRoutedCausalLMOutput, TaskRoutingMixin, fork_layers

__all__ = ["TaskRoutedCausalLMOutput", "TaskRoutedForCausalLM", "left_align"]

#: tokens `generate()` produces by default after the prompt (transformers' own default stops at 20 positions)


def left_align(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows whose masked positions sit after (or between) their tokens, moved so that every row ends with its last
    token: what a decoder-only model generates from. A stable sort of the positions by the mask (masked first, each
    group in its order): left-padded rows are unchanged, right-padded ones are rotated. Runs on the device, reads
    nothing back."""
    order = torch.sort(attention_mask.to(torch.int8), dim=-1, stable=True).indices  # (batch, seq)
    return input_ids.gather(1, order), attention_mask.gather(1, order)


def _contiguous_rows(module, args):
    """The LM head's input made contiguous where it is a slice of the positions (`logits_to_keep`: the last position
    of a prompt, `(batch, 1, hidden)` with the prompt's strides): torch's `matmul` folds such an input into one GEMM
    only when the weight takes a gradient, and a frozen head (the base of low-rank experts, a frozen dense model)
    otherwise runs one product per row against the broadcast weight (`bmm`), about 4x the folded GEMM's time on
    this CPU (`benchmarks/low_rank_step.py`'s generation). A copy of `batch x hidden` values."""
    if args and isinstance(args[0], torch.Tensor) and args[0].dim() > 2 and not args[0].is_contiguous():
        return (args[0].contiguous(), *args[1:])
    return None


class TaskRoutedForCausalLM(TaskRoutingMixin, MultiTaskPreTrainedModel, GenerationMixin):
    r"""
    A decoder-only causal LM (GPT-2, Llama, Qwen2, Mistral) with task-level routing over forked layers.
    `forward(input_ids, task_ids=..., labels=...)` and `generate(input_ids, task_ids=...)` take one task id per row
    (index into `config.tasks`); a batch may mix tasks. Labels are the input ids with `-100` on the prompt (the causal
    layout of `hf_taskmoe.problem_types.seq2seq`): the loss is the causal LM loss on the target tokens.

    Build one with `TaskRoutedForCausalLM.from_dense("Qwen/Qwen2-0.5B", tasks)`: every expert of layer `i` starts as
    layer `i` (plus N(0, 1e-8) noise, section 5.2; `expert_noise_variance=0` makes the model compute exactly the
    dense model). `export_task(task)` gives back a plain model of the dense class holding that task's route.
    """

    config_class = TaskRoutedLMConfig
    output_class = TaskRoutedCausalLMOutput
    dense_auto_class = AutoModelForCausalLM
    dense_kind = "a causal LM with its LM head (AutoModelForCausalLM)"
    #: transformers Auto classes this model is registered with (and named in an export's `auto_map`)
    auto_classes = ("AutoModel", "AutoModelForCausalLM")
    _no_split_modules = ["ContextRoutedLayer"]
    _supports_flash_attn = True
    _supports_attention_backend = True

    def __init__(self, config: TaskRoutedLMConfig):
        super().__init__(config)
        declared = config.backbone
        self._build_dense(config)
        layers = declared.layer_list(self.backbone.base_model)
        self._slot_layers = fork_layers(
            layers, config.route_layers, config.num_experts, declared.attention, self.task_context,
            shared=(self.backbone.config,), low_rank=self._low_rank_spec(config),
        )
        self._finish_init(config)
        head = self.get_output_embeddings()
        if head is not None:
            head.register_forward_pre_hook(_contiguous_rows)

    # ------------------------------------------------------------------ cache
    def new_cache(self) -> ExpertRowsCache | DynamicCache:
        """An empty key/value cache with one slot per expert: the dense layout (its sliding-window layers included),
        then a slot like its layer's for each expert copy. With low-rank experts (`expert_rank`): the dense model's
        own cache (one slot per layer)."""
        if self.config.low_rank:
            return DynamicCache(config=self.config.dense_config)
        cache = ExpertRowsCache(config=self.config.dense_config)
        if cache.layers:  # built from the config: one layer object per slot, of the slot's layer's kind
            cache.layers.extend(copy.deepcopy(cache.layers[i]) for i in self._slot_layers[len(cache.layers):])
        return cache

    def _routed_cache(self, cache: Cache | None) -> Cache:
        """The cache to decode with: ours, a new one in place of none, or of an empty cache of another layout. With
        low-rank experts any cache of the dense layout (the layers keep one slot each)."""
        if cache is None:
            return self.new_cache()
        if self.config.low_rank:
            return cache
        if getattr(cache, "is_compileable", False):
            raise ValueError(
                f"{type(self).__name__} cannot decode with a static cache ({type(cache).__name__}): its layers keep "
                "one cache slot per expert. Leave `cache_implementation` unset (the default dynamic cache)."
            )
        if len(cache.layers) < len(self._slot_layers):
            if cache.get_seq_length() > 0:
                raise ValueError(
                    f"{type(self).__name__} continues decoding only from a cache with a slot per expert "
                    f"({len(self._slot_layers)}; `model.new_cache()`), got a filled {type(cache).__name__} with "
                    f"{len(cache.layers)}."
                )
            return self.new_cache()
        return cache

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        task_ids: torch.LongTensor | None = None,
        routing_weights: torch.Tensor | None = None,
        output_router_logits: bool = False,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        values_checked: bool = False,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs,
    ) -> TaskRoutedCausalLMOutput | tuple:
        r"""
        task_ids (`torch.LongTensor` of shape `(batch,)`):
            Each row's task (index into `config.tasks`); optional for a one-task model.
        labels (`torch.LongTensor` of shape `(batch, seq)`):
            The input ids with `-100` where no loss is taken (the prompt, padding); shifted inside, as transformers'
            causal LMs do. A batch collated with `pad_to_multiple_of` may give fewer columns than the inputs: the
            rest count as `-100`.
        cache (`Cache`, *optional*):
            The key/value cache this model returned (one slot per expert, `new_cache()`); also accepted as
            `past_key_values`. An empty cache of the dense layout (what `generate` makes) is replaced by one.
        routing_weights (`torch.Tensor` of shape `(batch, routed layers, experts)`, *optional*):
            Decisions to use instead of the router's (analysis).
        output_router_logits (`bool`, *optional*):
            Return `routing_decisions`, `router_logits` and `routing_counts`.
        values_checked (`bool`, *optional*, defaults to `False`):
            The task ids and target ids were checked on the host where the batch was made: their values are not
            read back here (no host sync). The result is the same.
        """
        cache = self._forward_cache(cache, kwargs)
        batch, seq = check_input_shapes(
            input_ids, inputs_embeds, None if cache is not None else self.config.max_position_embeddings,
            attention_mask=attention_mask if cache is None else None, position_ids=position_ids,
        )
        check_batch_dim(batch, labels=labels)
        # the dense recording off: the routed layers record the mixed outputs (`_recording_flags`)
        inputs = dict(input_ids=input_ids, attention_mask=attention_mask, inputs_embeds=inputs_embeds,
                      output_hidden_states=False, output_attentions=False,
                      logits_to_keep=logits_to_keep if labels is None else 0,
                      **({"position_ids": position_ids} if position_ids is not None else {}), **kwargs)
        return self._routed_forward(
            inputs, batch, seq, labels, cache, use_cache, task_ids, routing_weights, values_checked,
            output_router_logits, output_attentions, output_hidden_states, return_dict, {"input_ids": input_ids},
        )

    def _prepare_labels(self, labels: torch.Tensor, inputs: dict, seq: int, values_checked: bool) -> torch.Tensor:
        if labels.dim() != 2 or labels.shape[1] > seq:
            raise ValueError(
                f"`labels` must have shape (batch, seq) = ({labels.shape[0]}, {seq}) like the inputs (the input ids "
                f"with -100 on the prompt), got {tuple(labels.shape)}."
            )
        if not values_checked:
            Seq2Seq.check_target_ids(labels, self.config.vocab_size)
        if labels.shape[1] < seq:  # the inputs were padded further (`pad_to_multiple_of`): no loss there
            labels = torch.nn.functional.pad(labels, (0, seq - labels.shape[1]), value=IGNORE_INDEX)
        return labels

    def _recording_flags(self, hidden, attentions: bool) -> dict:
        if not (hidden or attentions):
            return {}
        # the routed layers record their mixed outputs
        return {"routing_recorder": RouteRecorder(hidden, attentions, {"attentions": self.config.backbone.attention})}

    def _stack_outputs(self, out, recorded: dict) -> dict:
        return {"hidden_states": recorded.get("hidden_states"), "attentions": recorded.get("attentions")}

    def _token_loss(self, logits, labels, task_ids):
        """Token cross-entropy of each position's prediction of the next token, mean over the batch's target tokens
        (as transformers' causal LMs), weighted per task; each task's own mean."""
        # (batch, seq - 1): the token each position predicts
        return super()._token_loss(logits[:, :-1], labels[:, 1:], task_ids)

    # ------------------------------------------------------------------ generation
    def generate(self, input_ids=None, attention_mask=None, every_expert: bool = False, **kwargs):
        """`GenerationMixin.generate` with `task_ids` (one per row). Prompts padded on the right (a BERT tokenizer's
        default, the text-to-text pipeline's batches) are moved to the left first (`left_align`), as a decoder-only
        model needs; the returned sequences hold the (left-aligned) prompts, then the generated tokens. The segment
        ids a BERT tokenizer returns are dropped.

        Under hard routes (every row's decisions one-hot: `selection="hard"` or `"gumbel_softmax_st"` at evaluation)
        each routed layer runs only the experts the rows use, each on its own rows, with its own rows in its cache
        slot: the dense model's cost. The plan is made at the first step from the decisions (one host read per call)
        and kept for the others; the task ids and the prompt's token ids are checked once, before the first step. A
        soft route, a cache passed by hand, or `every_expert=True` (the reference the routed path is tested against)
        run every expert on every row, mixed by the decisions."""
        kwargs.pop("token_type_ids", None)
        check_generation_counts(kwargs)
        check_generation_cache(self, kwargs)
        kwargs.pop("cache_implementation", None)  # 'dynamic': the routed cache passed below is one
        if input_ids is not None and attention_mask is not None:
            input_ids, attention_mask = left_align(input_ids, attention_mask)
        given = kwargs.get("task_ids")
        if input_ids is not None and not kwargs.get("values_checked"):
            # the task ids and the prompt's token ids checked once, here: every decoding step then reads nothing back
            # to check them again (its new ids are the model's own), where each step read both
            kwargs["task_ids"] = resolve_task_ids(given, input_ids.shape[0], self.config.task_names, self.device)
            check_token_ids(token_table_sizes(self), input_ids=input_ids)
            kwargs["values_checked"] = True
        cache = self._generation_cache(kwargs, every_expert)
        return self._generate(super().generate, input_ids, cache, given, {"attention_mask": attention_mask, **kwargs})

    # ------------------------------------------------------------------ building and exporting

    def _layer_stacks(self) -> dict[str, list]:
        prefix = f"{self.backbone.base_model_prefix}.{self.config.backbone.layers}."
        return {prefix: self.config.backbone.layer_list(self.backbone.base_model)}
