"""TaskRoutedForSeq2SeqLM: task-level mixture of experts (Ye et al. 2022) over the encoder and decoder blocks of a
declared encoder-decoder (T5, mT5, UMT5, BART, mBART, Pegasus, Marian), wrapping the dense model's own blocks
(`hf_taskmoe.backbones.decoders` declares where they are).

The model holds the dense model itself (`AutoModelForSeq2SeqLM.from_config(config.dense_config)`: a
`T5ForConditionalGeneration`, ...) and forks its blocks in place, as the paper forks BART's layers: every routed block
becomes a `ContextRoutedLayer` -- a `T5RoutedBlock` where the blocks pass their position bias on
(`Backbone.relative_table_owner="first"`, T5 and mT5) -- holding `m` experts, each a whole copy of the block
(self-attention, cross-attention, FFN, norms). A `TaskRouter` turns each task's embedding into decisions `D`; block `i`
outputs `sum_j D_ij E^(i,j)(h)` (eq. 1). The dense model's own forward runs unchanged -- embeddings, masks, attention
kernels, final norms, the LM head and its scaling -- and its block loops call the routed blocks, which read the
decisions from the model's `TaskContext` (the router's layer axis: routed encoder blocks, then decoder blocks).

T5's relative position bias. A T5 block returns `(hidden states, self-attention bias, cross-attention bias)`; the first
block of each stack (`has_relative_attention_bias`) computes the self-attention bias from its own
`relative_attention_bias` table and the stack hands it to every later block. Here every expert copy of block 0 keeps its
own table (a whole-block copy, as the paper's) and computes its own bias; `T5RoutedBlock` assembles the bias per row
as it mixes the hidden states: each row gets `sum_j D_0j B^(0,j)` over the experts that run on it, `(batch, heads, q,
k)` (the chosen expert's own `(1, heads, q, k)`, unchanged, when one expert serves every row unscaled), and later
blocks give each expert the rows of it that it runs on. Under a hard route that is exactly the chosen expert's bias, so
a task's route is a plain T5 (what `export_task` builds, tested equal); under a soft route the bias is mixed like the
hidden states, a fixed function of the positions and the task, so decoding with the cache recomputes it exactly (each
copy of block 0 reads the past length from its own cache slot). The alternatives were weaker: keeping the dense block
0's table for all experts ties a parameter across experts (an exported route then needs expert 0's table beside
another expert's block), and leaving block 0 unforked departs from the paper's routing of every layer. The
cross-attention bias is zero in T5 (no block has a relative bias for it) and broadcast over the batch: the first
expert's is passed on.

Which experts run. The blocks follow the routing plan in the context, as the other routed layers do
(`ContextRoutedLayer`): a forward plans its routes on the host (`plans_forward_routes`: each expert on the rows that
use it; every expert on every row under straight-through training, capture and compile); `generate` under hard routes
takes the plan of the routes, made once per call (`hard_route_plan`), so each block runs one expert on a one-task
batch, and each expert of a mixed batch runs on its rows only (off the CPU, `group_hard_routes`, a mixed decoder block
runs as one grouped block over the experts' row segments, block 0 included: its rows' biases are computed from their
own experts' tables and passed in). Soft routes and `generate(every_expert=True)` run every expert on every row.

Generation with a key/value cache. Each expert copy of a decoder block has its own cache slot, for its self-attention
(the `EncoderDecoderCache`'s self-attention cache) and its cross-attention (the cross-attention cache): expert 0 keeps
the dense block's slot, the others get slots after the dense ones (`fork_layers`, both attentions' `layer_idx`). An
expert that runs on some rows keeps only those rows in its slots (`RoutedCache`, which translates beam search's
reordering into each slot's rows); a grouped block keeps every row in expert 0's slots. `generate` runs the encoder on
its own: a forward pre-hook on the encoder takes the `task_ids` that `generate` passes it and fills the context for
that call (with its own forward plan).

Weights: `backbone.<the dense model's own names>`, a routed block's `{encoder,decoder}.block.<i>.experts.<j>.*` (a plain
block is `experts.0`), the router under `router.*`.
"""

from __future__ import annotations

import torch
from transformers import AutoModelForSeq2SeqLM, GenerationMixin
from transformers.cache_utils import Cache, DynamicCache, EncoderDecoderCache
from transformers.utils import ModelOutput

from ...compat import T5_BLOCK_RETURNS_BIASES, is_exporting
from ...input_checks import (
    check_batch_dim,
    check_generation_cache,
    check_generation_counts,
    check_lengths,
    check_token_ids,
    resolve_task_ids,
    token_table_sizes,
)
from ...layers.routing import (
    ExpertRowsCache,
    RoutedCache,
    RouteRecorder,
    _rows,
)
from ...modeling_utils import MultiTaskPreTrainedModel
from ...problem_types.seq2seq import IGNORE_INDEX, Seq2Seq
from .configuration import BartTaskRoutedConfig, TaskRoutedSeq2SeqConfig
from .core import (
    DEFAULT_MAX_NEW_TOKENS,
    ContextRoutedLayer,
    TaskRoutedSeq2SeqOutput,
    TaskRoutingMixin,
    fork_layers,
)

__all__ = ["BartTaskRouted", "T5RoutedBlock", "TaskRoutedForSeq2SeqLM", "apply_generation_convention"]



#: what an export of the model or of its encoder without `values_checked=True` is told
EXPORT_NEEDS_CHECKED = (
    "An exported program cannot check values: export the model (or its encoder, `model.get_encoder()`, which takes "
    "`task_ids`) with `values_checked=True`, and check each batch's task ids on the host before it runs."
)


class T5RoutedBlock(ContextRoutedLayer):
    """A routed T5 block: called by T5's own stack loop with a `T5Block`'s arguments, it follows the routing plan in the
    context with the plan loop every routed layer runs (`RoutedLayer.run_plan`) and adds what a block passing its
    position biases needs: it returns `(hidden states, position bias, cross-attention bias)`. A block that computes the
    self-attention bias (block 0: each expert copy its own relative-position table, `relative_table`, the backbone's)
    assembles it per row: each expert's bias on its rows, scaled like its hidden states, a `(batch, heads, q, k)`
    tensor (the expert's own, broadcast over the batch, when one expert serves every row unscaled). A later block
    slices the bias it receives for each expert's rows (`call_on_rows`) and passes the whole one on. A plan's grouped
    layer (`group_hard_routes`: the experts' linears and norms as one block over their row segments) serves every
    block; block 0's copy does not run its relative-position table (expert 0's) but takes each row's bias, computed
    from the row's own expert's table (`_segment_biases`)."""

    #: path, in a block, of its self-attention's relative-position table (`Backbone.relative_table`); set by the model
    relative_table: str = ""

    def forward(self, hidden_states, attention_mask=None, position_bias=None, encoder_hidden_states=None,
                encoder_attention_mask=None, encoder_decoder_position_bias=None, **kwargs):
        args = (attention_mask, position_bias, encoder_hidden_states, encoder_attention_mask,
                encoder_decoder_position_bias)
        return self.run_from_context(hidden_states, args, kwargs)

    def _split_output(self, output):
        return output[0], output[1:]  # (hidden states), (position bias, cross-attention bias)

    def _mix_extras(self, total, extra, rows, share, batch, args):
        bias, cross = total if total is not None else (None, None)
        b, c = extra
        if args[1] is None:  # this block computes the bias (block 0): each expert its own, on its rows
            bias = _add_bias_rows(bias, b, rows, share, batch)
        if args[4] is None and c is not None:
            if c.shape[0] == 1:  # zero in T5 (no relative bias for cross-attention), broadcast: the first expert's
                cross = c if cross is None else cross
            else:
                cross = _add_bias_rows(cross, c, rows, share, batch)
        return bias, cross

    def _join_output(self, hidden_states, extras, args):
        bias, cross = extras if extras is not None else (None, None)
        # the biases the block received pass on as they are; those it computed are the mixed ones
        return (hidden_states, bias if args[1] is None else args[1], cross if args[4] is None else args[4])

    def _extra_rows(self, extra, inverse, batch):
        return tuple(_rows(b, inverse, batch) for b in extra)  # computed per sorted row

    def _computes_bias(self, args: tuple) -> bool:
        """Whether this call computes the self-attention bias from the block's table (block 0, no bias passed in)."""
        return args[1] is None and self._has_relative_table()

    def _grouped_unused(self, args):
        # block 0: its experts' relative-position tables differ; the copy does not run its own (expert 0's)
        return (self.relative_table,) if self._computes_bias(args) else ()

    def _grouped_args(self, entries, hidden_states, args, cache):
        if not self._computes_bias(args):
            return args
        # each row's bias, from its own expert's table, read at the past length before the block writes its slot
        return (args[0], self._segment_biases(entries, hidden_states.shape[1], cache), *args[2:])

    def _has_relative_table(self) -> bool:
        """Whether this block computes the self-attention bias from a relative-position table (T5's block 0)."""
        attention = self.experts[0].get_submodule(self.relative_table.rpartition(".")[0])
        return bool(getattr(attention, "has_relative_attention_bias", False))

    def _segment_biases(self, entries, query_length: int, cache) -> torch.Tensor:
        """The self-attention bias of each row of a grouped block 0 (`entries`: a `GroupedRoute`), from its own
        expert's relative-position table, `(batch, heads, q, k)` in the batch's order: what each expert's
        attention computes for its rows (`compute_bias` at the past length of the block's cache slot, read before
        the block writes it, as T5's attention reads it)."""
        slot = self.cache_slot(0)
        past = cache.get_seq_length(slot) if cache is not None and slot is not None else 0
        device = next(iter(self.experts[0].parameters())).device
        own: dict[int, torch.Tensor] = {}
        parts = []
        for expert, rows in entries.segments:
            if expert not in own:  # (1, heads, q, k)
                attention = self.experts[expert].get_submodule(self.relative_table.rpartition(".")[0])
                own[expert] = attention.compute_bias(query_length, past + query_length, device=device,
                                                     past_seen_tokens=past)
            parts.append(own[expert].expand(rows, -1, -1, -1))
        bias = torch.cat(parts)  # the segments' rows: sorted by expert, or runs of the batch's order
        return bias if entries.order is None else bias.index_select(0, entries.inverse)


def _add_bias_rows(total: torch.Tensor | None, bias: torch.Tensor, rows: torch.Tensor | None,
                   share: torch.Tensor | None, batch: int) -> torch.Tensor:
    """`total` plus an expert's attention bias on its `rows` (None: every row), scaled by the rows' `share` (None:
    not scaled). `bias` is `(rows or 1, heads, q, k)` (T5 computes a relative bias once for every row); the sum is
    `(batch, heads, q, k)`, or the expert's own bias unchanged when it is the only one and covers every row."""
    if share is not None:
        bias = bias * share.to(bias.dtype)[:, None, None, None]  # (rows, heads, q, k)
    if rows is None:
        return bias if total is None else total + bias
    bias = bias.expand(rows.shape[0], *bias.shape[1:])
    if total is None:
        total = bias.new_zeros(batch, *bias.shape[1:])
    elif total.shape[0] != batch:  # an earlier expert's bias of every row, broadcast: now per row
        total = total.expand(batch, *total.shape[1:]).clone()
    return total.index_add(0, rows, bias)


class TaskRoutedForSeq2SeqLM(TaskRoutingMixin, MultiTaskPreTrainedModel, GenerationMixin):
    r"""
    A T5 / mT5 with task-level routing over forked encoder and decoder blocks. `forward(input_ids, task_ids=...,
    labels=...)` and `generate(input_ids, task_ids=...)` take one task id per row (index into `config.tasks`); a batch
    may mix tasks. Labels are the target's token ids (`-100` where no loss is taken), shifted right inside to make the
    decoder's inputs, as `T5ForConditionalGeneration` does.

    Build one with `TaskRoutedForSeq2SeqLM.from_dense("google-t5/t5-small", tasks)`: every expert of block `i` starts as
    block `i` (plus N(0, 1e-8) noise, section 5.2; `expert_noise_variance=0` makes the model compute exactly the dense
    model). `export_task(task)` gives back a plain `T5ForConditionalGeneration` (or mT5) holding that task's route.
    """

    config_class = TaskRoutedSeq2SeqConfig
    output_class = TaskRoutedSeq2SeqOutput
    dense_auto_class = AutoModelForSeq2SeqLM
    dense_kind = "a seq2seq LM with its LM head (AutoModelForSeq2SeqLM: T5ForConditionalGeneration)"
    main_input_name = "input_ids"
    #: transformers Auto classes this model is registered with (and named in an export's `auto_map`)
    auto_classes = ("AutoModel", "AutoModelForSeq2SeqLM")
    _no_split_modules = ["T5RoutedBlock", "ContextRoutedLayer"]
    plans_forward_routes = True  # BART's layers and T5's blocks run only the experts a batch uses

    def __init__(self, config: TaskRoutedSeq2SeqConfig):
        # only blocks passing their position bias need the 3-tuple (`T5RoutedBlock`); BART's layers run on every
        # admitted transformers
        if not T5_BLOCK_RETURNS_BIASES and config.backbone.passes_position_bias:
            import transformers

            raise NotImplementedError(
                "TaskRoutedForSeq2SeqLM needs a T5 block that returns its hidden states and position biases as one "
                f"3-tuple (transformers 5.24's does); the block of the installed transformers "
                f"{transformers.__version__} returns a tuple whose length depends on output_attentions and use_cache: "
                "upgrade transformers "
                "(pip install -U 'transformers<6')."
            )
        super().__init__(config)
        declared = config.backbone
        self._build_dense(config)
        base = self.backbone.base_model
        encoder, decoder = self.backbone.get_encoder(), self.backbone.get_decoder()
        # the copies share the configs T5's attention modules hold (each stack's own), so that
        # `set_attn_implementation` reaches every expert
        shared = (self.backbone.config, encoder.config, decoder.config)
        # a block that returns its position bias for the next one (T5's) mixes the biases with its hidden states
        layer_class = T5RoutedBlock if declared.passes_position_bias else ContextRoutedLayer
        low_rank = self._low_rank_spec(config)
        fork_layers(
            base.get_submodule(declared.layers), config.encoder_route_layers, config.num_experts, None,
            self.task_context, shared=shared, layer_class=layer_class, low_rank=low_rank,
        )
        self._slot_layers = fork_layers(
            base.get_submodule(declared.decoder_layers), config.decoder_route_layers, config.num_experts,
            (declared.attention, declared.cross_attention), self.task_context, shared=shared,
            first_route=len(config.encoder_route_layers), layer_class=layer_class, low_rank=low_rank,
        )
        if layer_class is T5RoutedBlock:
            for block in (*base.get_submodule(declared.layers), *base.get_submodule(declared.decoder_layers)):
                block.relative_table = declared.relative_table
        # `generate` runs the encoder by itself: its pre-hook routes it; both stacks record hidden states and
        # attentions per routed block (transformers' hooks would record every expert separately)
        for stack in (encoder, decoder):
            stack.register_forward_pre_hook(self._stack_pre_hook, with_kwargs=True)
            stack.register_forward_hook(self._stack_post_hook, with_kwargs=True)
        self._finish_init(config, "decoder_position_ids", "head_mask", "decoder_head_mask", "cross_attn_head_mask")

    special_token_names = (*TaskRoutingMixin.special_token_names, "decoder_start_token_id")

    def get_encoder(self, modality: str | None = None):
        return self.backbone.get_encoder()

    def get_decoder(self):
        return self.backbone.get_decoder()

    # ------------------------------------------------------------------ cache
    @property
    def num_cache_slots(self) -> int:
        return len(self._slot_layers)

    def new_cache(self) -> RoutedCache | EncoderDecoderCache:
        """An empty key/value cache with one self-attention and one cross-attention slot per decoder expert: the
        dense layout, then a slot for each expert copy. With low-rank experts (`expert_rank`): the dense model's own
        cache (one slot per block)."""
        if self.config.low_rank:
            return EncoderDecoderCache(DynamicCache(), DynamicCache())
        if not T5_BLOCK_RETURNS_BIASES:  # an older transformers, whose cache layers take no empty (None) entries:
            return RoutedCache()  # lazy layers, as BartTaskRouted made them (only BART is built there)
        slots = [(None, None)] * self.num_cache_slots
        return RoutedCache(ExpertRowsCache(ddp_cache_data=slots), ExpertRowsCache(ddp_cache_data=slots))

    def _routed_cache(self, cache: Cache | None) -> RoutedCache:
        """The cache to decode with: ours, or a new one in place of none or of an empty cache of another layout. With
        low-rank experts any cache of the dense layout."""
        if self.config.low_rank:
            return cache if cache is not None else self.new_cache()
        if cache is None or isinstance(cache, RoutedCache):
            return cache if cache is not None else self.new_cache()
        if getattr(cache, "is_compileable", False):
            raise ValueError(
                f"{type(self).__name__} cannot decode with a static cache ({type(cache).__name__}, "
                "`cache_implementation='static'`): its decoder layers keep one cache slot per expert, holding only the "
                "rows routed to it. Leave `cache_implementation` unset (the default dynamic cache)."
            )
        if cache.get_seq_length() > 0:
            raise ValueError(
                f"{type(self).__name__} continues decoding only from the cache it returned (a RoutedCache with a slot "
                f"per decoder expert, `model.new_cache()`), got a filled {type(cache).__name__}."
            )
        return self.new_cache()

    # ------------------------------------------------------------------ the stacks' hooks
    def _stack_pre_hook(self, stack, args, kwargs):
        """Before T5's encoder or decoder runs: routes for the encoder when `generate` calls it by itself (with the
        model's `task_ids`), and a recorder in place of transformers' recording of hidden states and attentions."""
        task_ids = kwargs.pop("task_ids", None)
        values_checked = kwargs.pop("values_checked", False)
        flags = self.task_context.flags
        wanted = [kwargs.pop(flag, None) for flag in ("output_hidden_states", "output_attentions")]
        if stack is self.get_encoder() and (task_ids is not None or flags.get("routing_weights") is None):
            inputs = kwargs.get("input_ids", kwargs.get("inputs_embeds", args[0] if args else None))
            if inputs is not None:
                if is_exporting() and not values_checked:
                    raise ValueError(EXPORT_NEEDS_CHECKED)
                task_ids = resolve_task_ids(task_ids, inputs.shape[0], self.config.task_names, self.device,
                                            check_values=not values_checked)
                decisions, logits = self.router(task_ids)
                self.task_context.begin(
                    task_ids, kwargs.get("attention_mask"), **self._routing_flags(decisions, router_logits=logits),
                    began_by=stack,
                )
                flags = self.task_context.flags
        record = flags.get("record")
        if record is None:
            hidden = self.config.output_hidden_states if wanted[0] is None else wanted[0]
            attentions = self.config.output_attentions if wanted[1] is None else wanted[1]
        else:
            hidden, attentions = record
        kwargs["output_hidden_states"] = kwargs["output_attentions"] = False  # the dense recording off: ours instead
        kwargs["return_dict"] = True  # the dense model reads its stacks' outputs by name
        if hidden or attentions:
            declared = self.config.backbone
            kinds = {"attentions": declared.attention}
            if stack is self.get_decoder():
                kinds["cross_attentions"] = declared.cross_attention
            flags["routing_recorder"] = RouteRecorder(
                hidden if isinstance(hidden, (list, tuple)) else bool(hidden), bool(attentions), kinds
            )
        return args, kwargs

    def _stack_post_hook(self, stack, args, kwargs, output):
        flags = self.task_context.flags
        recorder = flags.pop("routing_recorder", None)
        if recorder is not None and isinstance(output, ModelOutput):
            for name, value in recorder.outputs().items():
                setattr(output, name, value)
        if flags.get("began_by") is stack:
            self.task_context.end()
        return output

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        decoder_input_ids: torch.LongTensor | None = None,
        decoder_attention_mask: torch.Tensor | None = None,
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
            The target's token ids, `-100` where no loss is taken; shifted right inside (after the decoder start
            token) to make the decoder's inputs unless `decoder_input_ids` are given.
        cache (`Cache`, *optional*):
            The key/value cache this model returned (an `EncoderDecoderCache` with a slot per decoder expert,
            `new_cache()`); also accepted as `past_key_values`. An empty cache of another layout is replaced.
        routing_weights (`torch.Tensor` of shape `(batch, routed layers, experts)`, *optional*):
            Decisions to use instead of the router's (analysis).
        output_router_logits (`bool`, *optional*):
            Return `routing_decisions`, `router_logits` and `routing_counts`.
        values_checked (`bool`, *optional*, defaults to `False`):
            The task ids and target ids were checked on the host where the batch was made: their values are not
            read back here (no host sync). The result is the same.
        """
        cache = self._forward_cache(cache, kwargs)
        if is_exporting() and not values_checked:
            raise ValueError(EXPORT_NEEDS_CHECKED)
        reference = next(
            (t for t in (input_ids, inputs_embeds, decoder_input_ids, decoder_inputs_embeds, labels) if t is not None),
            None,
        )
        if reference is None and encoder_outputs is not None:
            reference = encoder_outputs[0]
        if reference is None:
            raise ValueError("Pass `input_ids` (or `inputs_embeds`, or `encoder_outputs` with decoder inputs).")
        batch = reference.shape[0]
        for name, tensor in (("input", input_ids if input_ids is not None else inputs_embeds), ("target", labels),
                             ("decoder input", decoder_input_ids if cache is None else None)):
            if tensor is not None:
                check_lengths(tensor.shape[0], tensor.shape[1] if tensor.dim() > 1 else 1, self.max_input_length(),
                              name)
        check_batch_dim(batch, attention_mask=attention_mask, labels=labels, decoder_input_ids=decoder_input_ids)
        inputs = dict(input_ids=input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids,
                      decoder_attention_mask=decoder_attention_mask, encoder_outputs=encoder_outputs,
                      inputs_embeds=inputs_embeds, decoder_inputs_embeds=decoder_inputs_embeds, **kwargs)
        return self._routed_forward(
            inputs, batch, None, labels, cache, use_cache, task_ids, routing_weights, values_checked,
            output_router_logits, output_attentions, output_hidden_states, return_dict,
            {"input_ids": input_ids, "decoder_input_ids": decoder_input_ids},
        )

    def _prepare_labels(self, labels: torch.Tensor, inputs: dict, seq: None, values_checked: bool) -> torch.Tensor:
        if labels.dim() != 2:
            raise ValueError(f"`labels` must have shape (batch, target_length), got {tuple(labels.shape)}.")
        if not values_checked:
            Seq2Seq.check_target_ids(labels, self.config.vocab_size)
        if inputs["decoder_input_ids"] is None and inputs["decoder_inputs_embeds"] is None:
            inputs["decoder_input_ids"] = self._shift_right(labels)
        return labels

    def _recording_flags(self, hidden, attentions: bool) -> dict:
        return {"record": (hidden, attentions)}  # what the stacks' pre-hooks record (`_stack_pre_hook`)

    def _stack_outputs(self, out, recorded: dict) -> dict:
        names = ("encoder_last_hidden_state", "encoder_hidden_states", "encoder_attentions", "decoder_hidden_states",
                 "decoder_attentions", "cross_attentions")
        return {name: getattr(out, name) for name in names}

    def _shift_right(self, labels: torch.Tensor) -> torch.Tensor:
        """The decoder's inputs for `labels`: the decoder start token, then the labels but the last (`-100` -> pad),
        as T5 makes them."""
        dense = self.config.dense_config
        if dense.decoder_start_token_id is None:
            raise ValueError("The dense config's `decoder_start_token_id` must be set to train on labels (T5: pad, 0).")
        shifted = labels.new_full(labels.shape, dense.pad_token_id if dense.pad_token_id is not None else 0)
        shifted[:, 1:] = labels[:, :-1]
        shifted[:, 0] = dense.decoder_start_token_id
        return shifted.masked_fill(shifted == IGNORE_INDEX, dense.pad_token_id or 0)

    def prepare_decoder_input_ids_from_labels(self, labels: torch.Tensor) -> torch.Tensor:
        """The decoder's inputs for `labels` (what the Trainer's seq2seq collator asks of the model)."""
        return self._shift_right(labels)

    # ------------------------------------------------------------------ generation
    def generate(self, input_ids=None, attention_mask=None, task_ids=None, every_expert: bool = False, **kwargs):
        """`GenerationMixin.generate` with `task_ids` (one per row; optional for a one-task model). The encoder runs
        once with the rows' routes (the encoder's pre-hook), each decoding step with the cache (a slot per decoder
        expert). The segment ids a BERT tokenizer returns are dropped.

        Under hard routes each routed decoder layer (a BART layer, a T5 block) runs only the experts the rows use:
        each on its own rows, with its own rows in its cache slots (`RoutedCache`), or, with grouped layers
        (`group_hard_routes`, the default off the CPU), all of them as one layer on the batch sorted by task; the plan
        is made at the first step (one host read per call) and kept for the others. The encoder runs once, on its
        forward plan (one host read). The task ids and the token ids given are checked once, here (no decoding step
        reads them back). An empty `RoutedCache` passed in (`new_cache()`) is planned alike; a filled one continues
        on the forward's plan. A soft route runs every expert on every row, mixed by the decisions, and so does
        `every_expert=True`, in the encoder and every step (the reference the planned path is tested against)."""
        kwargs.pop("token_type_ids", None)
        check_generation_counts(kwargs)
        reference = input_ids if input_ids is not None else kwargs.get("inputs_embeds")
        given = task_ids
        if reference is not None:
            checked = bool(kwargs.get("values_checked"))
            task_ids = resolve_task_ids(task_ids, reference.shape[0], self.config.task_names, self.device,
                                        check_values=not checked)
            if not checked:
                # the task ids and the given token ids checked once, here: the encoder and every decoding step then
                # read nothing back to check them again (the new ids are the model's own), where each step read both
                check_token_ids(token_table_sizes(self), input_ids=input_ids,
                                decoder_input_ids=kwargs.get("decoder_input_ids"))
                kwargs["values_checked"] = True
        check_generation_cache(self, kwargs)
        kwargs.pop("cache_implementation", None)
        cache = self._generation_cache(kwargs, every_expert)
        self._every_expert_generation = every_expert
        try:
            return self._generate(super().generate, input_ids, cache, given,
                                  {"attention_mask": attention_mask, "task_ids": task_ids, **kwargs})
        finally:
            self._every_expert_generation = False
            self.task_context.end()  # nothing of a call outlives it, also when it raised

    # ------------------------------------------------------------------ building and exporting

    def _layer_stacks(self) -> dict[str, torch.nn.ModuleList]:
        """`{prefix of the stack's blocks in the dense model's names: the blocks}`, encoder first."""
        declared = self.config.backbone
        base = self.backbone.base_model
        # T5ForConditionalGeneration is its own base model; BART's is its `model`
        prefix = "" if base is self.backbone else f"{self.backbone.base_model_prefix}."
        return {f"{prefix}{path}.": base.get_submodule(path) for path in (declared.layers, declared.decoder_layers)}


def apply_generation_convention(generation_config, config, max_new_tokens: int | None = None):
    """BART's target / generation convention, written into a `GenerationConfig` (`config`: the dense BART's).

    Targets are the text's tokens and the end token, with no leading BOS or [CLS] (`target_token_ids`); the decoder
    starts from `decoder_start_token_id` (BART: `</s>`; `bart_from_bert`: [CLS]) in training (labels shifted right)
    and in `generate()`, which stops at `eos_token_id` (BART: `</s>`; BERT vocabularies: [SEP]). So no BOS is forced
    after the start token (pretrained BART forces `<s>`; its targets began with `<s>`)."""
    for name in ("decoder_start_token_id", "eos_token_id", "pad_token_id", "bos_token_id"):
        setattr(generation_config, name, getattr(config, name))
    generation_config.forced_bos_token_id = None
    # as max_new_tokens, not max_length: a user's `generate(max_new_tokens=...)` then replaces it without a warning
    if max_new_tokens is not None or generation_config.max_new_tokens is None:
        generation_config.max_new_tokens = max_new_tokens or DEFAULT_MAX_NEW_TOKENS
    if generation_config.max_length == 20:  # transformers' old default, which would clash with max_new_tokens
        generation_config.max_length = None
    return generation_config


class BartTaskRouted(TaskRoutedForSeq2SeqLM):
    r"""
    `TaskRoutedForSeq2SeqLM` over a BART (Ye et al. 2022's setting), with BART's generation convention
    (`apply_generation_convention`). `forward(..., task_ids=...)` and `generate(input_ids, task_ids=..., num_beams=...)`
    take one task id per row (index into `config.tasks`); a batch may mix tasks.

    Build one from a dense BART with `BartTaskRouted.from_dense("facebook/bart-base", tasks)` (experts start as the
    dense layer plus N(0, 1e-8) noise, section 5.2), or from a BERT checkpoint through `bart_from_bert`.
    """

    config_class = BartTaskRoutedConfig
    dense_kind = "a BartForConditionalGeneration (AutoModelForSeq2SeqLM)"

    def _apply_generation_convention(self, generation_config):
        return apply_generation_convention(generation_config, self.config.dense_config)
