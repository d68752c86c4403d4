"""Dense checkpoint -> any family, through an explicit and checked weight mapping.

Each family declares `UpcyclingRules` in its registration (`hf_taskmoe.models.registry`): regexes that map
every weight of the new model (relative to its base model, e.g. without the `bert.` prefix) to the dense
checkpoint's weight it starts from, and the patterns of weights that are new by design (gates, heads, adapters).
`upcycle` copies, checks shapes, re-reads every copied tensor to verify it, and returns an `UpcyclingReport` saying
what was copied, what is new and which checkpoint weights went unused. A weight that should have come from the
checkpoint but is absent there is an error (or, with `strict=False`, listed as new).
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass, field

import torch
from transformers import AutoModel, PreTrainedModel

from .contract import is_stacked

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class UpcyclingRules:
    """`rename`: `(target_regex, source_template)` pairs, tried in order on base-model-relative target names
    (`re.fullmatch`; the template may use the regex groups). `new`: regexes (`re.search` on full target
    names) of weights that are freshly initialised by design."""

    rename: tuple[tuple[str, str], ...]
    new: tuple[str, ...]

    def source_of(self, relative_name: str) -> str | None:
        for pattern, template in self.rename:
            match = re.fullmatch(pattern, relative_name)
            if match:
                return match.expand(template)
        return None


@dataclass
class UpcyclingReport:
    """What `upcycle` did. `copied` maps each new-model weight to the checkpoint weight it was copied from."""

    source: str
    copied: dict[str, str] = field(default_factory=dict)
    new: list[str] = field(default_factory=list)
    unused: list[str] = field(default_factory=list)
    copied_parameters: int = 0
    new_parameters: int = 0

    def summary(self) -> str:
        sources = len(set(self.copied.values()))
        lines = [
            f"Upcycled from {self.source}: {len(self.copied)} tensors ({self.copied_parameters:,} values) copied from "
            f"{sources} checkpoint tensors; {len(self.new)} tensors ({self.new_parameters:,} values) newly "
            "initialised.",
        ]
        if self.new:
            lines.append("  new: " + ", ".join(_collapse(self.new)))
        if self.unused:
            lines.append("  checkpoint tensors not used: " + ", ".join(_collapse(self.unused)))
        return "\n".join(lines)

    __str__ = summary


def _collapse(names: list[str]) -> list[str]:
    """Shorten name lists for humans: layer and expert indices become `*`."""
    return list(dict.fromkeys(re.sub(r"\.\d+(?=\.)", ".*", name) for name in names))  # first-seen order


@dataclass
class DenseCheckpoint:
    """A dense model to upcycle, with the names of the weights its checkpoint lacked (transformers drew those
    at random on load: they are never reported as copied)."""

    model: PreTrainedModel
    source: str
    missing_keys: frozenset[str] = frozenset()

    @property
    def config(self):
        return self.model.config


def load_dense_model(dense: str | os.PathLike | PreTrainedModel | DenseCheckpoint, auto_class: type = AutoModel,
                     **hub_kwargs) -> DenseCheckpoint:
    """The dense model to upcycle: a loaded model (for `AutoModel`, its base model: `bert` of a
    `BertForSequenceClassification`; for another Auto class, an LM's, the model itself) or a path / Hub repo id
    loaded with `auto_class.from_pretrained`."""
    if isinstance(dense, DenseCheckpoint):
        return dense
    if isinstance(dense, PreTrainedModel):
        source = getattr(dense.config, "name_or_path", "") or type(dense).__name__
        return DenseCheckpoint(dense.base_model if auto_class is AutoModel else dense, source)
    if not isinstance(dense, (str, os.PathLike)):
        raise ValueError(f"`dense` must be a path, a Hub repo id or a PreTrainedModel, got {type(dense).__name__}.")
    model, info = auto_class.from_pretrained(dense, output_loading_info=True, **hub_kwargs)
    return DenseCheckpoint(model, str(dense), frozenset(info.get("missing_keys", ())))


def upcycle(dense: DenseCheckpoint | PreTrainedModel, target: PreTrainedModel, strict: bool = True) -> UpcyclingReport:
    """Copy the dense model's weights into `target` following `target.upcycling_rules()` (its family's rules)."""
    if not hasattr(target, "upcycling_rules"):
        raise ValueError(
            f"`target` must be an hf_taskmoe task model (a `MultiTaskPreTrainedModel` of a registered family), got "
            f"{type(target).__name__}."
        )
    rules = target.upcycling_rules()  # the family's rules; a backbone-generic model's own
    if rules is None:
        raise ValueError(
            f"The family of {type(target).__name__} is not built from a dense checkpoint (no upcycling rules)."
        )
    dense = load_dense_model(dense)
    source = dense.model.state_dict()
    prefix = target.base_model_prefix + "." if target.base_model_prefix else ""
    report = UpcyclingReport(source=dense.source)
    absent = []
    target_state = target.state_dict()
    with torch.no_grad():
        for name, tensor in target_state.items():
            if name == "task_fingerprint":  # bookkeeping (the task order), not a weight
                continue
            relative = name[len(prefix):] if prefix and name.startswith(prefix) else name
            src = rules.source_of(relative)
            if src is not None and src in source and src not in dense.missing_keys:
                stacked = is_stacked(target, name)  # one slice per expert, each a copy of the dense weight
                if (tensor.shape[1:] if stacked else tensor.shape) != source[src].shape:
                    raise ValueError(
                        f"Cannot upcycle {name}: shape {tuple(tensor.shape)} but checkpoint tensor {src} has "
                        f"shape {tuple(source[src].shape)}" + (" (one slice per expert expected)." if stacked else ".")
                    )
                tensor.copy_(source[src].expand_as(tensor))
                report.copied[name] = src
                report.copied_parameters += tensor.numel()
            elif any(re.search(p, name) for p in rules.new):
                report.new.append(name)
                report.new_parameters += tensor.numel()
            else:
                absent.append((name, src))
    if absent and strict:
        listed = ", ".join(f"{n} (from {s})" if s else n for n, s in absent[:8])
        raise ValueError(
            f"The dense checkpoint {report.source} lacks {len(absent)} weights the new model expects: {listed}. "
            "Pass strict=False to initialise them fresh."
        )
    for name, _ in absent:
        report.new.append(name)
        report.new_parameters += target_state[name].numel()

    used = set(report.copied.values())
    report.unused = sorted(k for k in source if k not in used)
    _verify(target, source, report)
    target.config.upcycled_from = report.source
    logger.info(report.summary())
    return report


def _verify(target: PreTrainedModel, source: dict[str, torch.Tensor], report: UpcyclingReport) -> None:
    """Re-read every copied tensor from the model and compare it with its source."""
    state = target.state_dict()
    for name, src in report.copied.items():
        if not torch.equal(state[name], source[src].to(state[name].dtype).expand_as(state[name])):
            raise RuntimeError(f"Upcycling check failed: {name} differs from {src} after the copy.")
