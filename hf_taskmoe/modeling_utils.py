"""Pieces every multi-task family shares: the base class `MultiTaskPreTrainedModel` (task bookkeeping, saving and
loading), the output dataclass. The input checks its families run at the top of `forward` are in `input_checks`."""

from __future__ import annotations

import logging
import os
import zlib
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel
from transformers import initialization as init
from transformers.utils import ModelOutput

from .contract import UNDECLARED, ParameterRoles, StackedWeight
from .input_checks import check_batch_dim, check_task_counts, resolve_task_ids
from .layers.heads import HeadsOutput, MultiTaskHeads
from .tasks import TaskSpec

logger = logging.getLogger(__name__)


@dataclass
class MultiTaskModelOutput(ModelOutput):
    """Output of a multi-task model.

    Args:
        loss (`torch.FloatTensor` of shape `()`, returned when `labels` are given):
            Mean over the batch's examples of their task's loss (times the task's `loss_weight`), plus any
            router auxiliary losses whose coefficient is set.
        logits (`torch.FloatTensor`):
            Logits in batch order when the batch holds one task (shape set by the task's head: `(batch,
            num_labels)`, `(examples, num_choices)` for multiple choice, `(batch, seq, num_labels)` for token
            classification), or when every task present has per-row logits of one shape. Otherwise None: use
            `task_logits`.
        task_losses (`dict[str, torch.FloatTensor]`, returned when `labels` are given):
            Loss of each task present in the batch (mean over that task's rows).
        task_logits (`dict[str, torch.FloatTensor]`):
            Logits of each task present, for its rows in batch order (`task_ids == id`).
        task_ids (`torch.LongTensor` of shape `(batch,)`):
            The task of each row (filled in when the model has a single task and none were given).
        hidden_states (`tuple(torch.FloatTensor)`, returned when `output_hidden_states=True`):
            Embedding output and every layer's output, each `(batch, seq, hidden)`.
        attentions (`tuple(torch.FloatTensor)`, returned when `output_attentions=True`):
            Attention probabilities of every layer, each `(batch, heads, seq, seq)` (eager attention).
    """

    loss: torch.FloatTensor | None = None
    logits: torch.FloatTensor | None = None
    task_losses: dict[str, torch.FloatTensor] | None = None
    task_logits: dict[str, torch.FloatTensor] | None = None
    task_ids: torch.LongTensor | None = None
    hidden_states: tuple[torch.FloatTensor, ...] | None = None
    attentions: tuple[torch.FloatTensor, ...] | None = None


def task_fingerprint(names: list[str]) -> torch.Tensor:
    """One int64 per task name (CRC-32), saved with the weights: the task order the gates and embeddings were
    trained in."""
    return torch.tensor([zlib.crc32(n.encode()) for n in names], dtype=torch.long)


def grow_embedding(old: torch.nn.Embedding, new_id: int, source: int | None, std: float) -> torch.nn.Embedding:
    """`old` with one more row, for a task added at `new_id`: task `source`'s row, or drawn from `N(0, std)` like at
    construction. Same class, device, dtype and trainability as `old` (the families' `_grow_for_task`)."""
    table = type(old)(old.num_embeddings + 1, old.embedding_dim).to(old.weight.device, old.weight.dtype)
    with torch.no_grad():
        init.normal_(table.weight, mean=0.0, std=std)
        table.weight[: old.num_embeddings] = old.weight
        if source is not None:
            table.weight[new_id] = old.weight[source]
    table.weight.requires_grad_(old.weight.requires_grad)
    return table


class MultiTaskPreTrainedModel(PreTrainedModel):
    """The base of every family's models: task bookkeeping (`config.tasks`, parsed once and cached by the config),
    `task_id` / `task_ids_for`, the input limits, growing by a task (`add_task`), and the task order saved with the
    weights and checked on load.

    A family's task model (the class users train) sets `records_task_order = True`, declares its parameters' roles
    (`parameter_roles`, a `ParameterRoles`) and implements `_grow_for_task(new_id, source_id)`: what a new task
    needs besides its head (a gate row, PALs, an embedding). Both are checked when such a class is defined. The
    other hooks of the family contract have defaults here (`hf_taskmoe.contract`).
    """

    #: each parameter's role (task-specific, possibly idle, new on upcycling, learning-rate group), declared once
    parameter_roles: ParameterRoles = UNDECLARED
    # the loss is the mean over the batch's examples: transformers' Trainer must divide it by the gradient
    # accumulation steps (a model that "accepts loss kwargs" would be trusted to do that itself)
    accepts_loss_kwargs = False
    #: whether this class keeps `task_fingerprint` (the family's task model; not its bare encoder)
    records_task_order = False
    #: parameters stored stacked, one slice per expert (upcycled slice by slice)
    stacked_weights: tuple[StackedWeight, ...] = ()

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if not cls.records_task_order:
            return
        missing = []
        if not isinstance(cls.parameter_roles, ParameterRoles) or cls.parameter_roles is UNDECLARED:
            missing.append("`parameter_roles = ParameterRoles(...)` (hf_taskmoe.contract)")
        if cls._grow_for_task is MultiTaskPreTrainedModel._grow_for_task:
            missing.append("`_grow_for_task(new_id, source_id)` (what `add_task` adds besides a head)")
        if missing:
            raise TypeError(f"{cls.__name__} is a family's task model (records_task_order = True) and must declare "
                            + " and ".join(missing) + ".")

    def post_init(self):
        super().post_init()
        if self.records_task_order and getattr(self.config, "tasks", None) is not None:
            # gates and task embeddings are rows in task order, heads are keyed by name: a config.json whose
            # `tasks` were reordered would silently pair them wrongly, so the order travels with the weights
            self.register_buffer("task_fingerprint", task_fingerprint(self.config.task_names), persistent=True)

    @torch.no_grad()
    def _init_weights(self, module):
        super()._init_weights(module)
        self._init_task_order(module)

    def _init_task_order(self, module) -> None:
        """`task_fingerprint` is a buffer: `init_weights()` of a model built on the meta device must set it too."""
        if module is self and getattr(self, "task_fingerprint", None) is not None:
            init.copy_(self.task_fingerprint, task_fingerprint(self.config.task_names))

    def save_pretrained(self, save_directory, *args, **kwargs):
        """transformers' `save_pretrained`.

        Atomic: the model is written into a temporary folder beside `save_directory` and swapped in once complete
        (`hf_taskmoe.folder_swap`), so a process killed at any moment of the save leaves the earlier model or the new
        one at the path, never a mix. The folder's other files (a tokenizer, a model card, checkpoints) survive, as
        they do in transformers; weight files of the earlier model of the kind the new save writes, under other names
        (another sharding), are dropped. Written in place as transformers does: a folder that cannot be swapped by
        renames (a mount point, the working folder, a symlink, a parent folder we cannot write in), a save by a
        process that is not the main one (`is_main_process=False`) and `distributed_checkpoint=True` (every rank
        writes)."""
        from .folder_swap import write_then_swap

        is_main_process = args[0] if args else kwargs.get("is_main_process", True)
        if (
            not is_main_process
            or kwargs.get("distributed_checkpoint", False)
            or (hasattr(self, "should_save_on_this_rank") and not self.should_save_on_this_rank(is_main_process))
        ):
            return super().save_pretrained(save_directory, *args, **kwargs)
        if kwargs.get("push_to_hub", False):  # the repository is named after the folder, not the temporary one
            kwargs.setdefault("repo_id", os.path.basename(os.path.abspath(save_directory)))
        result = []

        def write(folder):
            result.append(super(MultiTaskPreTrainedModel, self).save_pretrained(folder, *args, **kwargs))

        if write_then_swap(save_directory, write):
            return result[0]
        return super().save_pretrained(save_directory, *args, **kwargs)

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        """`PreTrainedModel.from_pretrained`, exact: the model loads only if its config.json describes the weights on
        file. A weight the config's model has and the file lacks (a head, an expert, a layer), a weight on file the
        model has no place for, or one of another shape (a hand-edited `num_experts`, `problem_type`,
        `num_hidden_layers`, `moe_layers`; a weights file missing a tensor) is refused with a `ValueError` naming
        them. `ignore_mismatched_sizes=True` opts in, as in transformers: those weights are then freshly initialised
        (a warning lists them). Without a checkpoint (`from_pretrained(None, config=..., state_dict=...)`) nothing
        on file is checked: what the state dict lacks is initialised, as in transformers. Weights a bare encoder
        leaves out of a task model's file (its heads) are no mismatch,
        nor is the task order (`task_fingerprint`) missing from a checkpoint saved before it was recorded."""
        from .folder_swap import loadable_path

        if args:  # a save killed between the two renames of its swap: the earlier model, in its backup folder
            args = (loadable_path(args[0]), *args[1:])
        elif "pretrained_model_name_or_path" in kwargs:
            kwargs["pretrained_model_name_or_path"] = loadable_path(kwargs["pretrained_model_name_or_path"])
        wants_info = kwargs.get("output_loading_info", False)
        opted_in = bool(kwargs.get("ignore_mismatched_sizes", False))
        # transformers raises a bare RuntimeError ("look at the above report") on a shape mismatch: let it load, and
        # refuse below by name
        model, info = super().from_pretrained(
            *args, **{**kwargs, "output_loading_info": True, "ignore_mismatched_sizes": True}
        )
        source = args[0] if args else kwargs.get("pretrained_model_name_or_path")
        # no checkpoint (`from_pretrained(None, config=..., state_dict=...)`): no config.json describes weights on
        # file, the caller hands both over; as in transformers, what the state dict lacks is initialised
        # (`_init_weights`) and listed in the loading info
        if source is not None:
            model._check_loaded_weights(
                info, source, opted_in or cls._saved_as_another_model(source, kwargs, model.config)
            )
        not_loaded = set(info.get("missing_keys", ())) | {m[0] for m in info.get("mismatched_keys", ())}
        model._check_task_order(saved="task_fingerprint" not in not_loaded)
        model._after_load()
        return (model, info) if wants_info else model

    @staticmethod
    def _saved_as_another_model(source, kwargs: dict, config) -> bool:
        """Whether `config=` was passed for a checkpoint saved as another model type (a dense BERT loaded straight
        into a family's class): transformers' partial load, with its report, not a saved model of ours to check."""
        from transformers import PretrainedConfig

        if not isinstance(kwargs.get("config"), PretrainedConfig) or source is None:
            return False
        hub = {k: kwargs[k] for k in ("cache_dir", "revision", "token", "local_files_only", "subfolder") if k in kwargs}
        try:
            saved, _ = PretrainedConfig.get_config_dict(source, **hub)
        except (OSError, ValueError):
            return False
        return saved.get("model_type") not in (None, config.model_type)

    def _check_loaded_weights(self, info: dict, source, opted_in: bool) -> None:
        """Refuse (or, opted in, warn about) weights the config describes but the file lacks, weights on file the model
        has no place for, and weights of another shape (`from_pretrained`)."""
        own = (
            set(dict(self.named_children()))
            | set(dict(self.named_parameters(recurse=False)))
            | set(dict(self.named_buffers(recurse=False)))
        )
        missing = sorted(k for k in info.get("missing_keys", ()) if k != "task_fingerprint")
        # keys outside this model's modules belong to a wrapper it was saved in (a task model's heads, loaded as its
        # bare encoder): transformers drops them, as it drops a task head's weights for a base model
        unexpected = sorted(k for k in info.get("unexpected_keys", ()) if k.split(".")[0] in own)
        mismatched = sorted(info.get("mismatched_keys", ()), key=lambda m: m[0])
        if not (missing or unexpected or mismatched):
            return

        def listed(keys: list[str]) -> str:
            return ", ".join(keys[:8]) + (f" and {len(keys) - 8} more" if len(keys) > 8 else "")

        parts = []
        if missing:
            parts.append(f"{len(missing)} weight(s) the config describes are not on file ({listed(missing)})")
        if unexpected:
            parts.append(
                f"{len(unexpected)} weight(s) on file have no place in the model the config describes "
                f"({listed(unexpected)})"
            )
        if mismatched:
            shapes = [
                f"{k} {tuple(saved)} on file, {tuple(expected)} in the model" for k, saved, expected in mismatched
            ]
            parts.append(f"{len(mismatched)} weight(s) differ in shape ({listed(shapes)})")
        what = f"{type(self).__name__} from {source}: " + "; ".join(parts)
        dense = (
            f"; to build from a dense checkpoint use `{type(self).__name__}.from_dense`"
            if hasattr(self, "from_dense")
            else ""
        )
        if opted_in:
            logger.warning(f"Loaded {what}. They are freshly initialised (ignore_mismatched_sizes=True, or `config=` "
                           f"given for a checkpoint of another model type): train them before use{dense}.")
            return
        raise ValueError(
            f"Cannot load {what}. The config.json does not describe the weights on file (a hand-edited config.json -- "
            f"num_experts, problem_type, num_labels, tasks, layer counts -- or a weights file cut short or from "
            "another "
            f"model), so the model would not be the one saved: weights left random or dropped. Restore the config.json "
            "saved with the weights (or the weights "
            f"saved with it){dense}; to load anyway with them freshly initialised, pass ignore_mismatched_sizes=True."
        )

    def _after_load(self) -> None:
        """What a family restores after `from_pretrained`, which creates the parameters anew (freezing)."""

    def set_training_step(self, step: int) -> None:
        """Step-dependent state `MultiTaskTrainer` sets before each training forward (BartTaskRouted: the Gumbel
        temperature's annealing). Nothing by default."""

    def upcycling_rules(self):
        """The `UpcyclingRules` `hf_taskmoe.upcycling.upcycle` copies a dense checkpoint into this model with: its
        family's `Family.upcycling` (None: not built from a dense checkpoint). A model holding a dense model overrides
        it (`DenseWrapperMixin`: the rules depend on the architecture it wraps)."""
        from .models.registry import family_of

        return family_of(self.config).upcycling

    @torch.no_grad()
    def _check_task_order(self, saved: bool = True) -> None:
        """Refuse a config.json whose task order differs from the weights'; a checkpoint saved before the order was
        recorded (`saved=False`) gets the config's order."""
        current = getattr(self, "task_fingerprint", None)
        if current is None:
            return
        expected = task_fingerprint(self.config.task_names).to(current.device)
        if not saved:
            self.task_fingerprint = expected
            return
        saved = current
        if saved.shape == expected.shape and torch.equal(saved, expected):
            return
        by_hash = {int(h): n for h, n in zip(expected.tolist(), self.config.task_names)}
        saved_names = [by_hash.get(int(h), "<a task not in config.json>") for h in saved.tolist()]
        raise ValueError(
            f"config.json lists the tasks {self.config.task_names}, but the weights were saved for the tasks in the "
            "order "
            f"{saved_names}. Gates and task embeddings are stored by position: restore that order in config.json."
        )

    # ------------------------------------------------------------------ tasks
    def max_input_length(self) -> int | None:
        """The longest input (tokens) the model takes: its position table, unless a family limits it further."""
        return getattr(self.config, "max_position_embeddings", None)

    def _input_limit_name(self) -> str:
        """The config field that sets `max_input_length` (for messages)."""
        return "max_position_embeddings"

    @property
    def task_names(self) -> list[str]:
        return self.config.task_names

    def task_id(self, name: str) -> int:
        """Index of task `name` (what `task_ids` holds)."""
        names = self.config.task_names
        if name not in names:
            raise ValueError(f"Unknown task {name!r}; this model's tasks are {names}.")
        return names.index(name)

    def task_ids_for(self, names: str | list[str], device=None) -> torch.LongTensor:
        """`task_ids` tensor for a task name (repeated by the caller) or a list of names, one per row."""
        names = [names] if isinstance(names, str) else list(names)
        return torch.tensor([self.task_id(n) for n in names], dtype=torch.long, device=device or self.device)

    def add_task(self, task: TaskSpec | dict, init_from: str | None = None) -> int:
        """Add a task after training: a fresh head, and the family's task-specific weights for it (MT-TaG: a gate;
        PALs: a PAL group; CA-MTL: a task embedding; BartTaskRouted: a task representation the router reads;
        MMoE: a gate, a tower and a head) copied from the related task `init_from` or drawn like at construction.
        Returns the new task id. Call it before building the optimizer: some parameters are replaced."""
        task = TaskSpec.from_dict(task)
        source = self.task_id(init_from) if init_from is not None else None
        if task.name in self.config.task_names:
            raise ValueError(f"Task {task.name!r} already exists; this model's tasks are {self.config.task_names}.")
        from .models.registry import family_of

        allowed = family_of(self.config).supported_problem_types
        if allowed and task.problem_type not in allowed:
            raise ValueError(
                f"Task {task.name!r}: problem_type {task.problem_type!r}; {type(self).__name__} supports "
                f"{list(allowed)}."
            )
        heads = getattr(self, "heads", None)
        if isinstance(heads, MultiTaskHeads):
            head = heads.add_task(task)
            head.to(self.device)
            head.train(self.training)  # a fresh module is in train mode; follow the model's mode
            head.apply(self._init_weights)
        self.config.tasks = [*self.config.tasks, task.to_dict()]
        new_id = len(self.config.tasks) - 1
        self._grow_for_task(new_id, source)
        if hasattr(self, "task_fingerprint"):
            self.task_fingerprint = task_fingerprint(self.config.task_names).to(self.task_fingerprint.device)
        return new_id

    def _grow_for_task(self, new_id: int, source: int | None) -> None:
        """The family's part of `add_task`: the new task's weights besides its head (copied from task `source`)."""
        raise NotImplementedError(f"{type(self).__name__} cannot add tasks.")

    def _prepare_task_batch(
        self, task_ids, batch: int, seq: int, labels, span_positions, check_values: bool = True, task_counts=None
    ):
        """Validate task ids, labels and spans (their values too with `check_values`); return `(task_ids,
        task_rows, prepared_labels)`. `task_counts`: the rows of each task, counted on the host where the batch was
        made; a batch whose values were checked there is split by them (nothing read back), any other is split by
        the counts read back from the device, which must agree with them."""
        check_batch_dim(batch, labels=labels, span_positions=span_positions)
        task_names = self.config.task_names
        if task_counts is not None:
            task_counts = check_task_counts(task_counts, batch, task_names)
        # the model's device only where task ids are made or converted (`self.device` walks the parameters)
        device = task_ids.device if isinstance(task_ids, torch.Tensor) else self.device
        task_ids = resolve_task_ids(task_ids, batch, task_names, device, check_values)
        task_rows = self.heads.split_rows(task_ids, None if check_values else task_counts)
        if check_values and task_counts is not None:
            counted = [len(task_rows[t]) if t in task_rows else 0 for t in range(len(task_names))]
            if counted != task_counts:
                raise ValueError(
                    f"`task_counts` says the batch holds {dict(zip(task_names, task_counts))} rows per task, but its "
                    f"`task_ids` hold {dict(zip(task_names, counted))}: count them from the same batch "
                    "(BatchChecker.check), or leave `task_counts` out."
                )
        prepared = self.heads.check_inputs(task_rows, seq, labels, span_positions, check_values)
        return task_ids, task_rows, prepared if labels is not None else None


def heads_to_output_fields(heads_out: HeadsOutput) -> dict:
    losses = heads_out.task_losses  # a `PresentTasks` is not asked its length: that would read back the task mix
    return {
        "logits": heads_out.logits,
        "task_logits": heads_out.task_logits,
        "task_losses": None if isinstance(losses, dict) and not losses else losses,
    }
