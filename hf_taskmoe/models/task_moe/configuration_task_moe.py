"""Configuration of `TaskMoEForMultiTask`: MT-TaG / MT-Switch / MT-Dense on any declared encoder."""

from __future__ import annotations

from ...compat import own_experts_implementation
from ...layers.low_rank import check_low_rank_fields
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
        expert_rank (`int`, *optional*):
            `None` (default): every expert is a whole copy of the FFN (the paper's). A positive int `r`: low-rank
            experts. An MoE layer then keeps the dense FFN, one copy, and each of its target linears holds
            `num_experts` LoRA deltas of rank `r` (`hf_taskmoe.layers.low_rank.TokenLowRankExperts`): expert `j` is
            the FFN with its deltas, and the router's top-k choice per token selects the deltas that token's linears
            add (`W x + s * sum_j d_tj B_j A_j x`, one stacked product, the FFN run once on every token; top-k mixes
            the chosen deltas, not the experts' outputs). Upcycling sets every `B` to zero (peft's init), so every
            expert starts equal to the dense FFN and, with straight-through weighting, the model computes the dense
            model's outputs exactly: the experts differ only through the tokens the router sends them (the router gets
            its gradient through the gate weighting from the first step; the deltas, zero only at step 0, then
            diverge). Needs `num_experts > 1` (MT-Dense with deltas would be one LoRA: use peft).
            `experts_implementation` does not apply (nothing is stacked): only its default is accepted.
        expert_alpha (`float`, *optional*):
            peft's `lora_alpha`: the deltas are scaled by `expert_alpha / expert_rank`. Defaults to `2 * expert_rank`.
        expert_dropout (`float`, *optional*, defaults to 0.0):
            Dropout on the input of the deltas (peft's `lora_dropout`); the dense product reads the input unchanged.
        expert_targets (`list[str]`, *optional*):
            Which linears of an MoE layer's FFN get deltas: their names relative to the layer, or suffixes of them
            (BERT: `"intermediate.dense"`, `"output.dense"`; DistilBERT: `"ffn.lin1"`, `"ffn.lin2"`; ModernBERT:
            `"mlp.Wi"`, `"mlp.Wo"`). Default: every linear of the FFN, since an expert of MT-TaG is a whole FFN. A
            name that matches no linear of the FFN is refused.
        train_base (`bool`, *optional*, defaults to `False`):
            With `expert_rank` set: `False` freezes every dense weight (the FFNs, attention, embeddings, norms,
            pooler: `requires_grad=False`), so training holds gradients and optimizer state only for the deltas, the
            task gates and the heads (LoRA memory); `True` trains them too.
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
    expert_rank: int | None = None
    expert_alpha: float | None = None
    expert_dropout: float = 0.0
    expert_targets: list | None = None
    train_base: bool = False

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
        check_low_rank_fields(self, "every linear of an MoE layer's FFN")
        if self.expert_rank is not None and self.num_experts == 1:
            raise ValueError(
                f"`expert_rank={self.expert_rank}` gives each expert of an MoE layer its low-rank delta; with "
                "num_experts=1 (MT-Dense) there is no router and the deltas would be one LoRA on the dense model: "
                "set num_experts > 1, or train a dense model with peft's LoRA."
            )
        self.check_low_rank_experts_implementation(self._experts_implementation)

    def check_low_rank_experts_implementation(self, name) -> None:
        """With `expert_rank` set nothing is stacked: refuse an `experts_implementation` other than the default."""
        if self.expert_rank is not None and name not in (None, AUTO):
            raise ValueError(
                f"`experts_implementation={name!r}` picks how stacked whole experts run; with "
                f"`expert_rank={self.expert_rank}` an MoE layer is the dense FFN plus each expert's low-rank delta, "
                f"run as one stacked product, so it does not apply: leave it unset ('{AUTO}')."
            )

    @property
    def low_rank(self) -> bool:
        """Whether the experts are low-rank deltas over one shared FFN (`expert_rank` set)."""
        return self.expert_rank is not None

    @property
    def lora_alpha(self) -> float:
        """`expert_alpha` resolved: peft's `lora_alpha` of the deltas (defaults to `2 * expert_rank`)."""
        return float(self.expert_alpha) if self.expert_alpha is not None else 2.0 * self.expert_rank

    @property
    def moe_layer_indices(self) -> list[int]:
        """Layers whose FFN is a mixture (all layers when `moe_layers` is None; none when `num_experts=1`)."""
        if self.num_experts == 1:
            return []
        return list(range(self.num_hidden_layers)) if self.moe_layers is None else list(self.moe_layers)
