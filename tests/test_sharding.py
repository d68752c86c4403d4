"""What FSDP2 shards as one unit and what ZeRO-3 runs for every task or refuses, derived from the families'
declarations (no process group: the 2-process runs are in tests/test_distributed.py)."""

import re

import pytest
import torch
import transformers

from hf_taskmoe import (
    BartTaskRouted,
    BertForTaskMoE,
    BertTaskMoEConfig,
    CAMTLBackboneConfig,
    CAMTLForMultiTask,
    PALsConfig,
    PALsForMultiTask,
    TaskMoEConfig,
    TaskMoEForMultiTask,
    TaskRoutedForCausalLM,
    TaskSpec,
)
from hf_taskmoe.layers.heads import MultiTaskHeads
from hf_taskmoe.training import MultiTaskTrainingArguments
from hf_taskmoe.training.checkpoints import missing_checkpoint_files
from hf_taskmoe.training.sharding import (
    check_zero3,
    fsdp_config,
    run_every_task,
    transformer_block_classes,
    transformer_blocks,
    zero3_idle_modules,
)

from .conftest import ALL_KINDS, random_batch, tiny_config

TASKS = [TaskSpec(name="a", num_labels=2), TaskSpec(name="b", num_labels=3),
         TaskSpec(name="c", problem_type="regression")]
SIZES = dict(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=24)
TEXT = [TaskSpec(name=n, problem_type="seq2seq") for n in "xy"]


def _unpack(built):
    return built[0] if isinstance(built, tuple) else built


def generic_moe():
    return _unpack(TaskMoEForMultiTask.from_dense(transformers.BertModel(transformers.BertConfig(**SIZES)), tasks=TASKS,
                                                  num_experts=2))


def routed_llama():
    dense = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=64, max_position_embeddings=64))
    return _unpack(TaskRoutedForCausalLM.from_dense(dense, TEXT, num_experts=3, routed_layers=[0, 2]))


def test_units_are_the_declared_backbone_blocks():
    model = generic_moe()
    assert transformer_block_classes(model) == ["BertLayer"]
    assert transformer_blocks(model) == list(model.get_submodule(_layers_path(model)))
    config = fsdp_config(model, cpu_offload=True)
    assert config["version"] == 2 and config["transformer_layer_cls_to_wrap"] == ["BertLayer"]
    assert config["state_dict_type"] == "SHARDED_STATE_DICT" and config["cpu_offload"] is True


def _layers_path(model):
    path = model.config.backbone.layers
    return next(n for n, m in model.named_modules() if n.endswith("." + path) and isinstance(m, torch.nn.ModuleList))


def test_a_routed_layer_is_one_unit_with_its_experts():
    """Every layer of the routed Llama is a unit, a routed one holding its 3 expert blocks (a unit per expert would be
    gathered only where an expert runs); no expert block is a unit of its own."""
    model = routed_llama()
    blocks = transformer_blocks(model)
    assert transformer_block_classes(model) == ["ContextRoutedLayer"]
    assert [len(b.experts) for b in blocks] == [3, 1, 3]
    assert not any(type(m).__name__ == "LlamaDecoderLayer" for m in blocks)


def test_the_earlier_names_take_their_units_from_the_backbone_declaration():
    """BertForTaskMoE and BartTaskRouted are the generic classes with a BERT / BART default now (issue 45): their
    units come from the BERT and BART backbone declarations, as every family's do -- BERT's layers, and each routed
    BART layer whole (its experts, BART's own layer class, are inside it, not units of their own)."""
    bert = BertForTaskMoE(BertTaskMoEConfig(tasks=TASKS, num_experts=4, **SIZES))
    assert transformer_block_classes(bert) == ["BertLayer"]
    bart = BartTaskRouted.from_dense(transformers.BartForConditionalGeneration(transformers.BartConfig(
        vocab_size=50, d_model=16, encoder_layers=2, decoder_layers=2, encoder_ffn_dim=24, decoder_ffn_dim=24,
        encoder_attention_heads=2, decoder_attention_heads=2, max_position_embeddings=32)), TEXT, selection="hard")
    assert transformer_block_classes(_unpack(bart)) == ["ContextRoutedLayer"]


def test_zero3_runs_every_head_and_takes_the_routed_lm():
    """The heads may sit out a step: refused as they are, taken once they run for every task (`run_every_task`, what
    the trainer does under ZeRO-3); the routed LM has nothing to change."""
    model = generic_moe()
    assert [type(m).__name__ for m in zero3_idle_modules(model)] == ["MultiTaskHeads"]
    with pytest.raises(ValueError, match=r"ZeRO-3 cannot train TaskMoEForMultiTask: heads \(MultiTaskHeads\)"):
        check_zero3(model)
    assert run_every_task(model) == [model.heads] and model.heads.runs_every_task
    check_zero3(model)
    llama = routed_llama()
    assert run_every_task(llama) == []
    check_zero3(llama)  # every expert runs in a training forward: nothing sits out


THREE = [TaskSpec(name="a", num_labels=2), TaskSpec(name="b", num_labels=2),
         TaskSpec(name="c", problem_type="regression")]
BERT = transformers.BertConfig(**SIZES)
FAMILIES = {
    # (model, batch of tasks a and b only: c's head, and its PALs, sit out; the heads of a and b stack by default)
    "mt_tag": lambda: TaskMoEForMultiTask(TaskMoEConfig(dense_config=BERT, tasks=THREE, num_experts=2)),
    "pals": lambda: PALsForMultiTask(PALsConfig(dense_config=BERT, tasks=THREE, pal_size=8, pal_num_heads=2)),
    "camtl": lambda: CAMTLForMultiTask(CAMTLBackboneConfig(dense_config=BERT, tasks=THREE,
                                                           conditional_attention_max_length=16)),
}


def _step(model, batch):
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    out.loss.backward()
    return out, {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def _every_task_runs_with_the_same_numbers(model, batch, absent: str):
    """The forward and backward of `batch` before and after `run_every_task`: the same loss, per-task losses, logits
    and gradients, except that the parameters of the absent tasks (`absent`, a pattern), which got no gradient, get
    zeros; ZeRO-3 then takes the model."""
    model.eval()  # no dropout: the two passes draw no random numbers (the split differs: stacked heads, or not)
    before, grads = _step(model, batch)
    modules = run_every_task(model)
    assert modules and all(m.runs_every_task for m in modules)
    check_zero3(model)
    after, every = _step(model, batch)
    torch.testing.assert_close(after.loss, before.loss)
    assert set(after.task_losses) == set(before.task_losses)
    for name in before.task_losses:
        torch.testing.assert_close(after.task_losses[name], before.task_losses[name])
        torch.testing.assert_close(after.task_logits[name], before.task_logits[name])
    idle = [name for name, grad in grads.items() if grad is None]
    assert idle and all(re.search(absent, name) for name in idle), idle
    for name, grad in grads.items():
        if grad is None:  # sat out: now on the graph, with a zero gradient
            assert every[name] is not None and not every[name].any(), name
        else:
            torch.testing.assert_close(every[name], grad, msg=name)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_under_zero3_every_encoder_family_runs_every_task_with_the_same_numbers(family):
    torch.manual_seed(0)
    model = FAMILIES[family]()
    ids = torch.tensor([0, 1, 1, 0, 0, 1])
    batch = {"input_ids": torch.randint(3, 50, (6, 7)), "attention_mask": torch.ones(6, 7, dtype=torch.long),
             "task_ids": ids, "labels": torch.tensor([1, 0, 1, 1, 0, 0])}
    batch["attention_mask"][0, -2:] = 0
    absent = r"^heads\.c\.|^pals\.(encoders|decoders)\.2\.|^pals\.attention\.\d+\.2\."
    _every_task_runs_with_the_same_numbers(model, batch, absent)


def test_under_zero3_every_head_type_runs_on_no_row_when_absent():
    """Every problem type's head, the absent ones (multiple choice, span classification without `span_positions` in
    the batch, token classification) on no row."""
    torch.manual_seed(0)
    model = BertForTaskMoE(tiny_config(tasks=ALL_KINDS))
    ids = torch.tensor([0, 1, 2, 3, 0, 1])  # sst2, mnli, stsb, tags
    batch = random_batch(model.config, batch=6, seq=9, task_ids=ids)
    labels = torch.full((6, 4), -100.0)
    labels[:, 0] = torch.tensor([1, 2, 0.5, 1, 0, 1])
    labels[3] = torch.tensor([1.0, 0, 1, 0])
    _every_task_runs_with_the_same_numbers(model, {**batch, "labels": labels}, r"^heads\.(copa|wic|ner)\.")


def test_fsdp1_on_the_cpu_is_refused_fsdp2_accepted(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("on a GPU both run")
    with pytest.raises(ValueError, match="FSDP version 1 needs CUDA"):
        MultiTaskTrainingArguments(output_dir=str(tmp_path), fsdp=True, fsdp_config={"version": 1}, use_cpu=True)
    args = MultiTaskTrainingArguments(output_dir=str(tmp_path), fsdp=True, fsdp_config={"version": 2}, use_cpu=True)
    assert args.fsdp_plugin_args["fsdp_version"] == 2


def test_sharded_checkpoints_are_complete_only_when_written_whole(tmp_path):
    base = {"trainer_state.json": "{}", "scheduler.pt": "", "rng_state_0.pth": "", "rng_state_1.pth": ""}
    for name, text in base.items():
        (tmp_path / name).write_text(text)
    for folder in ("pytorch_model_fsdp_0", "optimizer_0"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "__0_0.distcp").write_text("")
    # killed while torch's distributed checkpoint was written: no `.metadata` yet
    assert missing_checkpoint_files(str(tmp_path)) == ["model weights", "optimizer.pt"]
    for folder in ("pytorch_model_fsdp_0", "optimizer_0"):
        (tmp_path / folder / ".metadata").write_text("")
    assert missing_checkpoint_files(str(tmp_path)) == []


def test_a_deepspeed_checkpoint_is_complete_with_its_latest_file(tmp_path):
    (tmp_path / "trainer_state.json").write_text("{}")
    (tmp_path / "rng_state_0.pth").write_text("")
    (tmp_path / "global_step3").mkdir()
    (tmp_path / "global_step3" / "zero_pp_rank_0_mp_rank_00_model_states.pt").write_text("")
    assert missing_checkpoint_files(str(tmp_path)) == ["model weights", "optimizer.pt", "scheduler.pt"]
    (tmp_path / "latest").write_text("global_step3")  # DeepSpeed writes it once every rank saved
    assert missing_checkpoint_files(str(tmp_path)) == []


def test_the_trainer_fills_the_units_and_prepares_zero3_before_wrapping(tmp_path, monkeypatch):
    """`prepare_sharding` (called by MultiTaskTrainer before accelerate wraps the model): FSDP2 without a class list
    gets the family's blocks; under ZeRO-3 the heads run for every task, and a module that may sit out and cannot
    is refused."""
    from types import SimpleNamespace

    from hf_taskmoe.training.sharding import prepare_sharding

    model = routed_llama()
    args = MultiTaskTrainingArguments(output_dir=str(tmp_path), fsdp=True, use_cpu=True)
    assert not args.fsdp_plugin_args.get("transformer_cls_names_to_wrap")
    prepare_sharding(model, args)
    assert args.fsdp_plugin_args["transformer_cls_names_to_wrap"] == "ContextRoutedLayer"
    chosen = MultiTaskTrainingArguments(output_dir=str(tmp_path), fsdp=True, use_cpu=True,
                                        fsdp_config={"transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]})
    prepare_sharding(model, chosen)  # the user's choice stands
    assert chosen.fsdp_plugin_args["transformer_cls_names_to_wrap"] == "LlamaDecoderLayer"
    zero3 = SimpleNamespace(fsdp_plugin_args=None, hf_deepspeed_config=SimpleNamespace(is_zero3=lambda: True))
    prepare_sharding(model, zero3)
    moe = generic_moe()
    prepare_sharding(moe, zero3)  # the heads then run for every task
    assert moe.heads.runs_every_task
    zero2 = SimpleNamespace(fsdp_plugin_args=None, hf_deepspeed_config=SimpleNamespace(is_zero3=lambda: False))
    moe = generic_moe()
    prepare_sharding(moe, zero2)  # ZeRO-2's buckets too need the same gradients in the same order on every rank
    assert moe.heads.runs_every_task
    ddp = generic_moe()
    prepare_sharding(ddp, SimpleNamespace(fsdp_plugin_args=None, hf_deepspeed_config=None))
    assert not ddp.heads.runs_every_task  # DDP (fixed buckets) and FSDP2 keep the split forward as it is
    monkeypatch.delattr(MultiTaskHeads, "runs_every_task")  # heads that cannot: refused, named
    with pytest.raises(ValueError, match=r"ZeRO-3 cannot train TaskMoEForMultiTask: heads \(MultiTaskHeads\)"):
        prepare_sharding(generic_moe(), zero3)
