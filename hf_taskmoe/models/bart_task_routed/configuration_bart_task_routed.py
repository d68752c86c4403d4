"""Configuration of `BartTaskRouted` (task-level mixture of experts over BART layers)."""

from __future__ import annotations

from transformers import BartConfig

from ...layers.routing import ROUTER_TYPES, SELECTION_FUNCTIONS
from ...problem_types import TEXT_TO_TEXT
from ...tasks import TaskConfigMixin
from ...utils import check_choice, check_float, check_int, check_layer_list

# BartConfig fields that fix the architecture of a dense checkpoint (copied by `from_dense_config`)
DENSE_BART_FIELDS = (
    "vocab_size", "max_position_embeddings", "encoder_layers", "encoder_ffn_dim", "encoder_attention_heads",
    "decoder_layers", "decoder_ffn_dim", "decoder_attention_heads", "activation_function", "d_model", "dropout",
    "attention_dropout", "activation_dropout", "init_std", "scale_embedding", "pad_token_id", "bos_token_id",
    "eos_token_id", "decoder_start_token_id", "forced_eos_token_id", "tie_word_embeddings",
)


class BartTaskRoutedConfig(TaskConfigMixin, BartConfig):
    r"""
    Configuration of `BartTaskRouted` (Ye et al. 2022, sections 4 and 5.1): a BART whose routed encoder and
    decoder layers are each forked into `num_experts` experts, mixed per task by a router that reads a task
    embedding. Every field of `BartConfig` is accepted. The others:

    Args:
        tasks (`list[dict]`):
            The tasks, as `TaskSpec` dicts; every task is text-to-text (`problem_type="seq2seq"`). Task id
            `i` in `forward` / `generate` is `tasks[i]`.
        num_experts (`int`, *optional*, defaults to 3):
            Experts `m` per routed layer (the paper's 3).
        selection (`str`, *optional*, defaults to `"gumbel_softmax_st"`):
            Selection function (section 5.1 (a)-(d)): `average`, `softmax`, `gumbel_softmax` or
            `gumbel_softmax_st` (the paper's best; in training every expert runs, since the straight-through
            gradient needs each expert's output), or `hard` (not in the paper): a Gumbel-max route trained
            through the chosen expert only (Switch Transformer's `p / sg(p)` estimator), so a training step runs
            one expert per layer, at about the cost of the dense model. At evaluation `gumbel_softmax_st` and
            `hard` both take the arg-max expert.
        router_type (`str`, *optional*, defaults to `"mlp"`):
            Router network (section 5.1 (e)-(g)): `mlp`, `lstm` or `transformer`.
        router_hidden_size (`int`, *optional*):
            Hidden width of the router (MLP hidden layer, LSTM state per direction, transformer feed-forward);
            defaults to `task_embedding_dim`.
        router_attention_heads (`int`, *optional*, defaults to 4):
            Heads of the `transformer` router; must divide `task_embedding_dim`.
        task_embedding_dim (`int`, *optional*):
            Size of the task representations; defaults to `d_model` (the paper's 768 for BART-Base).
        freeze_task_embeddings (`bool`, *optional*, defaults to `False`):
            Keep the task representations fixed during training (section 5.1 (m)).
        task_representation_source (`dict`, *optional*):
            How the task representations were made when not learned from a random draw, e.g.
            `{"kind": "text", "base": <dense checkpoint>, "pooling": "avg", "examples": 64}` (TextEmb,
            section 5.1 (i)); `run_multitask.py --task_representation text` writes it and reads it again to give a
            task added later its representation from the same base. Data only: nothing is loaded from it unless
            that option is given.
        routed_encoder_layers / routed_decoder_layers (`list[int]`, *optional*):
            Indices of the encoder / decoder layers that are forked into experts; default: all of them (the
            paper routes every layer). The other layers stay plain BART layers.
        gumbel_temperature (`float`, *optional*, defaults to 1.0):
            Starting temperature of the Gumbel selections.
        gumbel_min_temperature (`float`, *optional*, defaults to 0.5):
            Lowest temperature of the annealing schedule.
        gumbel_anneal_rate (`float`, *optional*, defaults to 1e-4):
            `tau(step) = max(gumbel_min_temperature, gumbel_temperature * exp(-rate * step))`; 0 keeps the
            temperature fixed. (The paper anneals but gives no constants; these follow Jang et al. 2017.)
        router_init_std (`float`, *optional*):
            Standard deviation of the router's weights; defaults to `2 / sqrt(task_embedding_dim)`, which starts
            the router logits at a standard deviation of about 2.5 (MLP router, unit task representations). With
            BART's `init_std` (0.02) they start at about 0.1, far below the Gumbel noise, so in training a task's
            sampled route agreed with its arg-max route at 36% of the (task, layer) pairs (chance: 1/3) and each
            expert got a third of the task's updates; at this default they agree at 77% (measured on
            `bart_from_bert(MiniLM)`, 5 tasks, 3 experts), and 12 examples are learned in 50 steps instead of 75.
        task_embedding_init_std (`float`, *optional*, defaults to 1.0):
            Standard deviation of the randomly initialised task representations (section 5.1 (h)).
        upcycled_from (`str`, *optional*):
            Set by `from_dense`: the dense checkpoint the experts were forked from (model cards).
    """

    model_type = "taskmoe_bart_routed"
    #: what `RoutingStatistics` counts for this family: each task's examples (routing is per task, not per token)
    routing_unit = "examples"

    tasks: list | None = None
    num_experts: int = 3
    selection: str = "gumbel_softmax_st"
    router_type: str = "mlp"
    router_hidden_size: int | None = None
    router_attention_heads: int = 4
    task_embedding_dim: int | None = None
    freeze_task_embeddings: bool = False
    task_representation_source: dict | None = None
    routed_encoder_layers: list | None = None
    routed_decoder_layers: list | None = None
    gumbel_temperature: float = 1.0
    gumbel_min_temperature: float = 0.5
    gumbel_anneal_rate: float = 1e-4
    router_init_std: float | None = None
    task_embedding_init_std: float = 1.0
    upcycled_from: str | None = None

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        self._validate()

    def _validate(self) -> None:
        for name in ("d_model", "encoder_layers", "decoder_layers", "vocab_size"):
            check_int(getattr(self, name), name, minimum=1)
        self._validate_tasks(TEXT_TO_TEXT, "is not text-to-text; BartTaskRouted supports")
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
        self.routed_encoder_layers = check_layer_list(
            self.routed_encoder_layers, "routed_encoder_layers", self.encoder_layers
        )
        self.routed_decoder_layers = check_layer_list(
            self.routed_decoder_layers, "routed_decoder_layers", self.decoder_layers
        )
        check_float(self.gumbel_temperature, "gumbel_temperature", minimum=1e-6)
        check_float(self.gumbel_min_temperature, "gumbel_min_temperature", minimum=1e-6)
        check_float(self.gumbel_anneal_rate, "gumbel_anneal_rate", minimum=0.0)
        if self.router_init_std is not None:
            check_float(self.router_init_std, "router_init_std", minimum=0.0)
        check_float(self.task_embedding_init_std, "task_embedding_init_std", minimum=0.0)

    # ------------------------------------------------------------------ views
    @property
    def task_dim(self) -> int:
        return self.task_embedding_dim or self.d_model

    @property
    def router_std(self) -> float:
        return self.router_init_std if self.router_init_std is not None else 2.0 / self.task_dim**0.5

    @property
    def router_hidden(self) -> int:
        return self.router_hidden_size or self.task_dim

    @property
    def encoder_route_layers(self) -> list[int]:
        return (
            list(range(self.encoder_layers)) if self.routed_encoder_layers is None else list(self.routed_encoder_layers)
        )

    @property
    def decoder_route_layers(self) -> list[int]:
        return (
            list(range(self.decoder_layers)) if self.routed_decoder_layers is None else list(self.routed_decoder_layers)
        )

    @property
    def route_names(self) -> list[str]:
        """Names of the routed layers, in the order of the router's layer axis (`E3` = encoder layer 3)."""
        return [f"E{i}" for i in self.encoder_route_layers] + [f"D{i}" for i in self.decoder_route_layers]

    @property
    def num_routed_layers(self) -> int:
        return len(self.encoder_route_layers) + len(self.decoder_route_layers)

    @classmethod
    def from_dense_config(cls, dense_config: BartConfig, tasks, **kwargs):
        """Copy the architecture of a dense BART config and add tasks and the routing settings."""
        return cls._from_dense_fields(
            dense_config, tasks, "bart", DENSE_BART_FIELDS, "; see `bart_from_bert` for a BERT warm start", **kwargs
        )
