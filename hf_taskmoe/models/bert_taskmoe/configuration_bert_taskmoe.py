"""Configuration of `BertForTaskMoE` (MT-TaG / MT-Switch / MT-Dense)."""

from __future__ import annotations

from ...layers.moe import EXPERT_DISPATCHES, EXPERT_WEIGHTINGS, GATING_TYPES, HAS_GROUPED_MM
from ...utils import check_choice, check_float, check_int
from ..multitask_bert import CLASSIFIER_POOLINGS, MultiTaskBertConfig

__all__ = ["BertTaskMoEConfig", "CLASSIFIER_POOLINGS"]


def validate_moe_fields(config) -> None:
    """The checks of MT-TaG's own fields, shared by `BertTaskMoEConfig` and the backbone-generic `TaskMoEConfig`."""
    check_int(config.num_experts, "num_experts", minimum=1)
    check_choice(config.gating, GATING_TYPES, "gating")
    check_int(config.top_k, "top_k", minimum=1, maximum=config.num_experts)
    check_choice(config.expert_weighting, EXPERT_WEIGHTINGS, "expert_weighting")
    check_choice(config.expert_dispatch, EXPERT_DISPATCHES, "expert_dispatch")
    if config.expert_dispatch == "grouped_mm" and not HAS_GROUPED_MM:
        import torch

        raise ValueError(
            f"`expert_dispatch='grouped_mm'` needs `torch.nn.functional.grouped_mm`, which torch {torch.__version__} "
            "lacks; use 'auto' or 'sorted_loop', or a newer torch."
        )
    if config.expert_dispatch == "grouped_mm" and (config.hidden_size % 8 or config.intermediate_size % 8):
        raise ValueError(
            "`expert_dispatch='grouped_mm'` needs `hidden_size` and `intermediate_size` divisible by 8 (grouped GEMM "
            f"strides are 16-byte aligned), got {config.hidden_size} and {config.intermediate_size}; use "
            "'sorted_loop'."
        )
    check_float(config.router_init_std, "router_init_std", minimum=0.0)
    check_float(config.router_aux_loss_coef, "router_aux_loss_coef", minimum=0.0)
    check_float(config.router_z_loss_coef, "router_z_loss_coef", minimum=0.0)
    config.moe_layers = config._check_layer_list("moe_layers")


def moe_layer_indices(config) -> list[int]:
    """Layers whose FFN is a mixture (all layers when `moe_layers` is None; none when `num_experts=1`)."""
    if config.num_experts == 1:
        return []
    return list(range(config.num_hidden_layers)) if config.moe_layers is None else list(config.moe_layers)


class BertTaskMoEConfig(MultiTaskBertConfig):
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
        expert_weighting (`str`, *optional*, defaults to `"straight_through"`):
            `"straight_through"`: the value of `E*(x)` with the gradient of eq. 6 reaching the gate, so that an
            upcycled model starts exactly at the dense one; `"gate"`: `h = g* E*(x)` (paper eq. 6), which scales every
            FFN output by about 1/N at an upcycled start. The default everywhere (config, `from_dense`, the example
            script) since straight-through scored higher on every demo task but BoolQ (docs/mt-tag.md, "Upcycling"). See
            `hf_taskmoe.layers.moe.TaskMoE`.
        expert_dispatch (`str`, *optional*, defaults to `"auto"`):
            How tokens reach their experts: `"sorted_loop"` (one `F.linear` per expert on its slice of the sorted
            tokens; one host sync per layer for the slice sizes), `"grouped_mm"` (`torch.nn.functional.grouped_mm`
            over all slices at once, no host sync; the fast path of recent GPUs in bf16) or `"auto"`: the grouped
            GEMM on an accelerator and under torch.compile, the loop on a CPU (the faster there). Same values either
            way; `benchmarks/gpu.py` and `benchmarks/moe_vs_dense.py` measure both.
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

    num_experts: int = 4
    gating: str = "task"
    top_k: int = 1
    moe_layers: list | None = None
    expert_weighting: str = "straight_through"
    expert_dispatch: str = "auto"
    router_init_std: float = 0.001
    router_aux_loss_coef: float = 0.0
    router_z_loss_coef: float = 0.0

    def _validate(self) -> None:
        super()._validate()
        validate_moe_fields(self)

    # ------------------------------------------------------------------ views
    @property
    def moe_layer_indices(self) -> list[int]:
        """Layers whose FFN is a mixture (all layers when `moe_layers` is None; none when `num_experts=1`)."""
        return moe_layer_indices(self)
