"""The family contract: what a family's task model declares and which hooks it provides.

Every family's task model (the class users train) is a `MultiTaskPreTrainedModel` and declares its parameters'
roles once, as a class attribute `parameter_roles = ParameterRoles(...)`. The library reads every
parameter-role question from there and nowhere else:

- `roles`: which role a parameter has (`analysis.parameter_report`, `group_learning_rates`);
- `task_specific`: what a task owns, trained alone in a second stage (`freeze_shared_parameters`,
  `train_task_specific_only`);
- `possibly_idle`: what may get no gradient in a step (`MultiTaskTrainer` under DDP / DeepSpeed);
- `new`: what a dense checkpoint has no weight for (`from_dense`; the upcycling report's `new`).

A family whose parameters hold several modules' weights stacked on a leading axis (MT-TaG's `ExpertBank`: one
tensor per kind of expert weight) declares them as `stacked_weights = (StackedWeight(...), ...)`: upcycling copies a
dense weight into every slice.

The hooks (defaults on `MultiTaskPreTrainedModel`; a family overrides what it needs):

- `_grow_for_task(new_id, source_id)`: a task's weights besides its head, for `add_task` (required by a class that
  sets `records_task_order = True`: checked when the class is defined).
- `_after_load()`: what `from_pretrained` must restore (a family holding a dense model: its `apply_freezing`).
- `max_input_length()` / `_input_limit_name()`: the longest input and the config field that sets it.
- `set_training_step(step)`: step-dependent state the trainer sets before each training forward (Gumbel
  temperature annealing); the default does nothing.
- `from_dense(...)` (classmethod) and `upcycling_rules()`: building from a dense checkpoint (the family's
  `Family.upcycling`, unless the model holds a dense model: `hf_taskmoe.models.dense_wrapper.DenseWrapperMixin`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property

from torch import nn

#: the per-task heads, `MultiTaskHeads` at the task model's root: every family with heads has this role
HEAD = r"^heads\."


@dataclass(frozen=True)
class ParameterRoles:
    """Each parameter's role in one family, declared once on the task model class (`parameter_roles`).

    Args:
        roles: role name -> regex (`re.search` on the task model's parameter names). A parameter takes the first
            role that matches; one that matches none is `shared`. With `heads=True` the role `head` (`HEAD`) is
            added last.
        task_specific: roles a task owns: trained alone by the two-stage protocols (`freeze_shared_parameters`,
            `MultiTaskTrainingArguments(train_task_specific_only=True)`; PALs section 3.4).
        possibly_idle: roles whose parameters may get no gradient in a step (an absent task's head, PALs, routed
            experts no row chose): touched with a zero under DDP so every rank reduces the same gradients. The list is
            complete (`"head"` included where heads can sit out); default: `("head",)` with heads, else none.
        new: roles no dense checkpoint has (gates, PALs, task embeddings, heads): freshly initialised by `from_dense`
            and listed as new in its upcycling report.
        also_new: regexes of other weights that are new on upcycling without being a parameter role (a buffer).
        heads: whether the model has per-task heads (`heads.<task>`); adds the `head` role, task-specific and new.
    """

    roles: Mapping[str, str] = field(default_factory=dict)
    task_specific: tuple[str, ...] = ()
    possibly_idle: tuple[str, ...] | None = None
    new: tuple[str, ...] = ()
    also_new: tuple[str, ...] = ()
    heads: bool = True

    def __post_init__(self):
        roles = dict(self.roles)
        if self.heads:
            if "head" in roles:
                raise ValueError("`head` is declared by `heads=True`; do not list it in `roles`.")
            roles["head"] = HEAD
        if "shared" in roles:
            raise ValueError("`shared` is what matches no role; it cannot be declared.")
        for pattern in (*roles.values(), *self.also_new):
            re.compile(pattern)  # a bad regex fails where the family is defined
        object.__setattr__(self, "roles", roles)
        if self.possibly_idle is None:  # an absent task's head gets no gradient
            object.__setattr__(self, "possibly_idle", ("head",) if self.heads else ())
        for what in ("task_specific", "possibly_idle", "new"):
            names = tuple(getattr(self, what)) + (("head",) if self.heads and what != "possibly_idle" else ())
            unknown = sorted(set(names) - set(roles))
            if unknown:
                raise ValueError(f"`{what}` names {unknown}, which are not roles; the roles are {sorted(roles)}.")
            object.__setattr__(self, what, tuple(dict.fromkeys(names)))

    # ------------------------------------------------------------------ patterns
    def patterns(self, roles: Iterable[str]) -> tuple[str, ...]:
        """The regexes of `roles` (names of this family's roles)."""
        return tuple(self.roles[r] for r in roles)

    @property
    def task_specific_patterns(self) -> tuple[str, ...]:
        return self.patterns(self.task_specific)

    @property
    def possibly_idle_patterns(self) -> tuple[str, ...]:
        return self.patterns(self.possibly_idle)

    @property
    def new_patterns(self) -> tuple[str, ...]:
        """What `UpcyclingRules.new` takes: the new roles' regexes, then `also_new`."""
        return self.patterns(self.new) + tuple(self.also_new)

    @cached_property
    def _compiled(self) -> dict[str, re.Pattern]:
        return {role: re.compile(p) for role, p in self.roles.items()}

    def role_of(self, name: str) -> str:
        """The role of the parameter called `name` (`shared` when none matches)."""
        return next((role for role, pattern in self._compiled.items() if pattern.search(name)), "shared")

    def has(self, name: str, roles: Iterable[str]) -> bool:
        """Whether parameter `name` matches one of `roles`' regexes (a parameter may match several roles' regexes;
        `role_of` gives the first)."""
        return any(self._compiled[r].search(name) for r in roles)


#: the roles of a module of no family: none (every parameter is `shared`). Each consumer says what it assumes then:
#: the heads are task-specific if there are any, and every parameter may be idle in a step.
UNDECLARED = ParameterRoles(heads=False)


def parameter_roles_of(model: nn.Module) -> ParameterRoles:
    """The `ParameterRoles` of `model`, through the wrappers users put around it (peft's `get_base_model`,
    DDP / DataParallel's `module`); `UNDECLARED` for a module of no family."""
    for _ in range(4):
        roles = getattr(type(model), "parameter_roles", None)  # declared by the class (not a wrapper's forwarding)
        if isinstance(roles, ParameterRoles):
            return model.parameter_roles  # the instance's: a family's may depend on its config (`expert_rank`)
        if hasattr(model, "get_base_model"):
            model = model.get_base_model()
        elif isinstance(getattr(model, "module", None), nn.Module):
            model = model.module
        else:
            break
    return UNDECLARED


@dataclass(frozen=True)
class StackedWeight:
    """Parameters stored with a leading axis of slices (one per expert): `pattern` (`re.fullmatch` on a parameter's
    name) names them."""

    pattern: str


def is_stacked(model: nn.Module, name: str) -> bool:
    """Whether parameter `name` of `model` holds one slice per expert on its leading axis."""
    return any(re.fullmatch(s.pattern, name) for s in getattr(model, "stacked_weights", ()))


#: the task-routed families' roles (BART, causal LMs, T5: Ye et al.): the router's network, the task representations
#: it reads, and the forked layers' experts. No heads (the LM head is shared); a task's representation is its own;
#: an absent task's representation and, under hard routing, the experts no task of the batch chose sit out a step;
#: the router is new on upcycling.
TASK_ROUTING_ROLES = ParameterRoles(
    roles={"router": r"^router\.net\.", "task_embedding": r"^router\.task_embeddings\.", "expert": r"\.experts\."},
    task_specific=("task_embedding",),
    possibly_idle=("task_embedding", "expert"),
    new=("router", "task_embedding"),
    also_new=(r"\.lora_[AB]$",),  # low-rank experts' deltas (`expert_rank`): new on upcycling
    heads=False,
)

#: the roles of a task-routed model with low-rank experts (`expert_rank`): each routed layer is one shared copy of the
#: dense layer, and its linears' LoRA deltas (`lora_A`, `lora_B`: one slice per expert) are the experts
LOW_RANK_ROUTING_ROLES = ParameterRoles(
    roles={"router": r"^router\.net\.", "task_embedding": r"^router\.task_embeddings\.", "expert": r"\.lora_[AB]$"},
    task_specific=("task_embedding",),
    possibly_idle=("task_embedding", "expert"),
    new=("router", "task_embedding", "expert"),
    heads=False,
)
