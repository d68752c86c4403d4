"""`torch.compile(model, fullgraph=True)` of every family (issue 46 item 4), beyond the three BERT families of
`tests/test_compile.py`: the backbone-generic MT-TaG / PALs / CA-MTL on RoBERTa, DistilBERT and ModernBERT, MMoE,
task-routed BART, task routing on causal LMs (Llama, GPT-2) and on T5.

- Training: a step with labels on batches checked on the host as the Trainer's collator checks them
  (`BatchChecker.for_model(model).check(batch)`: `values_checked=True` and `task_counts`; `values_checked=True` for
  the families whose checker sizes nothing), no graph break (`fullgraph=True` raises on one), ONE graph over three task
  mixes (the first mix compiles, `error_on_recompile` makes a second graph an error), and the eager model's losses and
  parameters step for step (plain SGD: see `test_compile._sgd_steps`).
- Inference: the eval forward without labels, the same way. A forward with no graph break and no device read is what
  `mode="reduce-overhead"` (CUDA graphs) needs; CUDA graphs themselves exist only on a GPU, where
  `benchmarks/gpu.py` (section `infer`) measures them.
- Where a graph breaks by design (the sorted expert loop of MT-TaG, `layers/moe.py: _expert_loop`, the only dispatch
  of the architectures whose FFN is one module), the test says so.

`backend="aot_eager"` traces forward and backward as inductor would, without generating C++."""

from __future__ import annotations

import copy

import pytest
import torch

from hf_taskmoe import (
    CAMTLBackboneConfig,
    CAMTLConfig,
    CAMTLForMultiTask,
    CAMTLModel,
    MMoEModel,
    PALsConfig,
    PALsForMultiTask,
    TaskMoEConfig,
    TaskMoEForMultiTask,
    TaskSpec,
)
from hf_taskmoe.compat import T5_BLOCK_RETURNS_BIASES
from hf_taskmoe.training.batches import BatchChecker

from . import test_bart_routed, test_mmoe, test_task_routed_lm, test_task_routed_t5
from .backbone_matrix import TASKS, dense_config, labelled_batch

MIXES = [[0, 1, 0, 1, 1, 0], [1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 1, 0]]  # two tasks, one task, mostly the other
ROUTED_MIXES = [[0, 1, 2, 1], [1, 1, 1, 1], [2, 0, 0, 2]]  # three tasks, one, two


def _encoder_batches(model):
    return [labelled_batch(model, torch.tensor(ids), seed=i) for i, ids in enumerate(MIXES)]


def _routed(make, ids_list=ROUTED_MIXES):
    return lambda model: [make(model, torch.tensor(ids), seed=i) for i, ids in enumerate(ids_list)]


def _bart_batches(model):
    return [{**test_bart_routed.batch(seed=i), "task_ids": torch.tensor(ids)}
            for i, ids in enumerate([[0, 1, 2, 0, 1, 2], [1, 1, 1, 1, 1, 1], [2, 0, 0, 2, 2, 0]])]


def _mmoe_batches(model):  # no task ids: every row has every task's label; three batches of other values
    return [test_mmoe.batch(seed=i) for i in range(3)]


def _t5():
    if not T5_BLOCK_RETURNS_BIASES:
        pytest.skip("this transformers' T5 block is refused by TaskRoutedForSeq2SeqLM (compat.T5_BLOCK_RETURNS_BIASES)")
    return test_task_routed_t5.routed("t5", selection="gumbel_softmax_st")


#: name -> (build, batches(model), autocast dtype)
CASES = {
    # MT-TaG's default under torch.compile: its grouped GEMMs (F.grouped_mm in bf16, transformers' traceable grouped
    # product in fp32: `test_compile.py`)
    "mt_tag-roberta": (lambda: TaskMoEForMultiTask(TaskMoEConfig(
        dense_config=dense_config("roberta"), tasks=TASKS, num_experts=4)), _encoder_batches, torch.bfloat16),
    **{f"pals-{arch}": (lambda arch=arch: PALsForMultiTask(PALsConfig(
        dense_config=dense_config(arch), tasks=TASKS, pal_size=8, pal_num_heads=2)), _encoder_batches, None)
       for arch in ("roberta", "distilbert", "modernbert")},
    **{f"camtl-{arch}": (lambda arch=arch: CAMTLForMultiTask(CAMTLBackboneConfig(
        dense_config=dense_config(arch), tasks=TASKS, conditional_attention_max_length=16)), _encoder_batches, None)
       for arch in ("roberta", "distilbert", "modernbert")},
    "mmoe": (lambda: MMoEModel(test_mmoe.config()), _mmoe_batches, None),
    # the selections a routed model trains with: straight-through (the default) and the hard route, whose eager
    # forward runs one expert per row (`plan_routes`) where the compiled one runs every expert masked by the route
    **{f"bart_routed-{sel}": (lambda sel=sel: test_bart_routed.routed(sel), _bart_batches, None)
       for sel in ("gumbel_softmax_st", "hard")},
    **{f"task_routed_lm-{arch}": (lambda arch=arch: test_task_routed_lm.routed(arch, selection="gumbel_softmax_st"),
                                  _routed(test_task_routed_lm.lm_batch), None)
       for arch in ("llama", "gpt2")},
    "task_routed_t5": (_t5, _routed(test_task_routed_t5.s2s_batch), None),
    # low-rank experts (`expert_rank`): MT-TaG's per-token decisions and task routing's per-row ones both reach the
    # wrapped linears through the task context (`layers/low_rank.py`); hard routes take the one-expert path
    "mt_tag_low_rank-bert": (lambda: TaskMoEForMultiTask(TaskMoEConfig(
        dense_config=dense_config("bert"), tasks=TASKS, num_experts=4, expert_rank=4)), _encoder_batches, None),
    "task_routed_lm_low_rank-llama": (lambda: test_task_routed_lm.routed("llama", selection="hard", expert_rank=4),
                                      _routed(test_task_routed_lm.lm_batch), None),
}


def checked(model, batch: dict) -> dict:
    """`batch` as the Trainer hands it over: checked on the host; `values_checked=True` (and no `task_counts`) where
    the family's checker sizes nothing (`check` returns None: the text-to-text and tabular families)."""
    marks = BatchChecker.for_model(model).check(batch)
    return {**batch, **(marks if marks is not None else {"values_checked": True})}


def inference_inputs(model, batch: dict) -> dict:
    """`batch` without its labels; T5's decoder reads the targets shifted right instead (a teacher-forced
    evaluation), BART's its inputs shifted right (its own default)."""
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    if "labels" in batch and hasattr(model, "_shift_right"):  # T5; BART's decoder reads its inputs shifted
        inputs["decoder_input_ids"] = model._shift_right(batch["labels"])
    return inputs


def _run(model, batches, autocast_dtype, train: bool, error_on_recompile_after_first: bool = False):
    """Training steps (plain SGD; the losses) or eval forwards (the logits), under `autocast_dtype` when given."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05) if train else None
    outputs = []
    for i, batch in enumerate(batches):
        torch.manual_seed(i)  # the same Gumbel noise (drawn per task and step) in both runs
        with (torch._dynamo.config.patch(error_on_recompile=error_on_recompile_after_first and i > 0),
              torch.autocast("cpu", dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None)):
            if train:
                loss = model(**batch).loss
            else:
                with torch.no_grad():
                    out = model(**inference_inputs(model, batch))
        if train:
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            outputs.append(loss.detach().float())
        else:
            # the encoder families compare per task (`task_logits`): a compiled forward runs every head on every row
            # and gives no batch-wide `logits` even for a one-task batch, where eager gives both
            task_logits = getattr(out, "task_logits", None)
            outputs.append({task: logits.float() for task, logits in task_logits.items()} if task_logits else
                           out.logits.float())
    return outputs


def compile_and_compare(name: str, train: bool):
    """Compile case `name` with `fullgraph=True`; one graph over the mixes; eager's numbers."""
    from torch._dynamo.utils import counters

    build, make_batches, autocast_dtype = CASES[name]
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    eager = build().train(train)
    compiled_model = copy.deepcopy(eager)
    batches = [checked(eager, b) for b in make_batches(eager)]
    if "task_ids" in batches[0]:
        assert len({tuple(b["task_ids"].tolist()) for b in batches}) == 3
    if "task_counts" in batches[0]:
        assert len({b["task_counts"] for b in batches}) == 3
    expected = _run(eager, batches, autocast_dtype, train)
    compiled = torch.compile(compiled_model, backend="aot_eager", fullgraph=True)
    got = _run(compiled, batches, autocast_dtype, train, error_on_recompile_after_first=True)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert not counters["graph_break"], dict(counters["graph_break"])
    tolerance = dict(rtol=2e-2, atol=2e-2) if autocast_dtype is not None else dict(rtol=1e-4, atol=1e-5)
    for step, (g, e) in enumerate(zip(got, expected)):
        torch.testing.assert_close(g, e, **tolerance, msg=lambda m, step=step: f"step {step}: {m}")
    if train:
        for (param_name, p), q in zip(eager.named_parameters(), compiled_model.parameters()):
            torch.testing.assert_close(q, p, atol=5e-3 if autocast_dtype is not None else 1e-5, rtol=1e-3,
                                       msg=lambda m, n=param_name: f"{n}: {m}")


@pytest.mark.ci
@pytest.mark.parametrize("name", sorted(CASES))
def test_fullgraph_training_step_one_graph_over_task_mixes(name):
    compile_and_compare(name, train=True)


@pytest.mark.ci
@pytest.mark.parametrize("name", sorted(CASES))
def test_fullgraph_eval_forward_one_graph_over_task_mixes(name):
    """What `torch.compile(model, mode="reduce-overhead")` needs of inference: no graph break, no recompilation."""
    compile_and_compare(name, train=False)


# -- the sorted expert loop: a graph break by design -----------------------------------------------------------------
SORTED_LOOP = {
    # DistilBERT and ModernBERT keep whole FFN modules: the loop over the sorted tokens is their dispatch (the stacked
    # experts of the other encoders run grouped GEMMs under torch.compile: `tests/test_compile.py`)
    **{arch: lambda arch=arch: TaskMoEForMultiTask(TaskMoEConfig(
        dense_config=dense_config(arch), tasks=TASKS, num_experts=4)) for arch in ("distilbert", "modernbert")},
}


@pytest.mark.parametrize("arch", sorted(SORTED_LOOP))
def test_the_sorted_expert_loop_is_a_graph_break(arch):
    """The loop over experts that are whole modules is `torch.compiler.disable`d (`layers/moe.py: _expert_loop`):
    traced, its per-expert slice sizes were specialised and every new task mix recompiled. `fullgraph=True` refuses
    it by name; without it, the layers around the loop compile (`tests/test_compile.py`)."""
    torch._dynamo.reset()
    model = SORTED_LOOP[arch]().train()
    batch = checked(model, labelled_batch(model, torch.tensor(MIXES[0])) if arch != "bert" else
                    {"input_ids": torch.randint(3, 60, (6, 8)), "attention_mask": torch.ones(6, 8, dtype=torch.long),
                     "task_ids": torch.tensor(MIXES[0]), "labels": torch.tensor([1.0, 0.5, 2.0, -1.0, 0.0, 1.0])})
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    with pytest.raises(torch._dynamo.exc.Unsupported, match="disable"):
        compiled(**batch)


# -- MultiTaskTrainer(torch_compile=True) ----------------------------------------------------------------------------
@pytest.mark.parametrize("family, class_labels", [("pals", "float"), ("camtl", "float"), ("camtl", "int")])
def test_trainer_with_torch_compile_runs_one_graph_over_mixed_batches(family, class_labels, tmp_path):
    """`torch_compile=True` (accelerate compiles the model; `aot_eager` here, inductor by default): the collator's
    checked and counted batches, whose task mixes differ from step to step, run one graph with no break, whether the
    class labels are stored as floats (`0.0`, `1.0`) or ints: the mixture holds a regression task, so the Trainer's
    collator gives every batch float labels, also a batch without a regression row (one dtype, one graph)."""
    from datasets import Dataset
    from torch._dynamo.utils import counters

    from hf_taskmoe.training import MultiTaskTrainer, MultiTaskTrainingArguments

    from .test_host_syncs import FAMILIES

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = FAMILIES[family][0]()
    rows = {"input_ids": [[5, 6, 7, 8]] * 6, "attention_mask": [[1, 1, 1, 1]] * 6}  # one shape: no shape recompiles
    cast = float if class_labels == "float" else int
    train = {
        "a": Dataset.from_dict({**rows, "labels": [cast(v) for v in [0, 1, 0, 1, 0, 1]]}),
        "b": Dataset.from_dict({**rows, "labels": [cast(v) for v in [0, 1, 2, 1, 0, 2]]}),
        "c": Dataset.from_dict({**rows, "labels": [0.5, 1.0, 1.5, 2.0, 0.0, 1.0]}),
    }
    args = MultiTaskTrainingArguments(
        output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=4, use_cpu=True, report_to="none",
        save_strategy="no", batching="heterogeneous", torch_compile=True, torch_compile_backend="aot_eager",
        logging_steps=1,
    )
    seen = []
    model.register_forward_pre_hook(lambda module, args, kwargs: seen.append(kwargs["task_counts"]), with_kwargs=True)
    trainer = MultiTaskTrainer(model=model, args=args, train_dataset=train)
    with torch._dynamo.config.patch(recompile_limit=1, fail_on_recompile_limit_hit=True):
        trainer.train()
    assert len(seen) == 4 and len(set(seen)) > 1, seen  # the task mixes changed
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert not counters["graph_break"], dict(counters["graph_break"])
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert len(losses) == 4 and all(loss == loss for loss in losses)  # finite


# -- a mixture with a multi-label task: one labels shape, one graph (issue 59 item 3) ---------------------------------
MULTI_LABEL_MIXTURE = [
    TaskSpec(name="a", num_labels=2),
    TaskSpec(name="m", problem_type="multi_label_classification", num_labels=3),
    TaskSpec(name="c", problem_type="regression"),
]
#: the rows' tasks of four batches: with a multi-label row, without one, only multi-label, only single-label
MULTI_LABEL_MIXES = [[0, 1, 2, 0], [0, 2, 2, 0], [1, 1, 1, 1], [0, 0, 0, 0]]


def _features(ids: list[int], seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    labels = {0: lambda: int(torch.randint(0, 2, (), generator=g)),
              1: lambda: torch.randint(0, 2, (3,), generator=g).tolist(),
              2: lambda: float(torch.randn((), generator=g))}
    return [{"input_ids": torch.randint(3, 60, (6,), generator=g).tolist(), "attention_mask": [1] * 6,
             "task_ids": t, "labels": labels[t]()} for t in ids]


def test_a_mixture_with_a_multi_label_task_trains_in_one_graph(tmp_path):
    """The Trainer's collator pads every batch's labels to the mixture's widest task (the multi-label task's 3 values),
    also a batch without a multi-label row: one labels shape, so a compiled training step (`fullgraph=True`, recompile
    limit 1, hitting it an error) runs one graph over batches with and without a multi-label row; before, a batch of
    class indices and real values had 1-D labels and the step recompiled. Each head reads its own columns: the eager
    losses on the padded labels are those on labels as wide as each batch's widest row (the collator without
    `label_width`), and the compiled steps give them too."""
    from torch._dynamo.utils import counters

    from hf_taskmoe.training import MultiTaskCollator, MultiTaskTrainer, MultiTaskTrainingArguments

    from .test_compile import SIZES

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    # CA-MTL (one family: the labels are read by the heads every encoder family shares, `MultiTaskHeads`)
    eager = CAMTLModel(CAMTLConfig(tasks=MULTI_LABEL_MIXTURE, conditional_attention_max_length=8, **SIZES)).train()
    args = MultiTaskTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", save_strategy="no")
    collate = MultiTaskTrainer(model=eager, args=args).data_collator  # what training batches are made with
    features = [_features(ids, seed) for seed, ids in enumerate(MULTI_LABEL_MIXES)]
    padded = [collate(f) for f in features]
    assert {b["labels"].shape for b in padded} == {(4, 3)}, [b["labels"].shape for b in padded]
    assert all(b["values_checked"] for b in padded) and len({b["task_counts"] for b in padded}) == 4
    checker = BatchChecker.for_model(eager)
    unpadded = [{**b, **checker.check(b)} for b in (MultiTaskCollator(float_labels=True)(f) for f in features)]
    assert [tuple(b["labels"].shape) for b in unpadded] == [(4, 3), (4,), (4, 3), (4,)]  # the old shapes
    with torch.no_grad():
        for p, u in zip(padded, unpadded):
            torch.testing.assert_close(eager(**p).loss, eager(**u).loss, rtol=0, atol=0)
    compiled_model = copy.deepcopy(eager)
    expected = _run(eager, unpadded, None, train=True)
    compiled = torch.compile(compiled_model, backend="aot_eager", fullgraph=True)
    with torch._dynamo.config.patch(recompile_limit=1, fail_on_recompile_limit_hit=True):
        got = _run(compiled, padded, None, train=True)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    assert not counters["graph_break"], dict(counters["graph_break"])
    torch.testing.assert_close(torch.stack(got), torch.stack(expected), rtol=1e-4, atol=1e-5)
