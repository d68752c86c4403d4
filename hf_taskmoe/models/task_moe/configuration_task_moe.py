"""Configuration of `TaskMoEForMultiTask`: MT-TaG / MT-Switch / MT-Dense on any declared encoder."""

from __future__ import annotations

from ...compat import own_experts_implementation
from ...layers.moe import AUTO, EXPERT_WEIGHTINGS, GATING_TYPES
from ...utils import check_choice, check_float, check_int
from ..encoder import TaskEncoderConfig

__all__ = ["TaskMoEConfig"]


class TaskMoEConfig(TaskEncoderConfig):
    r"""
    Configuration of a dense encoder of any declared architecture (BERT, RoBERTa, XLM-R, ELECTRA, DistilBERT,
    DeBERTa-v2/v3, ModernBERT: `hf_taskmoe.backbones.backbone_names("encoder")`) whose feed-forward blocks become
    mixtures of experts with task-aware (MT-TaG) or shared (MT-Switch) top-k gates, plus one head per task.
    `num_experts=1` is MT-Dense: the model then computes exactly what the dense model computes with the same weights.
    The fields of `TaskEncoderConfig` (`dense_config`, `tasks`, `classifier_pooling`, ...) and MT-TaG's own:

    Args:
        num_experts (`int`, *optional*, defaults to 4):
            Experts per MoE layer (the paper uses 4). 1 = MT-Dense.
        gating (`str`, *optional*, defaults to `"task"`):
            `"task"`: one gate `W_{g,t}` per task (MT-TaG); `"shared"`: one gate for all tasks (MT-Switch).
        top_k (`int`, *optional*, defaults to 1):
            Experts per token (the paper routes top-1, which keeps the dense model's FLOPs).
        moe_layers (`list[int]`, *optional*):
            Indices of the layers whose FFN is a mixture of experts; the others keep the dense FFN. Defaults to every
            layer (as in the paper).
        expert_weighting (`str`, *optional*, defaults to `"straight_through"`):
            `"straight_through"`: the value of `E*(x)` with the gradient of eq. 6 reaching the gate, so that an
            upcycled model starts exactly at the dense one; `"gate"`: `h = g* E*(x)` (paper eq. 6), which scales every
            FFN output by about 1/N at an upcycled start. The default everywhere (config, `from_dense`, the example
            script) since straight-through scored higher on every demo task but BoolQ (docs/mt-tag.md, "Upcycling").
            See `hf_taskmoe.layers.moe.TaskMoE`.
        experts_implementation (`str`, *optional*, defaults to `"taskmoe_auto"`):
            transformers' own key (`from_pretrained(..., experts_implementation=...)`,
            `model.set_experts_implementation(...)`; not saved in config.json): which implementation of transformers'
            experts registry runs the stacked experts (`hf_taskmoe.layers.moe.ExpertBank`). transformers' `"eager"`
            (every expert on every token, mixed by the gates), `"batched_mm"`, `"grouped_mm"` or a kernel registered
            there; MT-TaG's `"taskmoe_sorted"` (tokens sorted by expert, a loop of `F.linear`s per expert in eager code
            on a CPU, one grouped GEMM per projection elsewhere and under torch.compile, outputs put back without atomic
            adds), `"taskmoe_sorted_loop"` / `"taskmoe_sorted_grouped"` (the same with the loop / the grouped GEMMs
            everywhere: the loop reads the slice sizes back and is a graph break under torch.compile); or
            `"taskmoe_auto"`, which
            picks per call by device and dtype (`hf_taskmoe.layers.moe.default_experts_implementation`). The same
            values within fp32 rounding. Experts that are whole FFN modules (DistilBERT's `ffn`, ModernBERT's gated
            `mlp`) always run MT-TaG's loop over the sorted tokens; they take MT-TaG's names only.
        router_init_std (`float`, *optional*, defaults to 0.001):
            Standard deviation of the normal initialisation of the gates (paper section 4.4).
        router_aux_loss_coef (`float`, *optional*, defaults to 0.0):
            Weight of the Switch load-balancing loss added to the training loss (off in the paper).
        router_z_loss_coef (`float`, *optional*, defaults to 0.0):
            Weight of the ST-MoE router z-loss added to the training loss (off in the paper).
    """

    model_type = "taskmoe_moe"
    method_name = "MT-TaG (TaskMoEForMultiTask)"

    num_experts: int = 4
    gating: str = "task"
    top_k: int = 1
    moe_layers: list | None = None
    expert_weighting: str = "straight_through"
    router_init_std: float = 0.001
    router_aux_loss_coef: float = 0.0
    router_z_loss_coef: float = 0.0
    # (transformers' `experts_implementation`, MT-TaG's default where unset, kept off `dense_config`: its dense model
    # has no experts and would refuse "grouped_mm" when built)
    _experts_implementation = own_experts_implementation(default=AUTO)

    def _validate(self) -> None:
        super()._validate()
        check_int(self.num_experts, "num_experts", minimum=1)
        check_choice(self.gating, GATING_TYPES, "gating")
        check_int(self.top_k, "top_k", minimum=1, maximum=self.num_experts)
        check_choice(self.expert_weighting, EXPERT_WEIGHTINGS, "expert_weighting")
        check_float(self.router_init_std, "router_init_std", minimum=0.0)
        check_float(self.router_aux_loss_coef, "router_aux_loss_coef", minimum=0.0)
        check_float(self.router_z_loss_coef, "router_z_loss_coef", minimum=0.0)
        self.moe_layers = self._check_layer_list("moe_layers")

    @property
    def moe_layer_indices(self) -> list[int]:
        """Layers whose FFN is a mixture (all layers when `moe_layers` is None; none when `num_experts=1`)."""
        if self.num_experts == 1:
            return []
        return list(range(self.num_hidden_layers)) if self.moe_layers is None else list(self.moe_layers)
