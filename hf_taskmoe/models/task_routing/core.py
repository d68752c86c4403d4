"""What every task-routed model shares, causal LM or encoder-decoder: the router and its bookkeeping (temperature
annealing, evaluation routes, disabling experts, task representations), the routed forward past each architecture's
shape checks (`_routed_forward`: router, decisions, loss, counts, output), the output classes, the layer wrapper the
dense model's own loop calls, the key/value cache slot numbering that lets forked decoder layers generate with a
cache, `from_dense` and `export_task`."""

from __future__ import annotations

import contextlib
import copy
import inspect
import os
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers import initialization as init
from transformers.modeling_outputs import CausalLMOutputWithPast, Seq2SeqLMOutput
from transformers.utils import TransformersKwargs

from ...backbones import TaskContext
from ...compat import CACHE_ARG, output_cache, pop_cache
from ...contract import LOW_RANK_ROUTING_ROLES, TASK_ROUTING_ROLES
from ...input_checks import check_kwargs, check_token_ids, resolve_task_ids, token_table_sizes
from ...layers.grouped_routes import task_sorted_generate
from ...layers.low_rank import LowRankExperts, LowRankSpec, expert_path, wrap_linears
from ...layers.routing import (
    PlanEntry,
    RoutedLayer,
    SlotRows,
    TaskEmbedding,
    TaskRouter,
    annealed_temperature,
    every_expert_plan,
    hard_route_plan,
    plan_routes,
)
from ...modeling_utils import grow_embedding
from ...problem_types.seq2seq import Seq2Seq
from ...tasks import TaskSpec
from ...utils import is_capturing
from ..dense_wrapper import DenseWrapperMixin


@dataclass
class TaskRoutedCausalLMOutput(CausalLMOutputWithPast):
    """`CausalLMOutputWithPast` plus, as in every family's output: `task_losses` (each task's mean token loss over its
    target tokens), `task_ids`, and with `output_router_logits=True` the routing: `routing_decisions` and
    `router_logits`, both `(batch, routed layers, experts)`, and `routing_counts` `(routed layers, tasks, experts)`
    (the sum of each task's rows' decisions), as `RoutingStatistics` reads them.

    `hidden_states` (when asked): the embedding output and each layer's (mixed) output, `(batch, seq, hidden)` each,
    before the final norm; `attentions`: each layer's attention probabilities, mixed over its experts by `D`
    (eager attention only)."""

    task_losses: dict[str, torch.FloatTensor] | None = None
    task_ids: torch.LongTensor | None = None
    routing_decisions: torch.FloatTensor | None = None
    router_logits: torch.FloatTensor | None = None
    routing_counts: torch.FloatTensor | None = None


@dataclass
class TaskRoutedSeq2SeqOutput(Seq2SeqLMOutput):
    """`Seq2SeqLMOutput` plus, as in every family's output: `task_losses` (each task's mean token loss), `task_ids`,
    and with `output_router_logits=True` the routing: `routing_decisions` and `router_logits`, both `(batch, routed
    layers, experts)`, and `routing_counts` `(routed layers, tasks, experts)` (the sum of each task's rows' decisions).

    `encoder_hidden_states` / `decoder_hidden_states` (when asked): the embedding output and each block's (mixed)
    output, `(batch, seq, hidden)` each, before the final norm; `encoder_attentions`, `decoder_attentions`,
    `cross_attentions`: each block's attention probabilities mixed over its experts by `D` (eager attention only)."""

    task_losses: dict[str, torch.FloatTensor] | None = None
    task_ids: torch.LongTensor | None = None
    routing_decisions: torch.FloatTensor | None = None
    router_logits: torch.FloatTensor | None = None
    routing_counts: torch.FloatTensor | None = None


class ContextRoutedLayer(RoutedLayer):
    """A `RoutedLayer` in the place of one layer of a dense model, called by that model's own layer loop with the
    layer's own arguments. The routing weights (and the plan, and a `RouteRecorder` when hidden states or attentions
    are asked for) come from the model's `TaskContext`, filled by the family before it calls the dense model.

    Which experts run on which rows is the plan in the context (`TaskRoutingMixin._routing_flags`). A forward of a
    model whose `plans_forward_routes` is False (the causal LMs; training, evaluation, a forward with a cache passed
    by hand) takes the every-expert plan: every expert runs on every row and the outputs are mixed by the decisions
    (`sum_j D_ij E^(i,j)(h)`), no decision is read back to the host, and the cost is `m` times the layer's (`m` =
    experts); the encoder-decoders plan their forward's routes on the host (`plan_routes`, one read; every expert
    under capture, compile and straight-through training). `generate` under hard routes takes the plan of the routes
    (`hard_route_plan`, made once per generation): only the experts some row uses run, each on its rows (the whole
    batch, with no gather, when every row takes it), and each keeps only its rows in its cache slot
    (`ExpertRowsCache`, `RoutedCache`): the dense model's cost."""

    def __init__(self, experts: list[nn.Module], route_index: int | None, context: TaskContext):
        super().__init__(experts, route_index)
        self.context = context  # a plain object (no weights): shared with the model, not saved

    def forward(self, hidden_states, *args, **kwargs):
        return self.run_from_context(hidden_states, args, kwargs)

    def run_from_context(self, hidden_states, args: tuple, kwargs: dict):
        """`run_plan` with the routing of the context: its plan's entries for this layer (none in the context: every
        expert, nothing read back), its decisions and its recorder."""
        flags = self.context.flags
        weights = flags.get("routing_weights")
        if self.route_index is None:  # a plain layer
            entries = [PlanEntry(0, None, False)]
        else:
            if weights is None:
                self.context.require_task_ids()  # raises: called outside the model's forward
            plan = flags.get("routing_plan")
            entries = plan[self.route_index] if plan is not None else every_expert_plan(1, len(self.experts))[0]
        return self.run_plan(entries, hidden_states, args, kwargs, weights, flags.get("routing_recorder"))


def fork_layers(layers: nn.ModuleList, routed: list[int], num_experts: int, attention: str | tuple[str, ...] | None,
                context: TaskContext, shared: tuple = (), first_route: int = 0,
                layer_class: type[ContextRoutedLayer] = ContextRoutedLayer,
                low_rank: LowRankSpec | None = None) -> list[int]:
    """Replace each layer of `layers` by a `layer_class` (a `ContextRoutedLayer`): a routed layer (index in `routed`)
    holds the layer and `num_experts - 1` copies of it, any other layer holds itself alone. Returns `slot_layers`: the
    layer each key/value cache slot belongs to. `attention`: the path (or paths: a T5 decoder block's self- and
    cross-attention) of the attention modules whose `layer_idx` names the slot; None: the layers keep no cache (an
    encoder). `first_route`: the router's layer axis index of the first routed layer (an encoder-decoder routes its
    encoder's layers first).

    Cache slots: a decoder layer's attention writes its keys and values at `cache.layers[attention.layer_idx]`, so two
    copies of one layer would overwrite each other's history. Expert 0 of layer `i` keeps slot `i` (the dense model's
    own, so a cache of the dense layout is a prefix of ours and slot 0 -- which the dense model reads the past length
    from -- is a real layer holding every row); expert `j > 0` gets a slot after the dense ones. Copies are
    `copy.deepcopy` of the layer sharing `shared` objects (the dense config, whose attention implementation
    `set_attn_implementation` changes), so each keeps what its layer index fixed at construction (Qwen2's sliding
    window per layer type, GPT-2's per-layer attention scale): only the cache slot number changes.

    `low_rank` (low-rank experts, `expert_rank`): a routed layer is not copied. It stays one module (its only
    "expert", `experts.0`) with its one cache slot, and its targeted linears become `LowRankExperts` holding the
    experts' deltas, reading the layer's decisions from `context` (`wrap_linears`)."""
    slot_layers = list(range(len(layers)))
    paths = (attention,) if isinstance(attention, str) else tuple(attention or ())
    route = first_route
    for i, layer in enumerate(list(layers)):
        experts = [layer]
        if i in routed and low_rank is not None:
            wrap_linears(layer, low_rank, route, context)
        elif i in routed:
            for _ in range(num_experts - 1):
                expert = copy.deepcopy(layer, memo={id(s): s for s in shared})
                for path in paths:
                    expert.get_submodule(path).layer_idx = len(slot_layers)
                slot_layers.append(i)
                experts.append(expert)
        layers[i] = layer_class(experts, route if i in routed else None, context)
        if paths:
            layers[i].cache_slots = [expert.get_submodule(paths[0]).layer_idx for expert in experts]
        route += int(i in routed)
    return slot_layers


def dense_forward_kwargs(dense_class, *extra: str) -> frozenset[str]:
    """Keyword arguments the dense model's `forward` takes (and transformers' `TransformersKwargs`, the cache's, and
    `extra`): what the family passes on to it."""
    names = set(inspect.signature(dense_class.forward).parameters) | set(TransformersKwargs.__annotations__)
    names |= {"cache_position", "past_key_values", *extra}
    return frozenset(names - {"self", "kwargs", "labels", "return_dict"})


class _RoutingRoles:
    """The parameter roles of a task-routed model: `TASK_ROUTING_ROLES` (whole experts), or, on a model with
    low-rank experts (`config.expert_rank`), `LOW_RANK_ROUTING_ROLES` (the deltas are the experts, the one copy of
    each layer is shared). Read on the class (the registry, upcycling rules) it is `TASK_ROUTING_ROLES`."""

    def __get__(self, obj, owner=None):
        config = getattr(obj, "config", None) if obj is not None else None
        return LOW_RANK_ROUTING_ROLES if getattr(config, "low_rank", False) else TASK_ROUTING_ROLES


#: how many tokens a task-routed model generates unless told (`generation_config.max_new_tokens`)
DEFAULT_MAX_NEW_TOKENS = 64


def check_cache_rows(cache, batch: int) -> None:
    """A key/value cache continues the batch it was filled with: a filled slot that holds every row (one an expert
    keeps only its own rows in, `SlotRows.slot_rows`, is the generation plan's, checked with it) must hold `batch`.
    One of another batch size, passed by hand, is refused by name here (a `RuntimeError` on tensor sizes inside the
    attention otherwise). Reads the slots' shapes only (no host sync)."""
    halves = [getattr(cache, "self_attention_cache", None), getattr(cache, "cross_attention_cache", None)]
    halves = [h for h in halves if h is not None] or [cache]
    own_rows = getattr(cache, "slot_rows", None) or {}
    for half in halves:
        for slot, layer in enumerate(getattr(half, "layers", ())):
            keys = getattr(layer, "keys", None)
            if slot in own_rows or not isinstance(keys, torch.Tensor) or keys.dim() != 4 or keys.shape[-2] == 0:
                continue
            if keys.shape[0] != batch:
                raise ValueError(
                    f"`cache` (`past_key_values`) was filled for {keys.shape[0]} rows (slot {slot}), but the inputs "
                    f"have {batch} rows: a key/value cache continues only the batch it was filled with (the same rows "
                    "and task ids, in order). Pass no cache (or `model.new_cache()`) to start another batch."
                )


class TaskRoutingMixin(DenseWrapperMixin):
    """The router's side of a task-routed model: `self.router` (a `TaskRouter`) and `config` routing fields, the
    generation convention, and `export_task`; the dense LM it holds (`self.backbone`, its layers forked) is
    `DenseWrapperMixin`'s. A family names its dense class (`dense_auto_class`), its special tokens and, in
    `_layer_stacks`, where its forked layers are; its `forward` checks its inputs' shapes and calls
    `_routed_forward`, adding what its blocks need (`_prepare_labels`, `_recording_flags`, `_stack_outputs`)."""

    router: TaskRouter
    # parameter roles (`parameter_report`, optimizer groups of `MultiTaskTrainingArguments.group_learning_rates`)
    parameter_roles = _RoutingRoles()
    #: what the dense model must be (messages; `dense_auto_class` also builds `export_task`'s model)
    dense_kind: str
    #: the special tokens of the dense config the generation config and an export carry
    special_token_names: tuple[str, ...] = ("eos_token_id", "pad_token_id", "bos_token_id")

    def _low_rank_spec(self, config) -> LowRankSpec | None:
        """How `fork_layers` builds low-rank experts (None: whole copies, `expert_rank` unset)."""
        if not config.low_rank:
            return None
        targets = tuple(config.expert_targets) if config.expert_targets is not None else None
        return LowRankSpec(config.num_experts, config.expert_rank, config.lora_alpha, config.expert_dropout, targets)

    def low_rank_modules(self) -> dict[str, LowRankExperts]:
        """`{name in this model: module}` of every linear holding low-rank experts (empty with whole experts)."""
        return {name: m for name, m in self.named_modules() if isinstance(m, LowRankExperts)}

    def _check_low_rank_targets(self, config) -> None:
        if not config.low_rank:
            return
        names = list(self.low_rank_modules())
        unmatched = [t for t in config.expert_targets or () if not any(n.endswith(f".{t}") for n in names)]
        if not names or unmatched:
            raise ValueError(
                f"`expert_targets` {unmatched or config.expert_targets!r} match no linear (nn.Linear, Conv1D) of the "
                f"routed layers of this {config.dense_config.model_type}; name linears of a layer by their module "
                "names or suffixes (Llama: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj), or leave "
                "it None for every linear."
            )

    def _finish_init(self, config, *forward_kwargs: str) -> None:
        """After the forking: the router, what the forward passes on to the dense model (`dense_forward_kwargs`, with
        `forward_kwargs`), transformers' `post_init`, the generation convention and the frozen task embeddings."""
        self._check_low_rank_targets(config)
        self._build_router(config)
        self._forward_kwargs = dense_forward_kwargs(type(self.backbone), *forward_kwargs)
        self.post_init()
        self._apply_generation_convention(self.generation_config)
        self.apply_freezing()

    def _layer_stacks(self) -> dict[str, list]:
        """`{state-dict prefix of a layer list in the dense model ("model.layers."): its layers}` (routed or not)."""
        raise NotImplementedError

    def routed_layers(self) -> list:
        """The layers forked into experts, in the router's layer order (a seq2seq model's encoder first)."""
        return [layer for layers in self._layer_stacks().values() for layer in layers if layer.route_index is not None]

    @classmethod
    def is_custom_code(cls) -> bool:
        """False: initialise like the dense model in transformers. transformers treats a class defined outside it as
        custom code and then, in `initialize_weights` (a model built on the meta device: `from_pretrained` with
        missing weights), skips every module without weights of its own, assuming a custom `_init_weights` writes
        weights in place. The dense models initialise some weights from such a parent module (T5's feed-forward and
        attention, GPT-2's scaled projections), which would keep their child layer's generic init instead; every
        `_init_weights` of this package uses transformers' guarded `initialization` functions, so the library's own
        path is the right one."""
        return False

    def _initialises_itself(self, module) -> bool:
        return isinstance(module, LowRankExperts)  # the dense model's own `_init_weights` knows nothing of them

    def _initialize_again(self, module) -> None:
        # the module alone (its base layer is the dense model's), under the guard that skips a loaded weight
        with torch.no_grad(), init.guard_torch_init_functions():
            self._init_weights(module)

    def _checkpoint_kwargs(self, kwargs):
        # a layer with low-rank experts reads its decisions from the task context while it is recomputed; whole
        # experts read none (their `ContextRoutedLayer` runs outside the checkpointed layer)
        return super()._checkpoint_kwargs(kwargs) if self.config.low_rank else kwargs

    def _dense_rules(self) -> tuple[tuple[str, str], ...]:
        """Ye et al. section 5.2: every expert of layer i starts as layer i (a plain layer is `experts.0`); a linear
        holding low-rank experts keeps the dense one as its `base_layer`."""
        return ((r"(.+)\.experts\.\d+\.(.+)\.base_layer\.(weight|bias)", r"\1.\2.\3"),
                (r"(.+)\.experts\.\d+\.(.+)", r"\1.\2"))

    @torch.no_grad()
    def _init_weights(self, module):
        if isinstance(module, LowRankExperts):  # peft's init: A Kaiming-uniform, B zero (the dense layer's output)
            module.reset_lora_parameters()
            return
        if not self._init_router_weights(module):
            super()._init_weights(module)
        self._init_task_order(module)

    def init_parallel_plans(self) -> None:
        """transformers' parallel plans, gathered from the dense model's, with each per-layer entry
        (`backbone.model.layers.*.self_attn.q_proj`) moved under the layer's experts
        (`backbone.model.layers.*.experts.*.self_attn.q_proj`): every layer of a stack is a `ContextRoutedLayer`
        holding its experts (a layer that is not routed: itself, as expert 0)."""
        super().init_parallel_plans()
        stacks = [f"{self.base_model_prefix}.{prefix}*." for prefix in self._layer_stacks()]
        for name in ("_tp_plan", "_ep_plan", "_fsdp_plan"):
            plan = getattr(self, name, None)
            if not plan:
                continue
            moved = {}
            for key, value in plan.items():
                stack = next((s for s in stacks if key.startswith(s) and not key.startswith(f"{s}experts.")), None)
                moved[key if stack is None else f"{stack}experts.*.{key[len(stack):]}"] = value
            setattr(self, name, moved)

    def get_output_embeddings(self):
        return self.backbone.get_output_embeddings()

    def resize_token_embeddings(self, new_num_tokens: int | None = None, pad_to_multiple_of: int | None = None,
                                mean_resizing: bool = True) -> nn.Embedding:
        """The dense model's `resize_token_embeddings`: its own override runs (BART resizes its
        `final_logits_bias` with the vocabulary), on the config this model shares with it (`config.dense_config`,
        whose `vocab_size` this config reads)."""
        return self.backbone.resize_token_embeddings(new_num_tokens, pad_to_multiple_of, mean_resizing)

    @property
    def vocab_size(self) -> int:
        """The vocabulary size (transformers' models keep it as `model.vocab_size` after a resize)."""
        return self.config.vocab_size

    def set_output_embeddings(self, new_embeddings):
        # transformers' default sets `self.lm_head`, which this wrapper does not have: the LM head is the dense
        # model's (`resize_token_embeddings` of an untied model replaces it through here)
        self.backbone.set_output_embeddings(new_embeddings)

    def _apply_generation_convention(self, generation_config):
        """The dense model's special tokens (where the generation config names none); `max_new_tokens` rather than
        `max_length` (which counts a causal LM's prompt)."""
        dense = self.config.dense_config
        for name in self.special_token_names:
            if getattr(generation_config, name, None) is None and getattr(dense, name, None) is not None:
                setattr(generation_config, name, getattr(dense, name))
        if generation_config.max_new_tokens is None:
            generation_config.max_new_tokens = DEFAULT_MAX_NEW_TOKENS
        if generation_config.max_length == 20:  # transformers' old default, which would clash with max_new_tokens
            generation_config.max_length = None
        return generation_config

    def export_task(self, task: str, force_argmax: bool = False) -> PreTrainedModel:
        """A plain model of the dense class (`GPT2LMHeadModel`, `LlamaForCausalLM`, `T5ForConditionalGeneration`,
        ...) holding `task`'s route: each routed layer is replaced by the expert the task selects (a T5 block's
        relative-position table included). It loads and runs without hf_taskmoe and gives this model's outputs for
        the task. Its config carries the special tokens set on this model (`run_multitask.py` sets the tokenizer's),
        its generation config this model's. The route must be hard (`gumbel_softmax_st` or `hard`, or experts
        disabled down to one); `force_argmax=True` takes the arg-max expert of a soft route (outputs then differ).

        With low-rank experts (`expert_rank`) each routed layer's linears hold the dense weight with the chosen
        expert's delta merged in: `W + s * B_j A_j` (GPT-2's `Conv1D`, stored `(in, out)`: its transpose)."""
        return self._dense_export(self.hard_route(task, force_argmax), task)

    def _dense_export(self, chosen: list[int] | None, task: str | None) -> PreTrainedModel:
        """`export_task`'s dense model of the route `chosen` (an expert per routed layer). With low-rank experts,
        `chosen=None` gives the base: the dense weights with no delta merged (`export_task_adapters`' base)."""
        config = copy.deepcopy(self.config.dense_config)
        if task is not None:
            config.hf_taskmoe_task = task
        for name in self.special_token_names:
            value = getattr(self.config, name, None)
            if value is not None:
                setattr(config, name, copy.deepcopy(value))
        dense = self.dense_auto_class.from_config(config).to(self.device, self.dtype)
        stacks = self._layer_stacks()
        state = self.backbone.state_dict()
        mapped = {}
        for name in dense.state_dict():
            source = name
            prefix = next((p for p in stacks if name.startswith(p)), None)
            if prefix is not None:
                index, rest = name[len(prefix):].split(".", 1)
                layer = stacks[prefix][int(index)]
                expert = chosen[layer.route_index] if layer.route_index is not None and chosen is not None else 0
                if self.config.low_rank:
                    merged = _merged_low_rank(layer.experts[0], rest, None if chosen is None else expert)
                    if merged is not None:
                        mapped[name] = merged
                        continue
                    expert = 0  # the layer's one copy
                source = f"{prefix}{index}.experts.{expert}.{rest}"
            mapped[name] = state[source]
        dense.load_state_dict(mapped, strict=True)
        dense.generation_config = copy.deepcopy(self.generation_config)
        return dense.eval()

    def export_task_adapters(self, path, **kwargs):
        """Write this model as one dense base (`path/base`) plus one peft LoRA adapter per task (`path/<task>`), for
        serving engines and peft that batch requests for different adapters on one base: the routes must be hard.
        `**kwargs` are `hf_taskmoe.lora_export.export_task_adapters`'s (`rank`, `tasks`, `lossless`, `base`, ...);
        returns its `AdapterExport` (docs/serving-adapters.md)."""
        from ...lora_export import export_task_adapters

        return export_task_adapters(self, path, **kwargs)

    @classmethod
    def from_dense(cls, dense: str | os.PathLike | PreTrainedModel, tasks: list[TaskSpec | dict],
                   expert_noise_variance: float = 1e-8, seed: int | None = 0, output_loading_info: bool = False,
                   strict: bool = True, hub_kwargs: dict | None = None, **config_kwargs):
        """Fork every routed layer of a dense model (a model of the family's `dense_auto_class` of a declared
        architecture, or its path / Hub id) into `num_experts` experts: expert `(i, j)` = layer `i` + Gaussian noise of
        variance `expert_noise_variance` (section 5.2; 0 makes every expert an exact copy, so the model computes the
        dense model's outputs under any route). Embeddings, final norms, LM head and plain layers are copied; the
        router is new. `**config_kwargs` are fields of the family's config. With `output_loading_info=True` returns
        `(model, UpcyclingReport)`.

        With `expert_rank=r` (low-rank experts) the layers are not copied: their linears get each expert's LoRA
        delta with `B = 0` (the report lists the deltas as new), so the model computes the dense model's outputs
        exactly under any route, whatever `expert_noise_variance` (not used then); the dense weights are frozen
        unless `train_base=True`."""
        model, report, checkpoint = cls._upcycled(dense, tasks, strict, hub_kwargs, config_kwargs)
        model.generation_config = model._apply_generation_convention(copy.deepcopy(checkpoint.model.generation_config))
        if expert_noise_variance and not model.config.low_rank:
            generator = torch.Generator().manual_seed(seed) if seed is not None else None
            std = float(expert_noise_variance) ** 0.5
            with torch.no_grad():
                for layer in model.routed_layers():
                    for p in layer.experts.parameters():
                        p.add_(torch.randn(p.shape, generator=generator).to(p.dtype) * std)
        return (model, report) if output_loading_info else model

    @classmethod
    def _load_dense(cls, dense, hub_kwargs: dict):
        checkpoint = super()._load_dense(dense, hub_kwargs)
        if checkpoint.model.get_output_embeddings() is None:
            raise ValueError(f"`dense` must be {cls.dense_kind}, got {type(checkpoint.model).__name__}.")
        return checkpoint

    #: the class of the forward's output (`TaskRoutedCausalLMOutput`, `TaskRoutedSeq2SeqOutput`)
    output_class: type

    def _forward_cache(self, cache, kwargs: dict):
        """The first lines of every routed forward: the segment ids a BERT tokenizer returns dropped (a causal LM and
        an encoder-decoder have no segment embeddings), the cache passed as `cache` or `past_key_values`, and the
        keywords neither this forward nor the dense model's takes refused. Returns the cache."""
        kwargs.pop("token_type_ids", None)
        cache = pop_cache({"cache": cache, "past_key_values": kwargs.pop("past_key_values", None)})
        check_kwargs({k: v for k, v in kwargs.items() if k not in self._forward_kwargs}, self.forward)
        return cache

    def _routed_forward(self, inputs: dict, batch: int, seq: int | None, labels, cache, use_cache, task_ids,
                        routing_weights, values_checked: bool, output_router_logits: bool, output_attentions,
                        output_hidden_states, return_dict, token_ids: dict):
        """The routed forward once the architecture checked its inputs' shapes (`batch` rows of `seq` positions):
        each row's task and decisions (`_route`), the token ids' values (`token_ids`, unless `values_checked`), the
        labels (`_prepare_labels`: no cache then), the decoding cache (`_routed_cache`), the dense model's own forward
        on `inputs` with the routes in the task context (recording by `_recording_flags`), the loss (`_token_loss`),
        and the output (`output_class`: the architecture's fields from `_stack_outputs`, the routing fields)."""
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        task_ids, routing_weights, router_logits = self._route(task_ids, routing_weights, batch, values_checked, cache)
        if not values_checked:  # else `BatchChecker` checked them on the host
            check_token_ids(token_table_sizes(self), **token_ids)
        if labels is not None:
            labels = self._prepare_labels(labels, inputs, seq, values_checked)
            use_cache = False
        if use_cache is None:
            use_cache = getattr(self.config.dense_config, "use_cache", True) and not self.training
        cache = self._routed_cache(cache) if use_cache else None
        if cache is not None:
            check_cache_rows(cache, batch)
        hidden = self.config.output_hidden_states if output_hidden_states is None else output_hidden_states
        attentions = self.config.output_attentions if output_attentions is None else output_attentions
        flags = self._routing_flags(routing_weights, cache, router_logits)
        # a list of indices (transformers' `output_hidden_states=[0, -1]`) selects among the hidden states
        flags.update(self._recording_flags(hidden if isinstance(hidden, (list, tuple)) else bool(hidden),
                                           bool(attentions)))
        self.task_context.begin(task_ids, inputs.get("attention_mask"), **flags)
        try:
            out = self.backbone(**inputs, use_cache=use_cache, return_dict=True, **{CACHE_ARG: cache})
        finally:
            recorded = flags["routing_recorder"].outputs() if "routing_recorder" in flags else {}
            self.task_context.end()
        loss, task_losses = None, None
        if labels is not None:
            loss, task_losses = self._token_loss(out.logits, labels, task_ids)
        output = self.output_class(
            loss=loss,
            logits=out.logits,
            task_losses=task_losses,
            task_ids=task_ids,
            **self._stack_outputs(out, recorded),
            **{CACHE_ARG: output_cache(out) if use_cache else None},
            **self._routing_outputs(task_ids, routing_weights, router_logits, output_router_logits),
        )
        return output if return_dict else output.to_tuple()

    def _prepare_labels(self, labels: torch.Tensor, inputs: dict, seq: int | None, values_checked: bool):
        """The labels checked (their values unless `values_checked`), as the loss reads them; `inputs` (the dense
        model's) may take what they make (an encoder-decoder's decoder inputs)."""
        raise NotImplementedError

    def _recording_flags(self, hidden, attentions: bool) -> dict:
        """The context flags that record the hidden states (True, or a list of indices) and attentions asked for:
        transformers records them with hooks on the layer classes, which would record each expert on its own."""
        raise NotImplementedError

    def _stack_outputs(self, out, recorded: dict) -> dict:
        """The output's hidden-state and attention fields, from the dense model's output or the routed recording."""
        raise NotImplementedError

    def _token_loss(self, logits, labels, task_ids):
        """Token cross-entropy, mean over the batch's target tokens, weighted per task; each task's own mean."""
        return Seq2Seq.task_token_loss(logits, labels, task_ids, self.config.task_specs)

    def _route(self, task_ids, routing_weights, batch: int, values_checked: bool, cache=None):
        """The checks and decisions every routed forward starts with: each row's task id (its values read back only
        when `values_checked` is False), then the router's decisions `(batch, routed layers, experts)` and logits, or
        the `routing_weights` given (checked; logits None). A decoding step of a generation that planned its routes
        (`cache.kept_routes`, kept with the plan at the first step: a row's task does not change while it decodes)
        takes the first step's decisions instead of running the router again."""
        task_ids = resolve_task_ids(task_ids, batch, self.config.task_names, self.device, not values_checked)
        if routing_weights is None:
            kept = getattr(cache, "kept_routes", None)
            if kept is not None and kept[0].shape[0] == batch and not self.training:
                return (task_ids, *kept)
            return (task_ids, *self.router(task_ids))
        expected = (batch, self.config.num_routed_layers, self.config.num_experts)
        if tuple(routing_weights.shape) != expected:
            raise ValueError(
                f"`routing_weights` must have shape (batch, routed layers, experts) = {expected}, got "
                f"{tuple(routing_weights.shape)}."
            )
        return task_ids, routing_weights, None

    def _routing_outputs(self, task_ids, routing_weights, router_logits, output_router_logits: bool) -> dict:
        """The routing fields of the output: `routing_decisions`, `router_logits` and `routing_counts` `(routed layers,
        tasks, experts)` (the sum of each task's rows' decisions), when asked for."""
        if not output_router_logits:
            return {}
        decisions = routing_weights.detach().float()
        counts = decisions.new_zeros(self.config.num_tasks, *decisions.shape[1:]).index_add_(0, task_ids, decisions)
        return dict(
            routing_decisions=routing_weights, router_logits=router_logits, routing_counts=counts.transpose(0, 1)
        )

    def _build_router(self, config) -> None:
        self.router = TaskRouter(
            config.num_tasks, config.task_dim, config.router_hidden, config.num_routed_layers, config.num_experts,
            router_type=config.router_type, selection=config.selection, num_heads=config.router_attention_heads,
        )
        self.router.temperature = config.gumbel_temperature

    def _init_router_weights(self, module) -> bool:
        """The paper's initialisation of the router's modules; True when `module` was one of them."""
        config = self.config
        if isinstance(module, TaskEmbedding):
            init.normal_(module.weight, mean=0.0, std=config.task_embedding_init_std)  # (h) random representations
            return True
        if isinstance(module, TaskRouter):
            init.zeros_(module.disabled)  # a non-persistent buffer: loading does not fill it
            return True
        if isinstance(module, nn.Linear) and any(module is m for m in self.router.net.modules()):
            init.normal_(module.weight, mean=0.0, std=config.router_std)
            init.zeros_(module.bias)
            return True
        return False

    #: whether a forward (not a generation step, which reuses its cache's plan) plans its routes on the host:
    #: each routed layer then runs only the experts its rows use, each on its rows (one host read of the decisions
    #: per forward; none under capture or compile, nor in straight-through training, where every expert runs); False:
    #: every expert runs on every row, mixed by the decisions, and the forward reads nothing back
    plans_forward_routes: bool = False
    #: generation under hard routes: True, a routed layer whose rows use several experts runs them as one layer, one
    #: grouped GEMM per linear over the experts' row segments (`layers.grouped_routes`: a decoding step's launches are
    #: the dense model's); False, one layer call per expert used, each on its rows (fewer copies: faster on a CPU,
    #: where the arithmetic is the cost); "auto", the first off the CPU
    group_hard_routes: bool | str = "auto"
    #: set by an encoder-decoder's `generate(every_expert=True)` for the call: its encoder and every decoding step run
    #: every expert on every row, mixed by the decisions (the reference the planned path is tested against)
    _every_expert_generation: bool = False

    def _groups_hard_routes(self, device: torch.device) -> bool:
        """`group_hard_routes` resolved for a generation on `device`."""
        return self.group_hard_routes is True or (self.group_hard_routes == "auto" and device.type != "cpu")

    def _generation_cache(self, kwargs: dict, every_expert: bool):
        """The cache a `generate` call decodes with: the one in `kwargs`, else `new_cache()` (put in `kwargs`),
        prepared for the call. An empty cache of per-expert slots (`SlotRows`) plans each layer's experts from the
        first step's decisions under hard routes; with low-rank experts (one copy of each layer, a plain cache) an
        empty one keeps each linear's rows' factors from the first step on (`_routing_flags`), and a filled one, whose
        rows this call did not start, keeps none."""
        cache = pop_cache(dict(kwargs))
        if cache is None:
            kwargs[CACHE_ARG] = cache = self.new_cache()
        if isinstance(cache, SlotRows) and cache.get_seq_length() == 0:
            cache.plans_routes = not every_expert  # hard routes: each layer runs only the experts its rows use
        elif self.config.low_rank and cache is not None:
            cache.kept_routes, cache.expert_rows = None, {} if cache.get_seq_length() == 0 else None
        return cache

    def _generate(self, generate, input_ids, cache, given_task_ids, kwargs: dict):
        """`generate(input_ids=input_ids, **kwargs)` (`kwargs` holding the resolved `task_ids`), on the rows sorted by
        task where the grouped layers run the hard routes (`task_sorted_generate`: their segments are then runs of the
        batch, nothing gathered). The tasks are read on the host where they were given there (a list, a CPU tensor:
        `given_task_ids`), else once from the device."""
        if input_ids is None or not getattr(cache, "plans_routes", False) or \
                not self._groups_hard_routes(input_ids.device):
            return generate(input_ids=input_ids, **kwargs)
        given = given_task_ids
        host = given.tolist() if isinstance(given, torch.Tensor) else given
        if not (isinstance(host, list) and all(isinstance(t, int) for t in host)):
            resolved = kwargs.get("task_ids")
            host = resolved.tolist() if resolved is not None else None
        return task_sorted_generate(generate, input_ids, kwargs, host,
                                    kwargs.get("generation_config") or self.generation_config)

    def _routing_flags(self, routing_weights: torch.Tensor, cache=None, router_logits=None) -> dict:
        """What the routed layers read from the context: the decisions and the plan. In generation (`cache` a
        `SlotRows` cache that `generate` made: `ExpertRowsCache`, `RoutedCache`) the plan of the routes, made from
        the decisions at the first step (one host read per `generate` call) and kept on the cache for the later
        steps, which read nothing; else the forward's plan (`plans_forward_routes`)."""
        if self.config.low_rank:
            # one copy of each layer runs on every row (plan: its one "expert"); its linears add the deltas by the
            # path the configuration and state choose (`layers.low_rank.expert_path`), nothing read back
            path = expert_path(self.config.selection, self.router.needs_every_expert, router_logits is None)
            plan = [[PlanEntry(0, None, False)] for _ in range(routing_weights.shape[1])]
            flags = {"routing_weights": routing_weights, "routing_plan": plan, "expert_path": path}
            rows = getattr(cache, "expert_rows", None)  # a generation's (`generate` puts it on its empty cache)
            if rows is not None and path == "one" and not self.training and not is_capturing():
                # the rows' routes are fixed while they decode: the later steps take these decisions (`_route`) and
                # each linear gathers its rows' factors once (`LowRankExperts.row_factors`), not at every step
                if getattr(cache, "kept_routes", None) is None:
                    cache.kept_routes = (routing_weights, router_logits)
                flags["expert_rows"] = rows
            return flags
        if self._every_expert_generation:  # `generate(every_expert=True)`: the reference path, nothing read back
            return {"routing_weights": routing_weights, "routing_plan": every_expert_plan(*routing_weights.shape[1:])}
        plan = None
        if isinstance(cache, SlotRows) and not self.training and not is_capturing():
            batch = routing_weights.shape[0]
            if cache.routing_plan is None and cache.plans_routes and cache.get_seq_length() == 0:
                grouped = self._groups_hard_routes(routing_weights.device)
                cache.routing_plan, cache.plan_batch = hard_route_plan(routing_weights, grouped), batch
                cache.kept_routes = (routing_weights, router_logits)  # the later steps' decisions (`_route`)
            if cache.routing_plan is not None:
                if cache.plan_batch != batch:
                    raise ValueError(
                        f"This cache was filled for {cache.plan_batch} rows, each routed expert keeping its own rows; "
                        f"got {batch} rows. Continue decoding with the rows (and task ids) it was filled with."
                    )
                plan = cache.routing_plan
        if plan is None:
            every = not self.plans_forward_routes or (router_logits is not None and self.router.needs_every_expert)
            plan = plan_routes(routing_weights, every_expert=every)
        return {"routing_weights": routing_weights, "routing_plan": plan}

    def apply_freezing(self) -> None:
        """Freeze the task representations when `config.freeze_task_embeddings` (section 5.1 (m)); with low-rank
        experts and `train_base=False`, freeze every dense weight too (all but the deltas and the router)."""
        config = self.config
        if config.low_rank and not config.train_base:
            for name, param in self.named_parameters():
                param.requires_grad_(name.startswith("router.") or name.endswith((".lora_A", ".lora_B")))
        self.router.task_embeddings.weight.requires_grad_(not config.freeze_task_embeddings)

    def set_training_step(self, step: int) -> None:
        """Anneal the Gumbel temperature (`MultiTaskTrainer` calls this every step)."""
        c = self.config
        self.router.temperature = annealed_temperature(
            step, c.gumbel_temperature, c.gumbel_min_temperature, c.gumbel_anneal_rate
        )

    @torch.no_grad()
    def task_routing(self, tasks: list[str] | None = None) -> torch.Tensor:
        """Evaluation-time decisions `D` of every task (or the named ones): `(tasks, routed layers, experts)`,
        without Gumbel noise (the routes `generate` and evaluation use)."""
        ids = None if tasks is None else self.task_ids_for(tasks)
        return self.router.task_decisions(ids, training=False).float().cpu()

    def _route_index(self, layer: int | str) -> int:
        names = self.config.route_names
        if isinstance(layer, str):
            if layer not in names:
                raise ValueError(f"Unknown routed layer {layer!r}; the routed layers are {names}.")
            return names.index(layer)
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < len(names):
            raise ValueError(f"Routed layer must be a name in {names} or an index in [0, {len(names)}), got {layer!r}.")
        return layer

    def disable_experts(self, experts: list[tuple[int | str, int]]) -> None:
        """Disable experts at evaluation (section 6.2): `(layer, expert)` pairs, the layer a name of
        `config.route_names` or a routed-layer index; the next-best expert of that layer is chosen instead."""
        mask = self.router.disabled.clone()
        for layer, expert in experts:
            index = self._route_index(layer)
            if isinstance(expert, bool) or not isinstance(expert, int) or not 0 <= expert < self.config.num_experts:
                raise ValueError(f"Expert must be an index in [0, {self.config.num_experts}), got {expert!r}.")
            mask[index, expert] = True
        full = mask.all(-1)
        if full.any():
            raise ValueError(
                f"Cannot disable every expert of routed layer {self.config.route_names[int(full.nonzero()[0])]}."
            )
        self.router.disabled.copy_(mask)

    def enable_experts(self) -> None:
        self.router.disabled.zero_()

    @contextlib.contextmanager
    def experts_disabled(self, experts: list[tuple[int | str, int]]):
        """`with model.experts_disabled([("D1", 2)]): ...`: disable for the block, then restore."""
        saved = self.router.disabled.clone()
        self.disable_experts(experts)
        try:
            yield self
        finally:
            self.router.disabled.copy_(saved)

    def _grow_for_task(self, new_id: int, source: int | None) -> None:
        """A task representation for the new task (the router and experts are shared)."""
        self.router.task_embeddings = grow_embedding(
            self.router.task_embeddings, new_id, source, self.config.task_embedding_init_std
        )

    def set_task_embeddings(self, embeddings: torch.Tensor) -> None:
        """Initialise the task representations with a `(tasks, task_embedding_dim)` tensor, in task-id order."""
        weight = self.router.task_embeddings.weight
        if tuple(embeddings.shape) != tuple(weight.shape):
            raise ValueError(
                f"Task embeddings must have shape (tasks, task_embedding_dim) = {tuple(weight.shape)}, got "
                f"{tuple(embeddings.shape)}."
            )
        with torch.no_grad():
            weight.copy_(embeddings.to(weight.dtype))

    def set_task_embedding(self, task: str | int, embedding: torch.Tensor) -> None:
        """Set one task's representation (`(task_embedding_dim,)`), e.g. the TextEmb of a task added with
        `add_task`: its routes are then what the router makes of its data (Ye et al. section 7)."""
        weight = self.router.task_embeddings.weight
        row = self.task_id(task) if isinstance(task, str) else task
        if tuple(embedding.shape) != (weight.shape[1],):
            raise ValueError(f"A task embedding must have shape ({weight.shape[1]},), got {tuple(embedding.shape)}.")
        with torch.no_grad():
            weight[row].copy_(embedding.to(weight.dtype))

    def hard_route(self, task: str, force_argmax: bool = False) -> list[int]:
        """The expert each routed layer uses for `task` (its evaluation route); a soft route is refused unless
        `force_argmax` (then the arg-max experts, and an export's outputs differ from this model's)."""
        decisions = self.task_routing([task])[0]  # (routed layers, experts)
        one_hot = bool(((decisions == 0) | (decisions == 1)).all()) and bool((decisions.sum(-1) == 1).all())
        if not one_hot and not force_argmax:
            raise ValueError(
                f"Task {task!r} has a soft route (selection {self.config.selection!r}): a plain model holds one layer "
                "per position. Use selection='gumbel_softmax_st' or 'hard', or pass force_argmax=True to keep the "
                "arg-max experts."
            )
        return decisions.argmax(-1).tolist()


def _merged_low_rank(layer: nn.Module, rest: str, expert: int | None) -> torch.Tensor | None:
    """The dense weight `rest` (relative to `layer`) of a linear holding low-rank experts, with expert `expert`'s delta
    merged (`weight`; None: no delta, the base's) or as it is (`bias`); None when `rest` is not such a linear's."""
    path, _, leaf = rest.rpartition(".")
    try:
        module = layer.get_submodule(path)
    except AttributeError:
        return None
    if not isinstance(module, LowRankExperts):
        return None
    with torch.no_grad():
        base = getattr(module.base_layer, leaf)
        if leaf != "weight" or expert is None:
            return base.detach().clone()
        return base + module.delta_weight(expert).to(base.dtype)
