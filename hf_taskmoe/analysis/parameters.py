"""Parameter accounting: how many parameters are shared, expert, gating, head (or adapter) parameters.

Each family names the roles of its parameters once, in its `parameter_roles` (`hf_taskmoe.contract`: role ->
regex on parameter names); whatever matches no role is `shared`. A parameter tensor that several modules share (tied
weights, PALs shared by a task group) is counted once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from ..contract import parameter_roles_of


@dataclass
class ParameterReport:
    """Parameter counts by role. `by_role["shared"]` is everything no family-specific role claims."""

    total: int
    by_role: dict[str, int] = field(default_factory=dict)
    trainable: int = 0
    dense_equivalent: int | None = None

    def __getattr__(self, role: str) -> int:
        # report.expert, report.gating, ... read like fields; unknown roles count 0.
        if role.startswith("_"):
            raise AttributeError(role)
        return self.__dict__.get("by_role", {}).get(role, 0)

    @property
    def ratio_to_dense(self) -> float | None:
        """Total parameters relative to the dense backbone they were built from (when known)."""
        return self.total / self.dense_equivalent if self.dense_equivalent else None

    def to_dict(self) -> dict:
        out = {"total": self.total, "trainable": self.trainable, **self.by_role}
        if self.dense_equivalent:
            out["dense_equivalent"] = self.dense_equivalent
            out["ratio_to_dense"] = round(self.ratio_to_dense, 4)
        return out

    def __str__(self) -> str:
        width = max(len(r) for r in [*self.by_role, "trainable", "total"])
        lines = [f"{role:<{width}}  {n:>13,}  {100 * n / self.total:6.2f}%" for role, n in self.by_role.items()]
        lines.append(f"{'total':<{width}}  {self.total:>13,}")
        lines.append(f"{'trainable':<{width}}  {self.trainable:>13,}")
        if self.dense_equivalent:
            lines.append(f"{'x dense':<{width}}  {self.ratio_to_dense:>13.3f}")
        return "\n".join(lines)


def parameter_report(model: nn.Module, dense_equivalent: int | None = None) -> ParameterReport:
    """Count `model`'s parameters by role (see module docstring).

    Args:
        model: any hf_taskmoe model (roles from its `parameter_roles`) or plain module (all `shared`).
        dense_equivalent: parameter count of the dense model it was built from, for `ratio_to_dense`.
    """
    roles = parameter_roles_of(model)
    by_role = {"shared": 0, **{role: 0 for role in roles.roles}}
    total = trainable = 0
    for name, param in model.named_parameters():  # named_parameters() yields each shared tensor once
        role = roles.role_of(name)
        by_role[role] += param.numel()
        total += param.numel()
        trainable += param.numel() if param.requires_grad else 0
    return ParameterReport(total=total, by_role=by_role, trainable=trainable, dense_equivalent=dense_equivalent)
