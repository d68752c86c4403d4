"""Configuration of `BertForTaskMoE` (MT-TaG / MT-Switch / MT-Dense)."""

from __future__ import annotations

from typing import Any

from huggingface_hub.errors import StrictDataclassError
from transformers import BertConfig

from ...layers.heads import HEAD_TYPES
from ...layers.moe import EXPERT_WEIGHTINGS, ROUTER_TYPES
from ...tasks import TaskSpec, parse_tasks
from ...utils import check_choice, check_float, check_int

CLASSIFIER_POOLINGS = ("pooler", "cls", "mean")


class BertTaskMoEConfig(BertConfig):
    r"""
    Configuration of a BERT encoder whose feed-forward blocks are mixtures of experts with task-aware
    (MT-TaG) or shared (MT-Switch) top-k gating, plus one head per task. `num_experts=1` is MT-Dense: the
    model then computes exactly what transformers' `BertModel` computes with the same weights.

    Every field of `BertConfig` is accepted (hidden size, layers, heads, dropout, ...). The others:

    Args:
        tasks (`list[dict]`):
            The tasks, as `TaskSpec` dicts (a `TaskSpec` is accepted and stored as its dict). Task id `i`
            in `forward` is `tasks[i]`. Saved with the config, so heads and gates come back with
            `from_pretrained`.
        num_experts (`int`, *optional*, defaults to 4):
            Experts per MoE layer (the paper uses 4). 1 = MT-Dense.
        gating (`str`, *optional*, defaults to `"task"`):
            `"task"`: one gate `W_{g,t}` per task (MT-TaG); `"shared"`: one gate for all tasks (MT-Switch).
        top_k (`int`, *optional*, defaults to 1):
            Experts per token (the paper routes top-1, which keeps the dense model's FLOPs).
        moe_layers (`list[int]`, *optional*):
            Indices of the layers whose FFN is a mixture of experts; the others keep one dense FFN.
            Defaults to every layer (as in the paper).
        expert_weighting (`str`, *optional*, defaults to `"gate"`):
            `"gate"`: `h = g* E*(x)` (paper eq. 6). `"straight_through"`: the value of `E*(x)` with the
            gradient of eq. 6 reaching the gate, so that an upcycled model starts exactly at the dense one.
            See `hf_taskmoe.layers.moe.TaskMoE`.
        router_init_std (`float`, *optional*, defaults to 0.001):
            Standard deviation of the normal initialisation of the gates (paper section 4.4).
        router_aux_loss_coef (`float`, *optional*, defaults to 0.0):
            Weight of the Switch load-balancing loss added to the training loss (off in the paper).
        router_z_loss_coef (`float`, *optional*, defaults to 0.0):
            Weight of the ST-MoE router z-loss added to the training loss (off in the paper).
        scale_loss_by_num_classes (`bool`, *optional*, defaults to `False`):
            Divide each classification task's cross-entropy by `log(num_classes)` (paper section 3.3).
        classifier_pooling (`str`, *optional*, defaults to `"pooler"`):
            Sequence representation the heads read: `"pooler"` (BERT's tanh pooler on [CLS]), `"cls"` (the
            [CLS] hidden state) or `"mean"` (mean over real tokens).
        upcycled_from (`str`, *optional*):
            Set by `BertForTaskMoE.from_dense`: the dense checkpoint the model was built from (model cards).
    """

    model_type = "taskmoe_bert"

    tasks: list | None = None
    num_experts: int = 4
    gating: str = "task"
    top_k: int = 1
    moe_layers: list | None = None
    expert_weighting: str = "gate"
    router_init_std: float = 0.001
    router_aux_loss_coef: float = 0.0
    router_z_loss_coef: float = 0.0
    scale_loss_by_num_classes: bool = False
    classifier_pooling: str = "pooler"
    upcycled_from: str | None = None

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        self._validate()

    def __setattr__(self, key, value):
        # BertConfig's own fields are type-checked by huggingface_hub's strict dataclass, which raises its own
        # error class; the contract of this library is a ValueError naming the field.
        try:
            super().__setattr__(key, value)
        except StrictDataclassError as err:
            raise ValueError(f"`{key}`: {str(err).splitlines()[-1].strip()}") from None

    def _validate(self) -> None:
        for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size"):
            check_int(getattr(self, name), name, minimum=1)
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"`hidden_size` ({self.hidden_size}) must be a multiple of `num_attention_heads` "
                f"({self.num_attention_heads})."
            )
        if self.tasks is None:
            raise ValueError("`tasks` is required: a list of TaskSpec (or their dicts), one per task.")
        specs = parse_tasks(self.tasks)
        for spec in specs:
            if spec.problem_type not in HEAD_TYPES:  # seq2seq needs a decoder
                raise ValueError(
                    f"Task {spec.name!r}: problem_type {spec.problem_type!r} needs a decoder; an encoder model "
                    f"supports {list(HEAD_TYPES)}."
                )
        # Stored as plain dicts: the config is JSON.
        self.tasks = [s.to_dict() for s in specs]
        check_int(self.num_experts, "num_experts", minimum=1)
        check_choice(self.gating, ROUTER_TYPES, "gating")
        check_int(self.top_k, "top_k", minimum=1, maximum=self.num_experts)
        check_choice(self.expert_weighting, EXPERT_WEIGHTINGS, "expert_weighting")
        check_choice(self.classifier_pooling, CLASSIFIER_POOLINGS, "classifier_pooling")
        check_float(self.router_init_std, "router_init_std", minimum=0.0)
        check_float(self.router_aux_loss_coef, "router_aux_loss_coef", minimum=0.0)
        check_float(self.router_z_loss_coef, "router_z_loss_coef", minimum=0.0)
        if not isinstance(self.scale_loss_by_num_classes, bool):
            raise ValueError(f"`scale_loss_by_num_classes` must be a bool, got {self.scale_loss_by_num_classes!r}.")
        if self.moe_layers is not None:
            if isinstance(self.moe_layers, (str, bytes)) or not hasattr(self.moe_layers, "__iter__"):
                raise ValueError(f"`moe_layers` must be a list of layer indices or None, got {self.moe_layers!r}.")
            layers = [check_int(i, "moe_layers[]", 0, self.num_hidden_layers - 1) for i in self.moe_layers]
            if len(set(layers)) != len(layers):
                raise ValueError(f"`moe_layers` must not repeat a layer, got {layers}.")
            self.moe_layers = sorted(layers)

    # ------------------------------------------------------------------ views
    @property
    def task_specs(self) -> list[TaskSpec]:
        return [TaskSpec.from_dict(t) for t in self.tasks]

    @property
    def task_names(self) -> list[str]:
        return [t["name"] for t in self.tasks]

    @property
    def num_tasks(self) -> int:
        return len(self.tasks)

    @property
    def moe_layer_indices(self) -> list[int]:
        """Layers whose FFN is a mixture (all layers when `moe_layers` is None; none when `num_experts=1`)."""
        if self.num_experts == 1:
            return []
        return list(range(self.num_hidden_layers)) if self.moe_layers is None else list(self.moe_layers)

    @classmethod
    def from_dense_config(cls, dense_config: BertConfig, tasks, **kwargs: Any) -> "BertTaskMoEConfig":
        """Copy the architecture of a dense BERT config and add tasks and MoE settings."""
        if getattr(dense_config, "model_type", None) != "bert":
            raise ValueError(
                f"BertForTaskMoE upcycles BERT checkpoints (model_type 'bert', MiniLM included), got model_type "
                f"{getattr(dense_config, 'model_type', None)!r}."
            )
        keep = {
            name: getattr(dense_config, name)
            for name in (
                "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                "hidden_act", "hidden_dropout_prob", "attention_probs_dropout_prob", "max_position_embeddings",
                "type_vocab_size", "initializer_range", "layer_norm_eps", "pad_token_id", "classifier_dropout",
            )
        }
        keep.update(kwargs)
        return cls(tasks=[TaskSpec.from_dict(t).to_dict() for t in tasks], **keep)
