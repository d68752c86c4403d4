"""The contract every family keeps, tested once for all of them (transformers' `ModelTesterMixin` idea).

A family takes part by giving a `FamilyCase`: how to build a tiny model for some tasks and a batch for some task
ids. `FamilyContract` holds the tests; `test_families.py` runs them for every registered family of the package,
and a family defined elsewhere (a test's toy family) gets them by subclassing with its own case.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch
from transformers import AutoConfig, AutoModel

import hf_taskmoe
from hf_taskmoe import TaskSpec
from hf_taskmoe.layers.heads import PresentTasks
from hf_taskmoe.models import family_of


@dataclass
class FamilyCase:
    """A family's tiny models for the contract tests.

    build(tasks) -> a fresh model with dropout off; batch(model, task_ids) -> inputs and labels for rows of those
    tasks (the same rows for the same ids and seed); new_task: a task `add_task` can take; dense_equivalent(): an
    optional `(fresh model, reference fn)` pair whose outputs must agree at initialisation."""

    name: str
    tasks: list[TaskSpec]
    build: Callable[[list[TaskSpec]], torch.nn.Module]
    batch: Callable[..., dict]
    new_task: TaskSpec
    output_key: str = "logits"
    learns_steps: int = 60
    learns_lr: float = 3e-3
    dense_equivalent: Callable[[], tuple] | None = None
    bf16: bool = True
    extra: dict = field(default_factory=dict)


def fit(model, batch: dict, steps: int, lr: float) -> list[float]:
    """Plain AdamW on the trainable parameters over one fixed batch, in training mode: the loss of every step."""
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    losses = []
    for _ in range(steps):
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _task_rows(out, key: str) -> torch.Tensor:
    return getattr(out, key)


class FamilyContract:
    """Subclass with `case` (a `FamilyCase`) to run the contract for one family."""

    case: FamilyCase

    def model(self, tasks=None):
        torch.manual_seed(0)
        return self.case.build(tasks or self.case.tasks).eval()

    def ids(self, model) -> torch.Tensor:
        return torch.arange(6) % model.config.num_tasks

    # ------------------------------------------------------------------ contract
    def test_registered_and_auto_round_trip(self, tmp_path):
        model = self.model()
        family = family_of(model.config)
        assert type(model) is family.model_class and model.config.model_type.startswith("taskmoe_")
        # what the Auto classes load: the family's model registered for the model_type (a paper class with other
        # defaults only, `BertForTaskMoE`, saves as its family's model)
        saved_as = family_of(model.config.model_type)
        assert isinstance(model, saved_as.model_class)
        batch = self.case.batch(model, self.ids(model))
        with torch.no_grad():
            expected = model(**batch)
        model.save_pretrained(tmp_path)
        assert type(AutoConfig.from_pretrained(tmp_path)) is saved_as.config_class
        for auto in family.auto_classes:
            loaded = getattr(__import__("transformers"), auto).from_pretrained(tmp_path).eval()
            assert type(loaded) is saved_as.model_class and loaded.config.task_names == model.config.task_names
            with torch.no_grad():
                got = loaded(**batch)
            torch.testing.assert_close(
                _task_rows(got, self.case.output_key), _task_rows(expected, self.case.output_key), atol=1e-5, rtol=0
            )
            assert torch.equal(loaded.task_fingerprint, model.task_fingerprint)

    def test_reordered_tasks_in_config_json_are_refused(self, tmp_path):
        import json

        model = self.model()
        model.save_pretrained(tmp_path)
        config = json.loads((tmp_path / "config.json").read_text())
        config["tasks"] = config["tasks"][::-1]
        (tmp_path / "config.json").write_text(json.dumps(config))
        with pytest.raises(ValueError, match="the weights were saved for the tasks in the order"):
            AutoModel.from_pretrained(tmp_path)

    def _needs_task_ids(self):
        if not self.case.extra.get("task_ids", True):
            pytest.skip("the family's rows carry every task's label; there are no task ids")

    def test_bad_task_ids_are_refused_before_compute(self):
        self._needs_task_ids()
        model = self.model()
        batch = self.case.batch(model, self.ids(model))
        batch["task_ids"] = torch.full_like(self.ids(model), model.config.num_tasks)
        with pytest.raises(ValueError, match=r"task"):
            model(**batch)

    def test_misspelt_keyword_is_refused(self):
        model = self.model()
        batch = self.case.batch(model, self.ids(model))
        batch["lables"] = batch.pop("labels")
        with pytest.raises(ValueError, match=r"Unexpected keyword argument\(s\) \['lables'\]"):
            model(**batch)

    def test_mixed_batch_equals_per_task_batches(self):
        self._needs_task_ids()
        model = self.model()
        ids = self.ids(model)
        batch = self.case.batch(model, ids)
        with torch.no_grad():
            mixed = model(**batch)
            for t in range(model.config.num_tasks):
                rows = (ids == t).nonzero().squeeze(-1)
                alone = model(**self.case.batch(model, ids, rows=rows))
                name = model.config.task_names[t]
                torch.testing.assert_close(alone.task_losses[name], mixed.task_losses[name], atol=1e-5, rtol=1e-5)

    def test_gradient_reaches_every_task_specific_parameter(self):
        """After a few steps (function-preserving starts have zero-initialised projections that pass no gradient
        upstream on the first step: PALs' D, CA-MTL's FiLM and bottleneck), every task-specific parameter learns."""
        model = self.model().train()
        batch = self.case.batch(model, self.ids(model))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for _ in range(3):
            model(**batch).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        model(**batch).loss.backward()
        patterns = [re.compile(p) for p in model.parameter_roles.task_specific_patterns]
        specific = [
            (n, p) for n, p in model.named_parameters() if p.requires_grad and any(r.search(n) for r in patterns)
        ]
        assert specific
        without = [n for n, p in specific if p.grad is None or not p.grad.abs().sum() > 0]
        assert not without, f"no gradient: {without[:5]}"

    def test_parameter_roles_name_the_model_s_parameters(self):
        """Each role the family declares (`parameter_roles`, the one place the library reads roles from) names
        parameters this model has, unless the case says its configuration builds none of that role; the
        task-specific parameters are what `freeze_shared_parameters` leaves trainable; and `from_dense`'s new
        weights (the family's upcycling rules) are the `new` roles'."""
        from hf_taskmoe.contract import ParameterRoles
        from hf_taskmoe.training.protocol import freeze_shared_parameters

        model = self.model()
        roles = type(model).parameter_roles
        assert isinstance(roles, ParameterRoles)
        names = [n for n, _ in model.named_parameters()]
        empty = sorted(r for r, p in roles.roles.items() if not any(re.search(p, n) for n in names))
        assert empty == sorted(self.case.extra.get("roles_without_parameters", ())), empty
        assert set(roles.task_specific) <= set(roles.roles) and roles.task_specific
        freeze_shared_parameters(model)
        trainable = {n for n, p in model.named_parameters() if p.requires_grad}
        assert trainable == {n for n in names if roles.has(n, roles.task_specific)}
        family = family_of(model.config)
        if family.upcycling is not None and family.backbone_kind is None:
            assert family.upcycling.new == roles.new_patterns
        elif (rules := model.upcycling_rules()) is not None:  # None: the family is not built from a dense model
            assert rules.new == roles.new_patterns

    def test_what_a_one_task_batch_leaves_without_gradient_is_declared_possibly_idle(self):
        """The trainer touches only the `possibly_idle` roles under DDP's static graph: every parameter a batch of
        one task leaves without a gradient (the other tasks' heads, PALs, routes) must be among them."""
        model = self.model().train()
        model(**self.case.batch(model, torch.zeros(4, dtype=torch.long))).loss.backward()
        roles = type(model).parameter_roles
        idle = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
        assert [n for n in idle if not roles.has(n, roles.possibly_idle)] == []

    def test_add_task_then_train(self):
        model = self.model()
        new_id = model.add_task(self.case.new_task, init_from=model.config.task_names[0])
        assert model.config.task_names[new_id] == self.case.new_task.name
        model.train()
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        ids = torch.full((4,), new_id)
        first = model(**self.case.batch(model, ids)).loss
        first.backward()
        optimizer.step()
        optimizer.zero_grad()
        assert torch.isfinite(first) and self.case.new_task.name in model(**self.case.batch(model, ids)).task_losses

    def test_learns_a_few_examples(self):
        """Plain AdamW on a fixed mixed batch: the loss falls to a small fraction of where it started."""
        model = self.model()
        losses = fit(model, self.case.batch(model, self.ids(model)), self.case.learns_steps, self.case.learns_lr)
        assert losses[-1] < 0.25 * losses[0], losses[:: max(1, len(losses) // 6)]

    def test_bf16_autocast_training_step(self):
        if not self.case.bf16:
            pytest.skip("the family does not run under bf16 autocast")
        model = self.model().train()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(**self.case.batch(model, self.ids(model)))
        assert torch.isfinite(out.loss)
        out.loss.backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        assert grads and all(torch.isfinite(g).all() for g in grads)

    def test_dense_equivalence_at_initialisation(self):
        if self.case.dense_equivalent is None:
            pytest.skip("the family does not start from a dense model")
        fresh, reference = self.case.dense_equivalent()
        got, expected = reference(fresh)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)

    def test_init_weights_on_the_meta_device_sets_every_buffer(self):
        """As transformers' `test_init_weights_can_init_buffers`: a model built on the meta device, moved to the CPU
        and initialised by `init_weights()` has the buffers of one built directly (the task fingerprint included)."""
        import copy

        model = self.model()
        with torch.device("meta"):
            meta = type(model)(copy.deepcopy(model.config))
        meta.to_empty(device="cpu")
        meta.init_weights()
        built, initialised = dict(model.named_buffers()), dict(meta.named_buffers())
        assert sorted(built) == sorted(initialised)
        differ = [name for name, value in built.items() if not torch.equal(value, initialised[name])]
        assert not differ, f"buffers `init_weights()` does not set: {differ}"

    def test_return_dict_false_gives_the_output_as_a_tuple(self):
        model = self.model()
        batch = self.case.batch(model, self.ids(model))
        with torch.no_grad():
            expected = model(**batch).to_tuple()
            got = model(**batch, return_dict=False)
            model.config.return_dict = False
            from_config = model(**batch)
        def plain(output):  # a dict-like of the tasks present (`PresentTasks`) compared as the dict it reads as
            return tuple(dict(v.items()) if isinstance(v, PresentTasks) else v for v in output)

        for value in (got, from_config):
            assert type(value) is tuple and len(value) == len(expected)
            torch.testing.assert_close(plain(value), plain(expected), atol=0, rtol=0)
        encoder = self.case.extra.get("encoder")
        if encoder is not None:  # the bare encoder keeps the same contract
            inputs = {k: v for k, v in batch.items() if k != "labels"}
            with torch.no_grad():
                expected = getattr(model, encoder)(**inputs, return_dict=True).to_tuple()
                torch.testing.assert_close(
                    getattr(model, encoder)(**inputs, return_dict=False), expected, atol=0, rtol=0
                )

    def test_hidden_states_and_attentions_as_arguments_and_from_the_config(self):
        layers = self.case.extra.get("layers")  # output field -> the config field counting its layers
        if layers is None:
            pytest.skip("the family has no layers to report")
        model = self.model()
        model.set_attn_implementation("eager")  # attention probabilities exist only on the eager path
        batch = self.case.batch(model, self.ids(model))
        rows = len(self.ids(model))
        with torch.no_grad():
            plain = model(**batch)
            asked = model(**batch, output_hidden_states=True, output_attentions=True)
            model.config.output_hidden_states = model.config.output_attentions = True
            configured = model(**batch)
        for field_name, count in layers.items():
            assert getattr(plain, field_name) is None, field_name
            for out in (asked, configured):
                values = getattr(out, field_name)
                expected = getattr(model.config, count) + int(field_name.endswith("hidden_states"))
                assert isinstance(values, tuple) and len(values) == expected, (field_name, values and len(values))
                assert all(v.shape[0] == rows and v.shape == values[-1].shape for v in values), field_name
                if field_name.endswith("attentions"):  # probabilities: every row sums to 1
                    torch.testing.assert_close(values[-1].sum(-1), torch.ones_like(values[-1].sum(-1)))
            torch.testing.assert_close(asked.logits if asked.logits is not None else asked.task_logits, plain.logits
                                       if plain.logits is not None else plain.task_logits)

    def test_package_is_imported(self):
        assert hf_taskmoe.FAMILIES[family_of(self.model().config).name]

    # ------------------------------------------------------------------ exact loads (issue 35, item 3)
    def _saved(self, tmp_path):
        model = self.model()
        model.save_pretrained(tmp_path)
        return model

    @staticmethod
    def _task_tensor(names) -> str:
        """A task-specific tensor of a saved model: a head's, else an expert's, gate's, tower's or task embedding's."""
        for part in ("heads.", "towers.", "expert", "gate", "router", "task_embed", "pals"):
            found = sorted(n for n in names if part in n)
            if found:
                return found[0]
        raise AssertionError(f"no task-specific tensor among {sorted(names)[:10]}")

    def test_a_weights_file_missing_extra_or_misshaped_task_tensors_is_refused_naming_them(self, tmp_path):
        from safetensors.torch import load_file, save_file

        self._saved(tmp_path)
        path = tmp_path / "model.safetensors"
        whole = load_file(path)
        name = self._task_tensor(whole)
        tail = name.rsplit(".", 1)[0]
        cases = {
            "are not on file": {k: v for k, v in whole.items() if k != name},
            "differ in shape": {
                **whole,
                name: whole[name][..., :-1].contiguous() if whole[name].shape[-1] > 1 else whole[name].repeat(2),
            },
        }
        extra = f"{tail}.extra_weight"
        cases["have no place in the model"] = {**whole, extra: whole[name].clone()}
        for reason, tensors in cases.items():
            save_file(tensors, path, metadata={"format": "pt"})
            with pytest.raises(
                ValueError,
                match=rf"(?s)Cannot load .*{reason}[^(]*\(.*"
                      rf"{re.escape(extra if 'no place' in reason else name)}.*ignore_mismatched_sizes=True",
            ):
                AutoModel.from_pretrained(tmp_path)
        # opted in, as in transformers: the misshaped tensor is initialised afresh and the rest loads
        save_file(cases["differ in shape"], path, metadata={"format": "pt"})
        loaded = AutoModel.from_pretrained(tmp_path, ignore_mismatched_sizes=True)
        assert tuple(loaded.state_dict()[name].shape) == tuple(whole[name].shape)

    def test_a_hand_edited_config_json_that_does_not_describe_the_weights_is_refused(self, tmp_path):
        import json

        model = self._saved(tmp_path)
        saved = json.loads((tmp_path / "config.json").read_text())
        edits = {key: saved[key] + 1 for key in ("num_experts", "num_hidden_layers", "encoder_layers", "decoder_layers")
                 if isinstance(saved.get(key), int)}
        allowed = family_of(model.config).supported_problem_types
        first = saved["tasks"][0]
        if first.get("problem_type") == "single_label_classification" and (not allowed or "regression" in allowed):
            edits["tasks"] = [{**first, "problem_type": "regression", "num_labels": 1,
                               **{k: None for k in ("label_names", "label_values") if k in first}}, *saved["tasks"][1:]]
        assert edits, "no field of the family's config.json to edit"
        for key, value in edits.items():
            (tmp_path / "config.json").write_text(json.dumps({**saved, key: value}))
            with pytest.raises(ValueError, match=r"Cannot load .*config.json does not describe the weights on file"):
                AutoModel.from_pretrained(tmp_path)
        (tmp_path / "config.json").write_text(json.dumps(saved))
        assert type(AutoModel.from_pretrained(tmp_path)) is family_of(model.config.model_type).model_class  # it loads
