"""Configurations of task-level routing (Ye et al. 2022): `TaskRoutedLMConfig` over the layers of a decoder-only causal
LM (GPT-2, Llama, Qwen2, Mistral: `hf_taskmoe.backbones.backbone_names("decoder")`), `TaskRoutedSeq2SeqConfig` over
the encoder and decoder layers of an encoder-decoder (T5, mT5, BART: `backbone_names("encoder-decoder")`)."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from transformers import AutoConfig, BartConfig, PreTrainedConfig

from ...backbones import DECODER_BACKBONE, ENCODER_DECODER_BACKBONE, Backbone, get_backbone
from ...compat import dense_sub_config
from ...layers.low_rank import check_low_rank_fields
from ...layers.routing import ROUTER_TYPES, SELECTION_FUNCTIONS
from ...problem_types import TEXT_TO_TEXT
from ...problem_types.seq2seq import ENCODER_DECODER_LAYOUT
from ...tasks import TaskSpec
from ...utils import check_choice, check_float, check_int, check_layer_list
from ..configuration import TaskConfigMixin

__all__ = ["BartTaskRoutedConfig", "TaskRoutedLMConfig", "TaskRoutedSeq2SeqConfig"]


class TaskRoutedLMConfig(TaskConfigMixin, PreTrainedConfig):
    r"""
    Configuration of `TaskRoutedForCausalLM` (Ye et al. 2022, sections 4 and 5.1, on a causal LM): a dense decoder-only
    LM whose routed layers are each forked into `num_experts` experts, mixed per task by a router that reads a task
    embedding. The routing fields mean what they mean in `BartTaskRoutedConfig`.

    Args:
        dense_config (`dict` or `PreTrainedConfig`):
            The config of the dense causal LM the model wraps (its `model_type` must be a declared decoder backbone:
            `hf_taskmoe.backbones.backbone_names("decoder")`). `from_dense` fills it from the checkpoint.
        tasks (`list[dict]`):
            The tasks, as `TaskSpec` dicts; every task is text-to-text (`problem_type="seq2seq"`: the prompt is the
            input text, the target its continuation). Task id `i` in `forward` / `generate` is `tasks[i]`.
        num_experts (`int`, *optional*, defaults to 3):
            Experts `m` per routed layer (the paper's 3).
        selection (`str`, *optional*, defaults to `"gumbel_softmax_st"`):
            Selection function: `average`, `softmax`, `gumbel_softmax`, `gumbel_softmax_st` or `hard`
            (`hf_taskmoe.layers.routing.SELECTION_FUNCTIONS`). At evaluation `gumbel_softmax_st` and `hard` take the
            arg-max expert (a hard route).
        router_type (`str`, *optional*, defaults to `"mlp"`):
            Router network: `mlp`, `lstm` or `transformer`.
        router_hidden_size (`int`, *optional*):
            Hidden width of the router; defaults to `task_embedding_dim`.
        router_attention_heads (`int`, *optional*, defaults to 4):
            Heads of the `transformer` router; must divide `task_embedding_dim`.
        task_embedding_dim (`int`, *optional*):
            Size of the task representations; defaults to the dense model's hidden size.
        freeze_task_embeddings (`bool`, *optional*, defaults to `False`):
            Keep the task representations fixed during training (section 5.1 (m)).
        routed_layers (`list[int]`, *optional*):
            Indices of the layers forked into experts; default: all of them (the paper routes every layer).
        gumbel_temperature (`float`, *optional*, defaults to 1.0):
            Starting temperature of the Gumbel selections.
        gumbel_min_temperature (`float`, *optional*, defaults to 0.5):
            Lowest temperature of the annealing schedule.
        gumbel_anneal_rate (`float`, *optional*, defaults to 1e-4):
            `tau(step) = max(gumbel_min_temperature, gumbel_temperature * exp(-rate * step))`; 0 keeps it fixed.
        router_init_std (`float`, *optional*):
            Standard deviation of the router's weights; defaults to `2 / sqrt(task_embedding_dim)` (as
            `BartTaskRoutedConfig`, which says why).
        task_embedding_init_std (`float`, *optional*, defaults to 1.0):
            Standard deviation of the randomly initialised task representations.
        task_representation_source (`dict`, *optional*):
            How the task representations were made when not learned from a random draw, e.g.
            `{"kind": "text", "base": <dense checkpoint>, "pooling": "avg", "examples": 64}` (TextEmb, section 5.1
            (i)); `run_multitask.py --task_representation text` writes it and reads it again to give a task added
            later its representation from the same base. Data only: nothing is loaded from it unless that option is
            given.
        upcycled_from (`str`, *optional*):
            Set by `from_dense`: the dense checkpoint the experts were forked from (model cards).
        expert_rank (`int`, *optional*):
            `None` (default): every expert is a whole copy of its layer (the paper's forked layers). A positive int
            `r`: low-rank experts. A routed layer is then not forked: it stays one module with one key/value cache
            slot (the dense layout: generation uses the dense model's caches), and each of its target linears holds
            `num_experts` LoRA deltas of rank `r` beside the dense weight (`hf_taskmoe.layers.low_rank`): expert `j`
            of the layer is the dense layer plus its own deltas. Upcycling sets every `B` to zero (peft's init), so
            all experts start equal to the dense layer and the model computes the dense model's outputs under any
            route; they diverge only through the tasks routed to them. Soft routes mix the deltas
            (`W + s * sum_j d_j B_j A_j`: one layer run and one cache), hard routes add the chosen expert's alone.
        expert_alpha (`float`, *optional*):
            peft's `lora_alpha`: the deltas are scaled by `expert_alpha / expert_rank`. Defaults to `2 * expert_rank`
            (scale 2, the common LoRA choice for rank 8-64; with Adam the scale mostly acts as a step size on the
            deltas). An export writes it as each adapter's `lora_alpha`, so peft's scale equals this model's.
        expert_dropout (`float`, *optional*, defaults to 0.0):
            Dropout on the input of the deltas (peft's `lora_dropout`); the dense product reads the input unchanged.
        expert_targets (`list[str]`, *optional*):
            Which linears of a routed layer get deltas: module names relative to the layer, or suffixes of them
            (`["q_proj", "v_proj"]`, `["mlp.down_proj"]`). Default: every linear of the layer (attention
            projections, cross-attention's in an encoder-decoder, the FFN's): task routing forks whole layers, so a
            low-rank expert is the whole layer plus its deltas, the nearest low-rank counterpart of the paper's
            experts. A name that matches no linear is refused.
        train_base (`bool`, *optional*, defaults to `False`):
            With `expert_rank` set: `False` freezes the dense weights (every layer's, embeddings, LM head, norms:
            `requires_grad=False`), so training holds gradients and optimizer state only for the deltas, the router
            and the task representations (LoRA memory); `True` trains them too.
    """

    model_type = "taskmoe_routed_lm"
    #: what `RoutingStatistics` counts for this family: each task's examples (routing is per task, not per token)
    routing_unit = "examples"
    #: how a text-to-text example is laid out for this model: one sequence, prompt then target
    #: (`hf_taskmoe.problem_types.seq2seq.CAUSAL_LAYOUT`; an encoder-decoder reads the two apart)
    text_to_text_layout: ClassVar[str] = "causal"
    method_name: ClassVar[str] = "Task-level routing (TaskRoutedForCausalLM)"
    backbone_kind: ClassVar[str] = DECODER_BACKBONE
    sub_configs: ClassVar = {"dense_config": AutoConfig}
    #: the dense model type of a config built without `dense_config` (transformers builds default configs)
    dense_config_default: ClassVar[str] = "gpt2"

    dense_config: dict | PreTrainedConfig | None = None
    tasks: list | None = None
    num_experts: int = 3
    selection: str = "gumbel_softmax_st"
    router_type: str = "mlp"
    router_hidden_size: int | None = None
    router_attention_heads: int = 4
    task_embedding_dim: int | None = None
    freeze_task_embeddings: bool = False
    routed_layers: list | None = None
    gumbel_temperature: float = 1.0
    gumbel_min_temperature: float = 0.5
    gumbel_anneal_rate: float = 1e-4
    router_init_std: float | None = None
    task_embedding_init_std: float = 1.0
    task_representation_source: dict | None = None
    upcycled_from: str | None = None
    expert_rank: int | None = None
    expert_alpha: float | None = None
    expert_dropout: float = 0.0
    expert_targets: list | None = None
    train_base: bool = False

    def __post_init__(self, **kwargs):
        self.dense_config = dense_sub_config(self.dense_config, self.dense_config_default)
        if "_pending_tie_word_embeddings" in self.__dict__:
            self.tie_word_embeddings = self.__dict__.pop("_pending_tie_word_embeddings")
        super().__post_init__(**kwargs)
        self._validate()

    def _validate(self) -> None:
        self.backbone  # noqa: B018  (refuses an undeclared model_type, listing the declared ones)
        self._validate_tasks(TEXT_TO_TEXT, f"is not text-to-text; {type(self).__name__} supports")
        check_int(self.num_experts, "num_experts", minimum=1)
        check_choice(self.selection, SELECTION_FUNCTIONS, "selection")
        check_choice(self.router_type, ROUTER_TYPES, "router_type")
        if self.router_hidden_size is not None:
            check_int(self.router_hidden_size, "router_hidden_size", minimum=1)
        if self.task_embedding_dim is not None:
            check_int(self.task_embedding_dim, "task_embedding_dim", minimum=1)
        check_int(self.router_attention_heads, "router_attention_heads", minimum=1)
        if self.router_type == "transformer" and self.task_dim % self.router_attention_heads:
            raise ValueError(
                f"`router_attention_heads` ({self.router_attention_heads}) must divide `task_embedding_dim` "
                f"({self.task_dim}) for router_type='transformer'."
            )
        if self.task_representation_source is not None and not isinstance(self.task_representation_source, dict):
            raise ValueError(f"`task_representation_source` must be a dict, got {self.task_representation_source!r}.")
        if not isinstance(self.freeze_task_embeddings, bool):
            raise ValueError(f"`freeze_task_embeddings` must be a bool, got {self.freeze_task_embeddings!r}.")
        self.routed_layers = check_layer_list(self.routed_layers, "routed_layers", self.num_layers)
        check_float(self.gumbel_temperature, "gumbel_temperature", minimum=1e-6)
        check_float(self.gumbel_min_temperature, "gumbel_min_temperature", minimum=1e-6)
        check_float(self.gumbel_anneal_rate, "gumbel_anneal_rate", minimum=0.0)
        if self.router_init_std is not None:
            check_float(self.router_init_std, "router_init_std", minimum=0.0)
        check_float(self.task_embedding_init_std, "task_embedding_init_std", minimum=0.0)
        self._validate_low_rank()

    def _validate_low_rank(self) -> None:
        check_low_rank_fields(self, "every linear of a routed layer")

    @property
    def low_rank(self) -> bool:
        """Whether the experts are low-rank deltas over one shared layer (`expert_rank` set)."""
        return self.expert_rank is not None

    @property
    def expert_scaling(self) -> float:
        """The deltas' scale `expert_alpha / expert_rank` (`expert_alpha` defaults to `2 * expert_rank`)."""
        return self.lora_alpha / self.expert_rank

    @property
    def lora_alpha(self) -> float:
        """`expert_alpha` resolved: peft's `lora_alpha` of the deltas (and of an exported adapter)."""
        return float(self.expert_alpha) if self.expert_alpha is not None else 2.0 * self.expert_rank

    # ------------------------------------------------------------------ views
    @property
    def backbone(self) -> Backbone:
        """The declaration of the dense model's architecture."""
        return get_backbone(getattr(self.dense_config, "model_type", None), self.backbone_kind, self.method_name,
                            low_rank=getattr(self, "expert_rank", None) is not None)

    def dense_value(self, name: str):
        """The dense config's value for a canonical name (`hidden_size`, `num_hidden_layers`, ...)."""
        return self.backbone.config_value(self.dense_config, name)

    @property
    def hidden_size(self) -> int:
        return self.dense_value("hidden_size")

    @property
    def vocab_size(self) -> int:
        return self.dense_config.vocab_size

    @property
    def num_layers(self) -> int:
        return self.dense_value("num_hidden_layers")

    @property
    def max_position_embeddings(self) -> int | None:
        return self.dense_value("max_position_embeddings")

    @property
    def tie_word_embeddings(self) -> bool:
        """Whether the LM head shares the input embeddings: the dense model's setting (it owns both), read and set
        through to `dense_config` (transformers' tying code and tests read it at the top level)."""
        return bool(getattr(self.dense_config, "tie_word_embeddings", False))

    @tie_word_embeddings.setter
    def tie_word_embeddings(self, value: bool) -> None:
        dense = self.__dict__.get("dense_config")
        if isinstance(dense, dict):
            dense["tie_word_embeddings"] = value
        elif dense is not None:
            dense.tie_word_embeddings = value
        else:  # a config being built: `__post_init__` makes the dense config, then applies it
            self.__dict__["_pending_tie_word_embeddings"] = value

    @property
    def task_dim(self) -> int:
        return self.task_embedding_dim or self.hidden_size

    @property
    def router_std(self) -> float:
        return self.router_init_std if self.router_init_std is not None else 2.0 / self.task_dim**0.5

    @property
    def router_hidden(self) -> int:
        return self.router_hidden_size or self.task_dim

    @property
    def route_layers(self) -> list[int]:
        return list(range(self.num_layers)) if self.routed_layers is None else list(self.routed_layers)

    @property
    def route_names(self) -> list[str]:
        """Names of the routed layers, in the order of the router's layer axis (`D3` = layer 3)."""
        return [f"D{i}" for i in self.route_layers]

    @property
    def num_routed_layers(self) -> int:
        return len(self.route_layers)

    @classmethod
    def from_dense_config(cls, dense_config: PreTrainedConfig, tasks, **kwargs: Any):
        """A config wrapping `dense_config` (copied) with the tasks and the routing settings."""
        get_backbone(getattr(dense_config, "model_type", None), cls.backbone_kind, cls.method_name,
                     low_rank=kwargs.get("expert_rank") is not None)
        dense = dense_config.__class__.from_dict(dense_config.to_dict())
        return cls(dense_config=dense, tasks=[TaskSpec.from_dict(t).to_dict() for t in tasks], **kwargs)


class TaskRoutedSeq2SeqConfig(TaskRoutedLMConfig):
    r"""
    Configuration of `TaskRoutedForSeq2SeqLM` (Ye et al. 2022, sections 4 and 5.1, on T5 / mT5): a dense
    encoder-decoder whose routed encoder and decoder blocks are each forked into `num_experts` experts, mixed per task
    by a router that reads a task embedding. Every field of `TaskRoutedLMConfig` means the same here, except that the
    routed layers are named per stack (`routed_layers` is not used):

    Args:
        dense_config (`dict` or `PreTrainedConfig`):
            The config of the dense T5 / mT5 the model wraps (`T5Config`, `MT5Config`: a declared encoder-decoder
            backbone). `from_dense` fills it from the checkpoint.
        routed_encoder_layers (`list[int]`, *optional*):
            Indices of the encoder blocks forked into experts; default: all of them (the paper routes every layer).
        routed_decoder_layers (`list[int]`, *optional*):
            Indices of the decoder blocks forked into experts; default: all of them.
        is_encoder_decoder (`bool`, *optional*, defaults to `True`):
            Always `True` (what `generate` and the text-to-text pipeline read).

    The router's layer axis lists the routed encoder blocks, then the routed decoder blocks (`route_names`:
    `E0, E1, ..., D0, D1, ...`).
    """

    model_type = "taskmoe_routed_t5"
    #: a text-to-text example: the input text to the encoder, the target's tokens as labels
    text_to_text_layout: ClassVar[str] = ENCODER_DECODER_LAYOUT
    method_name: ClassVar[str] = "Task-level routing (TaskRoutedForSeq2SeqLM)"
    backbone_kind: ClassVar[str] = ENCODER_DECODER_BACKBONE
    sub_configs: ClassVar = {"dense_config": AutoConfig}
    #: the dense model type of a config built without `dense_config` (transformers builds default configs)
    dense_config_default: ClassVar[str] = "t5"

    routed_encoder_layers: list | None = None
    routed_decoder_layers: list | None = None
    is_encoder_decoder: bool = True

    def _validate(self) -> None:
        if self.routed_layers is not None:
            raise ValueError(
                "`routed_layers` is not used by TaskRoutedSeq2SeqConfig: name the routed blocks per stack with "
                f"`routed_encoder_layers` / `routed_decoder_layers`, got routed_layers={self.routed_layers!r}."
            )
        super()._validate()
        self.routed_encoder_layers = check_layer_list(self.routed_encoder_layers, "routed_encoder_layers",
                                                      self.num_layers)
        self.routed_decoder_layers = check_layer_list(self.routed_decoder_layers, "routed_decoder_layers",
                                                      self.num_decoder_layers)
        self.is_encoder_decoder = True

    # ------------------------------------------------------------------ views
    @property
    def num_decoder_layers(self) -> int:
        decoder = self.dense_value("num_decoder_layers")
        return decoder if decoder is not None else self.num_layers

    @property
    def encoder_route_layers(self) -> list[int]:
        routed = self.routed_encoder_layers
        return list(range(self.num_layers)) if routed is None else list(routed)

    @property
    def decoder_route_layers(self) -> list[int]:
        routed = self.routed_decoder_layers
        return list(range(self.num_decoder_layers)) if routed is None else list(routed)

    @property
    def route_layers(self) -> list[int]:
        """The routed blocks' indices in the router's layer order (encoder blocks, then decoder blocks)."""
        return self.encoder_route_layers + self.decoder_route_layers

    @property
    def route_names(self) -> list[str]:
        """Names of the routed blocks, in the order of the router's layer axis (`E3` = encoder block 3)."""
        return [f"E{i}" for i in self.encoder_route_layers] + [f"D{i}" for i in self.decoder_route_layers]


#: the fields of a `BartConfig` (not of every config), which `BartTaskRoutedConfig` also takes at its top level
BART_FIELDS = frozenset(f.name for f in dataclasses.fields(BartConfig)) - frozenset(
    f.name for f in dataclasses.fields(PreTrainedConfig)
)
#: read through to the dense config (`config.d_model`), but for a generation setting: transformers refuses a model
#: config that sets one (the generation config holds them)
_READ_THROUGH = BART_FIELDS - {"forced_eos_token_id"}


class BartTaskRoutedConfig(TaskRoutedSeq2SeqConfig):
    r"""
    Configuration of `BartTaskRouted`: `TaskRoutedSeq2SeqConfig` over a BART (the paper's setting), every field
    meaning the same, and its `model_type` (a saved `BartTaskRouted` is a saved `TaskRoutedForSeq2SeqLM`). The dense
    BART's fields may also be given at the top level (`BartTaskRoutedConfig(d_model=768, encoder_layers=6, ...,
    tasks=...)`): they make the `dense_config`, and reading one (`config.d_model`) reads the dense config's.
    """

    method_name: ClassVar[str] = "Task-level routing (BartTaskRouted)"
    dense_config_default: ClassVar[str] = "bart"

    @classmethod
    def accepted_options(cls) -> frozenset[str]:
        return super().accepted_options() | BART_FIELDS

    def __post_init__(self, **kwargs):
        if self.dense_config is None:
            flat = {name: kwargs.pop(name) for name in list(kwargs) if name in BART_FIELDS}
            if flat:
                self.dense_config = BartConfig(**flat, is_encoder_decoder=True)
        super().__post_init__(**kwargs)  # with a dense config, such fields are this config's own (`use_cache`)

    def __getattr__(self, name: str):
        # only reached when no attribute has the name: a field of the dense BART (`d_model`, `pad_token_id`, ...)
        dense = self.__dict__.get("dense_config")
        if name in _READ_THROUGH and isinstance(dense, PreTrainedConfig):
            return getattr(dense, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def _validate(self) -> None:
        super()._validate()
        if self.dense_config.model_type != "bart":
            raise ValueError(
                f"BartTaskRoutedConfig wraps a BART (model_type 'bart'; see `bart_from_bert` for a BERT warm start), "
                f"got model_type {self.dense_config.model_type!r}: use TaskRoutedSeq2SeqConfig."
            )
