"""BartTaskRouted: task-level mixture of experts over BART layers (Ye et al. 2022, sections 4-5).

Every routed encoder and decoder layer of a `BartForConditionalGeneration` is forked into `m` experts (each
a whole BART layer); a `TaskRouter` turns the task's embedding into decisions `D` and layer `i` outputs
`sum_j D_ij E^(i,j)(h)` (eq. 1). The model is a `BartForConditionalGeneration` otherwise: same embeddings,
LM head, loss and `generate()`, which takes `task_ids`.

Layout of the weights: `model.encoder.layers.<i>.experts.<j>.*` (a plain layer is `experts.0`), the router
under `router.*`. Decoder experts keep their own key/value cache slot (slot 0 only records the decoded
length), so generation with beam search works with every route.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
import os
from dataclasses import dataclass

import torch
from torch import nn
from transformers import AutoModelForSeq2SeqLM, BartConfig, BartForConditionalGeneration, PreTrainedModel
from transformers import initialization as init
from transformers.cache_utils import Cache, EncoderDecoderCache
from transformers.modeling_outputs import Seq2SeqLMOutput
from transformers.models.bart.modeling_bart import BartDecoderLayer, BartEncoderLayer, shift_tokens_right
from transformers.utils import ModelOutput, TransformersKwargs

from ...compat import CACHE_ARG, is_exporting, output_cache, pop_cache
from ...contract import TASK_ROUTING_ROLES
from ...layers.routing import (
    RoutedCache,
    RoutedLayer,
    RouteRecorder,
    TaskEmbedding,
    TaskRouter,
    annealed_temperature,
    plan_routes,
)
from ...modeling_utils import (
    MultiTaskPreTrainedModel,
    check_batch_dim,
    check_generation_cache,
    check_generation_counts,
    check_kwargs,
    check_lengths,
    check_token_ids,
    grow_embedding,
    resolve_task_ids,
    token_table_sizes,
)
from ...problem_types.seq2seq import Seq2Seq
from ...tasks import TaskSpec
from .configuration_bart_task_routed import DENSE_BART_FIELDS, BartTaskRoutedConfig


@dataclass
class TaskRoutedSeq2SeqOutput(Seq2SeqLMOutput):
    """`Seq2SeqLMOutput` plus, as in every family's output: `task_losses` (each task's mean token loss),
    `task_ids`, and with `output_router_logits=True` the routing: `routing_decisions` and `router_logits`,
    both `(batch, routed layers, experts)` (the row's task's decisions `D` and logits `L`), and
    `routing_counts` `(routed layers, tasks, experts)`: the sum of each task's rows' decisions (examples per
    expert for hard routes), as `RoutingStatistics` and the routing analytics read them."""

    task_losses: dict[str, torch.FloatTensor] | None = None
    task_ids: torch.LongTensor | None = None
    routing_decisions: torch.FloatTensor | None = None
    router_logits: torch.FloatTensor | None = None
    routing_counts: torch.FloatTensor | None = None


#: tokens `generate()` produces by default after the decoder start token: XSum summaries run to 30-60 tokens,
#: and transformers' own default of 20 positions cuts them off.
DEFAULT_MAX_NEW_TOKENS = 64


def _forwarded_kwargs() -> frozenset[str]:
    """Keyword arguments transformers may hand a model's `forward` (generation, attention back-ends, the Trainer),
    read from the installed release: BART's own `forward` and `TransformersKwargs`; anything else is refused."""
    names = set(inspect.signature(BartForConditionalGeneration.forward).parameters) | set(
        TransformersKwargs.__annotations__
    )
    # names earlier 5.x releases passed (the signatures above no longer list them there)
    names |= {"cache_position", "decoder_position_ids", "head_mask", "decoder_head_mask", "cross_attn_head_mask"}
    return frozenset(names - {"self", "kwargs"})


_TRANSFORMERS_KWARGS = _forwarded_kwargs()


def apply_generation_convention(generation_config, config, max_new_tokens: int | None = None):
    """The one target / generation convention of this family, written into a `GenerationConfig`.

    Targets are the text's tokens and the end token, with no leading BOS or [CLS] (`target_token_ids`); the
    decoder starts from `decoder_start_token_id` (BART: `</s>`; `bart_from_bert`: [CLS]) in training (labels
    shifted right) and in `generate()`, which stops at `eos_token_id` (BART: `</s>`; BERT vocabularies: [SEP]).
    So no BOS is forced after the start token (pretrained BART forces `<s>`; its targets began with `<s>`)."""
    generation_config.decoder_start_token_id = config.decoder_start_token_id
    generation_config.eos_token_id = config.eos_token_id
    generation_config.pad_token_id = config.pad_token_id
    generation_config.bos_token_id = config.bos_token_id
    generation_config.forced_bos_token_id = None
    # as max_new_tokens, not max_length: a user's `generate(max_new_tokens=...)` then replaces it without a warning
    if max_new_tokens is not None or generation_config.max_new_tokens is None:
        generation_config.max_new_tokens = max_new_tokens or DEFAULT_MAX_NEW_TOKENS
    if generation_config.max_length == 20:  # transformers' old default, which would clash with max_new_tokens
        generation_config.max_length = None
    return generation_config


def _named_outputs(module, args, kwargs):
    """A forward pre-hook: the module returns a `ModelOutput` whatever `config.return_dict` says (its caller inside
    BART reads fields by name; the model's own `forward` applies `return_dict` once, at the end)."""
    kwargs["return_dict"] = True
    return args, kwargs


#: what an export of the model or of its encoder without `values_checked=True` is told
_EXPORT_NEEDS_CHECKED = (
    "An exported program cannot check values: export BartTaskRouted (or its encoder, `model.get_encoder()`, which "
    "takes `task_ids`) with `values_checked=True`, and check each batch's task ids on the host before it runs."
)


def _route_index(config: BartTaskRoutedConfig, layer: int | str) -> int:
    names = config.route_names
    if isinstance(layer, str):
        if layer not in names:
            raise ValueError(f"Unknown routed layer {layer!r}; the routed layers are {names}.")
        return names.index(layer)
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < len(names):
        raise ValueError(f"Routed layer must be a name in {names} or an index in [0, {len(names)}), got {layer!r}.")
    return layer


class BartTaskRouted(MultiTaskPreTrainedModel, BartForConditionalGeneration):
    r"""
    BART with task-level routing over forked layers. `forward(..., task_ids=...)` and
    `generate(input_ids, task_ids=..., num_beams=...)` take one task id per row (index into `config.tasks`);
    a batch may mix tasks.

    Build one from a dense BART with `BartTaskRouted.from_dense("facebook/bart-base", tasks)` (experts start as
    the dense layer plus N(0, 1e-8) noise, section 5.2), or from a BERT checkpoint through `bart_from_bert`.
    """

    config_class = BartTaskRoutedConfig
    records_task_order = True
    #: transformers Auto classes this model is registered with (and named in an export's `auto_map`)
    auto_classes = ("AutoModel", "AutoModelForSeq2SeqLM")
    _no_split_modules = ["RoutedLayer"]
    # parameter roles (`parameter_report`, optimizer groups of `MultiTaskTrainingArguments.group_learning_rates`)
    # a BART's `final_logits_bias` (a buffer) is new on upcycling too when the dense model lacks one
    parameter_roles = dataclasses.replace(TASK_ROUTING_ROLES, also_new=(r"^final_logits_bias$",))

    def __init__(self, config: BartTaskRoutedConfig):
        super().__init__(config)
        m = config.num_experts
        encoder_routes, decoder_routes = config.encoder_route_layers, config.decoder_route_layers
        route = 0
        layers = []
        for i, layer in enumerate(self.model.encoder.layers):
            if i in encoder_routes:
                layers.append(
                    RoutedLayer([layer] + [BartEncoderLayer(config, layer_idx=i) for _ in range(m - 1)], route)
                )
                route += 1
            else:
                layers.append(RoutedLayer([layer], None))
        self.model.encoder.layers = nn.ModuleList(layers)
        slot = 1  # decoder cache slot of each expert; slot 0 records the decoded length (see `forward`)
        layers = []
        for i, layer in enumerate(self.model.decoder.layers):
            experts = [layer] + (
                [BartDecoderLayer(config, layer_idx=i) for _ in range(m - 1)] if i in decoder_routes else []
            )
            for expert in experts:
                expert.self_attn.layer_idx = expert.encoder_attn.layer_idx = slot
                slot += 1
            layers.append(RoutedLayer(experts, route if i in decoder_routes else None))
            route += int(i in decoder_routes)
        self.model.decoder.layers = nn.ModuleList(layers)
        self.router = TaskRouter(
            config.num_tasks, config.task_dim, config.router_hidden, config.num_routed_layers, m,
            router_type=config.router_type, selection=config.selection, num_heads=config.router_attention_heads,
        )
        self.router.temperature = config.gumbel_temperature
        # the encoder and decoder are BART's own modules: torch hooks (a public seam) give them the routes when
        # `generate` runs the encoder by itself, and record hidden states and attentions per routed layer
        for stack in (self.model.encoder, self.model.decoder):
            stack.register_forward_pre_hook(self._stack_pre_hook, with_kwargs=True)
            stack.register_forward_hook(self._stack_post_hook, with_kwargs=True)
        # BartForConditionalGeneration reads BartModel's output by name: `config.return_dict=False` applies in `forward`
        self.model.register_forward_pre_hook(_named_outputs, with_kwargs=True)
        self.post_init()
        apply_generation_convention(self.generation_config, config)
        self.apply_freezing()

    def apply_freezing(self) -> None:
        """Freeze the task representations when `config.freeze_task_embeddings` (section 5.1 (m))."""
        self.router.task_embeddings.weight.requires_grad_(not self.config.freeze_task_embeddings)

    def _init_weights(self, module):
        super()._init_weights(module)  # BART's: Linear/Embedding N(0, init_std), LayerNorm 1/0
        config = self.config
        if isinstance(module, TaskEmbedding):
            init.normal_(module.weight, mean=0.0, std=config.task_embedding_init_std)  # (h) random representations
        elif isinstance(module, TaskRouter):
            init.zeros_(module.disabled)  # a non-persistent buffer: loading does not fill it
        elif (
            isinstance(module, nn.Linear)
            and hasattr(self, "router")
            and any(module is m for m in self.router.net.modules())
        ):
            init.normal_(module.weight, mean=0.0, std=config.router_std)
            init.zeros_(module.bias)

    def _after_load(self) -> None:
        self.apply_freezing()  # loading recreates the parameters

    # ------------------------------------------------------------------ routing
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

    def disable_experts(self, experts: list[tuple[int | str, int]]) -> None:
        """Disable experts at evaluation (section 6.2): their logit becomes -inf, so the next-best expert of
        that layer is chosen. `experts` holds `(layer, expert)` pairs, the layer as a name of
        `config.route_names` (`"E1"`, `"D3"`) or a routed-layer index. `enable_experts()` undoes it."""
        mask = self.router.disabled.clone()
        for layer, expert in experts:
            index = _route_index(self.config, layer)
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
        """`with model.experts_disabled([("E1", 2)]): ...`: disable for the block, then restore."""
        saved = self.router.disabled.clone()
        self.disable_experts(experts)
        try:
            yield self
        finally:
            self.router.disabled.copy_(saved)

    def _grow_for_task(self, new_id: int, source: int | None) -> None:
        """A task representation for the new task (the router and experts are shared): task `source`'s, or drawn
        like at construction (N(0, task_embedding_init_std)); its routes are what the router makes of it."""
        self.router.task_embeddings = grow_embedding(
            self.router.task_embeddings, new_id, source, self.config.task_embedding_init_std
        )

    def set_task_embeddings(self, embeddings: torch.Tensor) -> None:
        """Initialise the task representations (TextEmb, FT-TextEmb, TaskEmb: `hf_taskmoe.analysis.task_embeddings`)
        with a `(tasks, task_embedding_dim)` tensor, in task-id order."""
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

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        decoder_input_ids: torch.LongTensor | None = None,
        decoder_attention_mask: torch.LongTensor | None = None,
        encoder_outputs=None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        decoder_inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        task_ids: torch.LongTensor | None = None,
        routing_weights: torch.Tensor | None = None,
        output_router_logits: bool = False,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        values_checked: bool = False,
        **kwargs,
    ) -> TaskRoutedSeq2SeqOutput | tuple:
        r"""
        task_ids (`torch.LongTensor` of shape `(batch,)`):
            Each row's task (index into `config.tasks`); optional for a one-task model.
        labels (`torch.LongTensor` of shape `(batch, target_length)`):
            Target token ids, `-100` where ignored; the decoder inputs are the labels shifted right.
        cache (`Cache`, *optional*):
            The key/value cache this model returned (a `RoutedCache`: one slot per decoder expert); also accepted
            as `past_key_values`. An empty cache of another class (what `generate` makes) is replaced by one.
        routing_weights (`torch.Tensor` of shape `(batch, routed layers, experts)`, *optional*):
            Decisions to use instead of the router's (analysis).
        output_router_logits (`bool`, *optional*):
            Return `routing_decisions` and `router_logits`.
        output_attentions / output_hidden_states (`bool`, *optional*, default from the config):
            Per layer, as BART returns them; a routed layer gives its mixed output and the mixture of its experts'
            attention probabilities (a hard route: the chosen expert's). Such a mixture is computed beside the
            forward, which used each expert's own probabilities: a gradient taken with respect to it is None (an
            expert whose output is not scaled -- a hard route at evaluation, a plain layer -- returns its own tensor).
        values_checked (`bool`, *optional*, defaults to `False`):
            The task ids and target ids were checked on the host where the batch was made: their values are not
            read back here (no host sync). The result is the same. Export the model (and its encoder, which takes
            `task_ids` and `values_checked` too) with `values_checked=True`: `hf_taskmoe.onnx_export.export_program(
            model, part="encoder" | "decoder_step")`.
        """
        kwargs.pop("token_type_ids", None)  # a BERT tokenizer's segment ids: BART has no segment embeddings
        cache = pop_cache({"cache": cache, "past_key_values": kwargs.pop("past_key_values", None)})
        check_kwargs({k: v for k, v in kwargs.items() if k not in _TRANSFORMERS_KWARGS}, self.forward)
        if is_exporting() and not values_checked:
            raise ValueError(_EXPORT_NEEDS_CHECKED)
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        reference = next(
            (t for t in (input_ids, inputs_embeds, decoder_input_ids, decoder_inputs_embeds, labels) if t is not None),
            None,
        )
        if reference is None and encoder_outputs is not None:
            reference = encoder_outputs[0]
        if reference is None:
            raise ValueError("Pass `input_ids` (or `inputs_embeds`, or `encoder_outputs` with decoder inputs).")
        batch = reference.shape[0]
        limit = self.config.max_position_embeddings
        for name, tensor in (("input", input_ids if input_ids is not None else inputs_embeds), ("target", labels),
                             ("decoder input", decoder_input_ids if cache is None else None)):
            if tensor is not None:
                check_lengths(tensor.shape[0], tensor.shape[1] if tensor.dim() > 1 else 1, limit, name)
        check_batch_dim(batch, attention_mask=attention_mask, labels=labels, decoder_input_ids=decoder_input_ids)
        task_ids = resolve_task_ids(task_ids, batch, self.config.task_names, self.device, not values_checked)
        if not values_checked:  # else `BatchChecker` checked them on the host
            check_token_ids(token_table_sizes(self), input_ids=input_ids, decoder_input_ids=decoder_input_ids)
        router_logits = None
        if routing_weights is None:
            routing_weights, router_logits = self.router(task_ids)
        elif tuple(routing_weights.shape) != (batch, self.config.num_routed_layers, self.config.num_experts):
            raise ValueError(
                f"`routing_weights` must have shape (batch, routed layers, experts) = "
                f"{(batch, self.config.num_routed_layers, self.config.num_experts)}, got "
                f"{tuple(routing_weights.shape)}."
            )
        if labels is not None:
            if labels.dim() != 2:
                raise ValueError(f"`labels` must have shape (batch, target_length), got {tuple(labels.shape)}.")
            if not values_checked:
                Seq2Seq.check_target_ids(labels, self.config.vocab_size)
            use_cache = False
            if decoder_input_ids is None and decoder_inputs_embeds is None:
                decoder_input_ids = shift_tokens_right(
                    labels, self.config.pad_token_id, self.config.decoder_start_token_id
                )
        if use_cache is None:
            use_cache = self.config.use_cache and not self.training
        cache = self._routed_cache(cache) if use_cache else None
        # which experts run on which rows, for every routed layer at once (the forward's one host sync)
        plan = plan_routes(routing_weights, every_expert=router_logits is not None and self.router.needs_every_expert)
        flags = {
            k: v
            for k, v in (("output_attentions", output_attentions), ("output_hidden_states", output_hidden_states))
            if v is not None
        }
        out = super().forward(
            input_ids=input_ids,
            attention_mask=attention_mask,
            decoder_input_ids=decoder_input_ids,
            decoder_attention_mask=decoder_attention_mask,
            encoder_outputs=encoder_outputs,
            inputs_embeds=inputs_embeds,
            decoder_inputs_embeds=decoder_inputs_embeds,
            use_cache=use_cache,
            routing_weights=routing_weights,
            routing_plan=plan,
            return_dict=True,
            **{CACHE_ARG: cache},
            **flags,
            **kwargs,
        )
        cache = output_cache(out)
        if isinstance(cache, EncoderDecoderCache):
            # slot 0: a zero-width record of the decoded positions (BART reads the past length from slot 0)
            steps = out.logits.shape[1]
            cache.self_attention_cache.update(
                out.logits.new_zeros(batch, 1, steps, 1), out.logits.new_zeros(batch, 1, steps, 1), 0
            )
        loss, task_losses = None, None
        if labels is not None:
            loss, task_losses = self._seq2seq_loss(out.logits, labels, task_ids)
        routing = {}
        if output_router_logits:
            decisions = routing_weights.detach().float()
            counts = decisions.new_zeros(self.config.num_tasks, *decisions.shape[1:]).index_add_(0, task_ids, decisions)
            routing = dict(
                routing_decisions=routing_weights, router_logits=router_logits, routing_counts=counts.transpose(0, 1)
            )
        output = TaskRoutedSeq2SeqOutput(
            loss=loss,
            logits=out.logits,
            encoder_last_hidden_state=out.encoder_last_hidden_state,
            encoder_hidden_states=out.encoder_hidden_states,
            encoder_attentions=out.encoder_attentions,
            decoder_hidden_states=out.decoder_hidden_states,
            decoder_attentions=out.decoder_attentions,
            cross_attentions=out.cross_attentions,
            task_losses=task_losses,
            task_ids=task_ids,
            **{CACHE_ARG: cache},
            **routing,
        )
        return output if return_dict else output.to_tuple()

    def _routed_cache(self, cache: Cache | None) -> RoutedCache:
        """The cache to decode with: the `RoutedCache` this model returned, or a new one in place of none or of an empty
        cache of another class (`generate` makes one sized by the config's layer count; ours has a slot per decoder
        expert, and an expert serving some rows only keeps those rows)."""
        if cache is None or isinstance(cache, RoutedCache):
            return cache if cache is not None else RoutedCache()
        if getattr(cache, "is_compileable", False):
            raise ValueError(
                f"BartTaskRouted cannot decode with a static cache ({type(cache).__name__}, `cache_implementation="
                f"'static'`): its decoder keeps one cache slot per expert, holding only the rows routed to it. Leave "
                "`cache_implementation` unset (the default dynamic cache)."
            )
        if cache.get_seq_length() > 0:
            raise ValueError(
                f"BartTaskRouted continues decoding only from the cache it returned (a RoutedCache), got a filled "
                f"{type(cache).__name__}."
            )
        return RoutedCache()

    # ------------------------------------------------------------------ the encoder's and decoder's hooks
    def _stack_pre_hook(self, stack, args, kwargs):
        """Before BART's encoder or decoder runs: routes for the encoder when `generate` calls it by itself (it passes
        the model's `task_ids` on), and a `RouteRecorder` in place of transformers' recording when hidden states or
        attentions are asked for (its hooks would record every expert of a routed layer separately)."""
        task_ids = kwargs.pop("task_ids", None)
        values_checked = kwargs.pop("values_checked", False)
        if stack is self.model.encoder and kwargs.get("routing_weights") is None:
            inputs = kwargs.get("input_ids", kwargs.get("inputs_embeds", args[0] if args else None))
            if inputs is not None:
                if is_exporting() and not values_checked:
                    raise ValueError(_EXPORT_NEEDS_CHECKED)
                task_ids = resolve_task_ids(task_ids, inputs.shape[0], self.config.task_names, self.device,
                                            check_values=not values_checked)
                kwargs["routing_weights"] = weights = self.router(task_ids)[0]
                kwargs["routing_plan"] = plan_routes(weights)
        hidden_states, attentions = (
            kwargs.pop(flag, None) for flag in ("output_hidden_states", "output_attentions")
        )
        hidden_states = self.config.output_hidden_states if hidden_states is None else hidden_states
        attentions = self.config.output_attentions if attentions is None else attentions
        kwargs["output_hidden_states"] = kwargs["output_attentions"] = False  # BART's recording off: ours below
        _named_outputs(stack, args, kwargs)  # BartModel reads its stacks' outputs by name
        if hidden_states or attentions:
            kinds = {"attentions": "self_attn"}
            if stack is self.model.decoder:
                kinds["cross_attentions"] = "encoder_attn"
            kwargs["routing_recorder"] = RouteRecorder(bool(hidden_states), bool(attentions), kinds)
        return args, kwargs

    @staticmethod
    def _stack_post_hook(stack, args, kwargs, output):
        recorder = kwargs.get("routing_recorder")
        if recorder is not None and isinstance(output, ModelOutput):
            for name, value in recorder.outputs().items():
                setattr(output, name, value)
        return output

    def _seq2seq_loss(self, logits, labels, task_ids):
        """Token cross-entropy, mean over the batch's target tokens (as BART), weighted per task; each task's mean."""
        return Seq2Seq.task_token_loss(logits, labels, task_ids, self.config.task_specs)

    # ------------------------------------------------------------------ generation
    def generate(self, *args, **kwargs):
        """`GenerationMixin.generate` with `task_ids` (one per row); the segment ids a BERT tokenizer returns are
        dropped (BART has no segment embeddings), so `model.generate(**tokenizer(texts), task_ids=...)` works."""
        kwargs.pop("token_type_ids", None)
        check_generation_counts(kwargs)
        check_generation_cache(self, kwargs)
        return super().generate(*args, **kwargs)

    # ------------------------------------------------------------------ building and exporting
    @classmethod
    def from_dense(
        cls,
        dense: str | os.PathLike | PreTrainedModel,
        tasks: list[TaskSpec | dict],
        expert_noise_variance: float = 1e-8,
        seed: int | None = 0,
        output_loading_info: bool = False,
        hub_kwargs: dict | None = None,
        **config_kwargs,
    ):
        """Fork every routed layer of a dense BART (`BartForConditionalGeneration` or path / repo id) into
        `num_experts` experts: expert `(i, j)` = layer `i` + Gaussian noise of variance `expert_noise_variance`
        (section 5.2; 0 makes every expert an exact copy, so average or softmax routing computes the dense
        model's output). Embeddings, LM head and plain layers are copied; the router is new.
        `**config_kwargs` are fields of `BartTaskRoutedConfig`. With `output_loading_info=True` returns
        `(model, UpcyclingReport)`."""
        from ...upcycling import DenseCheckpoint, upcycle

        if isinstance(dense, PreTrainedModel):
            source = getattr(dense.config, "name_or_path", "") or type(dense).__name__
            dense_model = dense
        else:
            dense_model = AutoModelForSeq2SeqLM.from_pretrained(dense, **(hub_kwargs or {}))
            source = str(dense)
        if not isinstance(dense_model, BartForConditionalGeneration):
            raise ValueError(
                f"`dense` must be a BartForConditionalGeneration (or its path), got {type(dense_model).__name__}."
            )
        config = BartTaskRoutedConfig.from_dense_config(dense_model.config, tasks, **config_kwargs)
        model = cls(config)
        report = upcycle(DenseCheckpoint(dense_model.model, source), model)
        with torch.no_grad():
            model.final_logits_bias.copy_(dense_model.final_logits_bias)
            if expert_noise_variance:
                generator = torch.Generator().manual_seed(seed) if seed is not None else None
                std = float(expert_noise_variance) ** 0.5
                for layer in [*model.model.encoder.layers, *model.model.decoder.layers]:
                    if layer.route_index is None:
                        continue
                    for p in layer.experts.parameters():
                        p.add_(torch.randn(p.shape, generator=generator).to(p.dtype) * std)
        model.generation_config = apply_generation_convention(copy.deepcopy(dense_model.generation_config), config)
        return (model, report) if output_loading_info else model

    def export_task(self, task: str, force_argmax: bool = False) -> BartForConditionalGeneration:
        """A plain `BartForConditionalGeneration` holding `task`'s route: each routed layer is replaced by the
        expert the task selects. It loads and runs without hf_taskmoe and gives this model's outputs for the
        task. The route must be hard (one expert per layer: `gumbel_softmax_st`, or experts disabled down
        to one); `force_argmax=True` takes the arg-max expert of a soft route (outputs then differ)."""
        decisions = self.task_routing([task])[0]  # (routed layers, experts)
        one_hot = bool(((decisions == 0) | (decisions == 1)).all()) and bool((decisions.sum(-1) == 1).all())
        if not one_hot and not force_argmax:
            raise ValueError(
                f"Task {task!r} has a soft route (selection {self.config.selection!r}): a plain BART holds one layer "
                "per position. Use selection='gumbel_softmax_st', or pass force_argmax=True to keep the arg-max "
                "experts."
            )
        chosen = decisions.argmax(-1).tolist()
        config = BartConfig(**{name: getattr(self.config, name) for name in DENSE_BART_FIELDS})
        config.hf_taskmoe_task = task
        dense = BartForConditionalGeneration(config).to(self.device, self.dtype)
        state = self.state_dict()
        routes = {}
        for stack in ("encoder", "decoder"):
            for i, layer in enumerate(getattr(self.model, stack).layers):
                routes[f"model.{stack}.layers.{i}."] = chosen[layer.route_index] if layer.route_index is not None else 0
        mapped = {}
        for name in dense.state_dict():
            source = name
            for prefix, expert in routes.items():
                if name.startswith(prefix):
                    source = f"{prefix}experts.{expert}.{name[len(prefix):]}"
                    break
            mapped[name] = state[source]
        dense.load_state_dict(mapped, strict=True)
        dense.generation_config = self.generation_config
        dense.eval()
        return dense
