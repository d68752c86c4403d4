"""Configuration of `MMoEModel` (Multi-gate Mixture-of-Experts, OMoE, Shared-Bottom) for tabular rows."""

from __future__ import annotations

from transformers import PreTrainedConfig

from ...problem_types import TABULAR, problem_type_of
from ...utils import check_choice, check_float, check_int, check_str_list
from ..configuration import TaskConfigMixin

ARCHITECTURES = ("mmoe", "omoe", "shared_bottom")
HIDDEN_ACTS = ("relu", "gelu", "tanh", "sigmoid")


class MMoEConfig(TaskConfigMixin, PreTrainedConfig):
    r"""
    Configuration of a tabular multi-task model in which every row carries a label for every task
    (MMoE paper, section 4).

    Args:
        tasks (`list[dict]`):
            The tasks as `TaskSpec` dicts: `single_label_classification` (binary or multi-class) or `regression`.
            A row's label for task `k` is the data column `label_columns[k]`: the task's `label_field`, or its
            name when `label_field` is left at the default `"label"`.
        numeric_features (`list[str]`, *optional*, defaults to `[]`):
            Names of the numeric input columns (fed as they are: standardise them beforehand).
        categorical_features (`list[str]`, *optional*, defaults to `[]`):
            Names of the categorical input columns, each holding integer codes in `[0, cardinality)`.
        categorical_cardinalities (`list[int]`, *optional*, defaults to `[]`):
            Number of values of each categorical feature (same order as `categorical_features`).
        embedding_dim (`int`, *optional*, defaults to 4):
            Size of each categorical feature's embedding; the model input is the numeric features followed by
            the embeddings.
        architecture (`str`, *optional*, defaults to `"mmoe"`):
            `"mmoe"`: one softmax gate per task over shared experts (eq. 6-7); `"omoe"`: one gate shared by all
            tasks; `"shared_bottom"`: one bottom network shared by all tasks (eq. 1).
        num_experts (`int`, *optional*, defaults to 8):
            Experts of the MoE models (the paper's synthetic experiment: 8).
        expert_hidden_sizes (`list[int]`, *optional*, defaults to `[16]`):
            Layer sizes of each expert MLP (the paper: one layer of 16).
        bottom_hidden_sizes (`list[int]`, *optional*, defaults to `[113]`):
            Layer sizes of the Shared-Bottom network (the paper: 113, the same parameter budget as 8 x 16 experts).
        tower_hidden_sizes (`list[int]`, *optional*, defaults to `[8]`):
            Hidden layer sizes of each task's tower, before its output layer (the paper: one layer of 8).
        hidden_act (`str`, *optional*, defaults to `"relu"`):
            Activation of experts, bottom and towers (the paper: ReLU).
        dropout (`float`, *optional*, defaults to 0.0):
            Dropout after every hidden layer.
        use_bias (`bool`, *optional*, defaults to `True`):
            Biases in experts, bottom and towers. The paper's parameter count (13,056) omits them.
        gate_bias (`bool`, *optional*, defaults to `False`):
            Bias in the gates; the paper's gate is `softmax(W_gk x)`, without one.
        initializer_range (`float`, *optional*, defaults to 0.05):
            Standard deviation of the categorical embeddings. Linear layers use Glorot-uniform weights and zero
            biases (TensorFlow's default, which the paper used).
    """

    model_type = "taskmoe_mmoe"
    #: what `RoutingStatistics` counts for this family: rows (every row passes every task's gate)
    routing_unit = "examples"

    tasks: list | None = None
    numeric_features: list | None = None
    categorical_features: list | None = None
    categorical_cardinalities: list | None = None
    embedding_dim: int = 4
    architecture: str = "mmoe"
    num_experts: int = 8
    expert_hidden_sizes: list | None = None
    bottom_hidden_sizes: list | None = None
    tower_hidden_sizes: list | None = None
    hidden_act: str = "relu"
    dropout: float = 0.0
    use_bias: bool = True
    gate_bias: bool = False
    initializer_range: float = 0.05

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        self._validate()

    def _validate(self) -> None:
        self._validate_tasks(TABULAR, "is not supported by MMoEModel; use one of")
        self.numeric_features = check_str_list(self.numeric_features or [], "numeric_features", allow_empty=True)
        self.categorical_features = check_str_list(
            self.categorical_features or [], "categorical_features", allow_empty=True
        )
        cards = list(self.categorical_cardinalities or [])
        if len(cards) != len(self.categorical_features):
            raise ValueError(
                f"`categorical_cardinalities` needs one value per categorical feature "
                f"({len(self.categorical_features)}), "
                f"got {len(cards)}."
            )
        self.categorical_cardinalities = [check_int(c, "categorical_cardinalities[]", minimum=1) for c in cards]
        names = self.numeric_features + self.categorical_features
        if not names and self.tasks is not None:  # without tasks: a default config (transformers compares with one)
            raise ValueError("Give at least one input column in `numeric_features` or `categorical_features`.")
        if len(set(names)) != len(names):
            raise ValueError(f"Feature names must be unique, got {names}.")
        labels = self.label_columns
        clash = sorted(set(labels) & set(names))
        if clash:
            raise ValueError(f"Label columns {clash} are also listed as input features: remove them from the features.")
        check_int(self.embedding_dim, "embedding_dim", minimum=1)
        check_choice(self.architecture, ARCHITECTURES, "architecture")
        check_int(self.num_experts, "num_experts", minimum=1)
        for name, default in (
            ("expert_hidden_sizes", [16]),
            ("bottom_hidden_sizes", [113]),
            ("tower_hidden_sizes", [8]),
        ):
            value = getattr(self, name)
            value = list(default) if value is None else value
            if isinstance(value, (str, bytes, int)) or not hasattr(value, "__iter__"):
                raise ValueError(f"`{name}` must be a list of layer sizes, got {value!r}.")
            value = [check_int(v, f"{name}[]", minimum=1) for v in value]
            if not value and name != "tower_hidden_sizes":
                raise ValueError(f"`{name}` needs at least one layer.")
            setattr(self, name, value)
        check_choice(self.hidden_act, HIDDEN_ACTS, "hidden_act")
        check_float(self.dropout, "dropout", minimum=0.0, maximum=1.0)
        check_float(self.initializer_range, "initializer_range", minimum=0.0)
        for name in ("use_bias", "gate_bias"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"`{name}` must be a bool, got {getattr(self, name)!r}.")

    # ------------------------------------------------------------------ views
    @property
    def route_names(self) -> list[str]:
        """The routed "layers" for `RoutingStatistics`: the gate layer (MMoE/OMoE), none for Shared-Bottom."""
        return [] if self.architecture == "shared_bottom" else ["gates"]

    @property
    def label_columns(self) -> list[str]:
        """Data column holding each task's label."""
        return [t["name"] if t.get("label_field", "label") == "label" else t["label_field"] for t in self.tasks or []]

    @property
    def input_size(self) -> int:
        return len(self.numeric_features) + self.embedding_dim * len(self.categorical_features)

    @property
    def task_output_sizes(self) -> list[int]:
        """Logit columns of each task: 1 for regression, `num_labels` for classification."""
        return [problem_type_of(s).logit_width(s) for s in self.task_specs]
