"""Configuration of `TaskMoEForMultiTask`: MT-TaG / MT-Switch / MT-Dense on any declared encoder."""

from __future__ import annotations

from ..backbone_encoder import BackboneTaskConfig
from ..bert_taskmoe.configuration_bert_taskmoe import moe_layer_indices, validate_moe_fields

__all__ = ["TaskMoEConfig"]


class TaskMoEConfig(BackboneTaskConfig):
    r"""
    Configuration of a dense encoder of any declared architecture (RoBERTa, XLM-R, ELECTRA, DistilBERT, DeBERTa-v2/v3,
    ModernBERT, BERT: `hf_taskmoe.backbones.backbone_names("encoder")`) whose feed-forward blocks become mixtures of
    experts with task-aware (MT-TaG) or shared (MT-Switch) top-k gates, plus one head per task. The fields of
    `BackboneTaskConfig` (`dense_config`, `tasks`, `classifier_pooling`, ...) and MT-TaG's own, which mean what they
    mean in `BertTaskMoEConfig`:

    Args:
        num_experts (`int`, *optional*, defaults to 4): experts per MoE layer; 1 = MT-Dense (the dense model).
        gating (`str`, *optional*, defaults to `"task"`): `"task"` (MT-TaG) or `"shared"` (MT-Switch).
        top_k (`int`, *optional*, defaults to 1): experts per token.
        moe_layers (`list[int]`, *optional*): the layers whose FFN is a mixture (default: every layer).
        expert_weighting (`str`, *optional*, defaults to `"straight_through"`): `"straight_through"` (an upcycled
            model computes exactly the dense model) or `"gate"` (the paper's `g* E*(x)`).
        expert_dispatch (`str`, *optional*, defaults to `"auto"`): `"sorted_loop"`, `"grouped_mm"` (plain
            two-projection FFNs only: not DistilBERT's or ModernBERT's, whose experts are whole FFN modules) or
            `"auto"` (the grouped GEMM on an accelerator and under torch.compile where the FFN allows, else the loop).
        router_init_std (`float`, *optional*, defaults to 0.001): std of the gates' normal initialisation.
        router_aux_loss_coef / router_z_loss_coef (`float`, *optional*, defaults to 0.0): weights of the
            load-balancing and router z-losses.
    """

    model_type = "taskmoe_moe"
    method_name = "MT-TaG (TaskMoEForMultiTask)"

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
        if self.expert_dispatch == "grouped_mm" and not self.backbone.ffn.split:
            raise ValueError(
                f"`expert_dispatch='grouped_mm'` stacks two plain projections per expert; a "
                f"{self.backbone.model_type} FFN is a whole module{' (gated)' if self.backbone.ffn.gated else ''}, "
                "whose experts are copies of it: use 'sorted_loop'."
            )

    @property
    def moe_layer_indices(self) -> list[int]:
        return moe_layer_indices(self)
