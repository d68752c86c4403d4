"""Task-level routing with low-rank experts (`expert_rank`): one copy of each routed layer whose linears hold each
expert's LoRA delta (hf_taskmoe/layers/low_rank.py), on tiny GPT-2, Llama, T5 and BART checkpoints built here:
the dense model's outputs at upcycling under any route, a frozen base that training leaves bit-identical (with
gradient checkpointing and through `MultiTaskTrainer` too), the parameter report, save / load, mixed-task generation
under hard routes, `export_task`'s merge, the config's checks, and a forward that reads nothing back."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM
from transformers.cache_utils import DynamicCache

import hf_taskmoe
from hf_taskmoe import BartTaskRouted, TaskSpec
from hf_taskmoe.compat import CHECKPOINTING_ENABLE
from hf_taskmoe.models import family_of
from hf_taskmoe.models.task_routing import TaskRoutedForCausalLM, TaskRoutedForSeq2SeqLM, TaskRoutedLMConfig

from .test_bart_routed import dense_bart
from .test_host_syncs import host_reads
from .test_task_routed_lm import dense_model as dense_lm
from .test_task_routed_t5 import dense_model as dense_t5

TASKS = [TaskSpec(name=n, problem_type="seq2seq") for n in ("x", "y", "z")]
ARCHS = ["gpt2", "llama", "t5", "bart"]
MIXED = torch.tensor([0, 1, 2, 1])


def dense(arch: str):
    if arch in ("gpt2", "llama"):
        return dense_lm(arch)
    return dense_t5("t5") if arch == "t5" else dense_bart()


def low_rank(arch: str, rank: int = 4, **kwargs):
    model_class = {"gpt2": TaskRoutedForCausalLM, "llama": TaskRoutedForCausalLM, "t5": TaskRoutedForSeq2SeqLM,
                   "bart": BartTaskRouted}[arch]
    return model_class.from_dense(dense(arch), TASKS, expert_rank=rank, **kwargs).eval()


def inputs(arch: str, model, rows: int = 4, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    batch = {"input_ids": torch.randint(4, vocab, (rows, 7), generator=g)}
    if arch in ("t5", "bart"):
        batch["decoder_input_ids"] = torch.randint(4, vocab, (rows, 5), generator=g)
    return batch


def dense_logits(arch: str, batch: dict) -> torch.Tensor:
    with torch.no_grad():
        return dense(arch)(**batch).logits


def move_apart(model, seed: int = 1, scale: float = 0.5):
    """Random deltas and router, as training would leave them (the experts then differ)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".lora_B") or name.startswith("router."):
                p.add_(torch.randn(p.shape, generator=g) * scale)
    return model


@pytest.mark.parametrize("arch", ARCHS)
def test_upcycled_low_rank_experts_compute_the_dense_model_under_any_route(arch):
    model = low_rank(arch, selection="softmax")
    batch = inputs(arch, model)
    reference = dense_logits(arch, batch)
    g = torch.Generator().manual_seed(3)
    shape = (4, model.config.num_routed_layers, model.config.num_experts)
    with torch.no_grad():
        for weights in (torch.rand(shape, generator=g), torch.randn(shape, generator=g) * 3):
            out = model(**batch, task_ids=MIXED, routing_weights=weights).logits
            torch.testing.assert_close(out, reference, rtol=0, atol=1e-6)
        torch.testing.assert_close(model(**batch, task_ids=MIXED).logits, reference, rtol=0, atol=1e-6)


@pytest.mark.parametrize("arch", ARCHS)
def test_a_routed_layer_is_one_module_with_the_dense_cache(arch):
    model = low_rank(arch)
    for layer in model.routed_layers():
        assert len(layer.experts) == 1
    wrapped = model.low_rank_modules()
    assert wrapped and all(m.lora_A.shape[0] == model.config.num_experts for m in wrapped.values())
    assert isinstance(model.new_cache(), DynamicCache) or hasattr(model.new_cache(), "self_attention_cache")
    if arch in ("gpt2", "llama"):
        assert len(model.new_cache().layers) == model.config.num_layers
        # every linear of the layer by default: Llama's seven projections
        names = {n.rsplit(".", 1)[-1] for n in wrapped if ".layers.0." in n}
        if arch == "llama":
            assert names == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


@pytest.mark.parametrize("arch", ["llama", "t5"])
def test_hard_routes_take_the_one_expert_path_with_the_mixing_paths_values(arch):
    """Evaluation under hard routes gathers each row's expert; passing the same decisions by hand mixes every
    expert's delta: the same logits."""
    model = move_apart(low_rank(arch, selection="hard"))
    batch = inputs(arch, model)
    with torch.no_grad():
        out = model(**batch, task_ids=MIXED, output_router_logits=True)
        mixed = model(**batch, task_ids=MIXED, routing_weights=out.routing_decisions).logits
    torch.testing.assert_close(out.logits, mixed, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(out.logits, dense_logits(arch, batch), atol=1e-3)  # the deltas act


def test_hard_training_reaches_the_router_through_the_chosen_expert():
    model = move_apart(low_rank("llama", selection="hard")).train()
    batch = inputs("llama", model)
    model(**batch, task_ids=MIXED, labels=batch["input_ids"]).loss.backward()
    assert model.router.net.dense_out.weight.grad.abs().sum() > 0
    assert all(p.grad is None for n, p in model.named_parameters() if ".base_layer." in n)


def _frozen_snapshot(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}


@pytest.mark.parametrize("arch", ["gpt2", "llama", "t5", "bart"])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_frozen_base_trains_only_the_deltas_and_the_router(arch, checkpointing):
    model = low_rank(arch, selection="gumbel_softmax_st")
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {n for n, _ in model.named_parameters()
                         if n.endswith((".lora_A", ".lora_B")) or n.startswith("router.")}
    if checkpointing:
        getattr(model, CHECKPOINTING_ENABLE)()  # transformers' `gradient_checkpointing_enable` (renamed in 5.24)
    frozen = _frozen_snapshot(model)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    batch = inputs(arch, model)
    labels = batch.get("decoder_input_ids", batch["input_ids"])
    model.train()
    runs = []
    first = next(iter(model.low_rank_modules().values()))
    first.register_forward_hook(lambda *_: runs.append(1))
    for _ in range(3):
        model(**batch, task_ids=MIXED, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert len(runs) == (6 if checkpointing else 3)  # a checkpointed layer runs again in the backward pass
    for name, param in model.named_parameters():
        if name in frozen:
            assert torch.equal(param, frozen[name]), name
    held = {id(p) for p in optimizer.state}
    assert held and held <= {id(p) for p in params}
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)
    assert any(m.lora_B.abs().sum() > 0 for m in model.low_rank_modules().values())  # the deltas learned


def test_train_base_and_frozen_task_embeddings():
    model = low_rank("llama", train_base=True)
    assert all(p.requires_grad for p in model.parameters())
    model = low_rank("llama", freeze_task_embeddings=True)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert "router.task_embeddings.weight" not in trainable and any(n.startswith("router.net.") for n in trainable)


def test_one_step_through_the_multitask_trainer_leaves_the_base_alone(tmp_path):
    from datasets import Dataset

    from hf_taskmoe.training import MultiTaskTrainer, MultiTaskTrainingArguments

    model = low_rank("gpt2", selection="hard")
    frozen = _frozen_snapshot(model)
    rows = {"input_ids": [[5, 6, 7, 8, 9, 10]] * 4, "attention_mask": [[1] * 6] * 4,
            "labels": [[-100, -100, -100, 8, 9, 10]] * 4}
    args = MultiTaskTrainingArguments(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4,
                                      use_cpu=True, report_to="none", save_strategy="no", learning_rate=1e-2)
    trainer = MultiTaskTrainer(model=model, args=args, train_dataset={t.name: Dataset.from_dict(rows) for t in TASKS})
    trainer.train()
    for name, param in model.named_parameters():
        if name in frozen:
            assert torch.equal(param.detach().cpu(), frozen[name]), name
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    assert trainer.optimizer.state and {id(p) for p in trainer.optimizer.state} <= trainable
    assert any(m.lora_B.abs().sum() > 0 for m in model.low_rank_modules().values())


def test_parameter_report_counts_the_deltas_as_experts():
    model = low_rank("llama")
    report = hf_taskmoe.parameter_report(model)
    deltas = sum(p.numel() for n, p in model.named_parameters() if n.endswith((".lora_A", ".lora_B")))
    router = sum(p.numel() for n, p in model.named_parameters() if n.startswith("router."))
    assert report.expert == deltas
    assert report.trainable == deltas + router
    assert report.shared == sum(p.numel() for p in dense("llama").parameters())
    # whole experts: the forked layers are the experts, as before
    full = TaskRoutedForCausalLM.from_dense(dense("llama"), TASKS)
    assert hf_taskmoe.parameter_report(full).expert > 0 and hf_taskmoe.parameter_report(full).trainable == \
        hf_taskmoe.parameter_report(full).total


@pytest.mark.parametrize("arch", ["gpt2", "t5"])
def test_save_and_load_round_trip_through_the_auto_classes(arch, tmp_path):
    targets = ["q", "wo"] if arch == "t5" else ["c_attn", "c_fc"]
    model = move_apart(low_rank(arch, selection="hard", expert_alpha=3.0, expert_targets=targets))
    model.save_pretrained(tmp_path)
    auto = AutoModelForCausalLM if arch == "gpt2" else AutoModelForSeq2SeqLM
    loaded = auto.from_pretrained(tmp_path).eval()
    assert type(loaded) is family_of(model.config.model_type).model_class  # what the model_type loads as
    for field in ("expert_rank", "expert_alpha", "expert_dropout", "expert_targets", "train_base"):
        assert getattr(loaded.config, field) == getattr(model.config, field), field
    assert set(loaded.low_rank_modules()) == set(model.low_rank_modules())
    batch = inputs(arch, model)
    with torch.no_grad():
        assert torch.equal(loaded(**batch, task_ids=MIXED).logits, model(**batch, task_ids=MIXED).logits)
    assert {n for n, p in loaded.named_parameters() if p.requires_grad} == \
        {n for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("arch", ["gpt2", "llama", "t5", "bart"])
def test_greedy_generation_of_a_mixed_batch_equals_each_row_alone(arch):
    model = move_apart(low_rank(arch, selection="hard"), scale=1.0)
    ids = inputs(arch, model)["input_ids"]
    tasks = torch.tensor([0, 1, 2, 0])
    assert len({tuple(model.hard_route(t.name)) for t in TASKS}) > 1  # the tasks take different experts
    kwargs = dict(max_new_tokens=5, do_sample=False, min_new_tokens=5)
    with torch.no_grad():
        together = model.generate(ids, task_ids=tasks, **kwargs)
        for row in range(ids.shape[0]):
            alone = model.generate(ids[row:row + 1], task_ids=tasks[row:row + 1], **kwargs)
            assert torch.equal(together[row], alone[0]), row


def greedy_by_forward(model, ids: torch.Tensor, tasks: torch.Tensor, steps: int, start: torch.Tensor | None = None):
    """Greedy decoding by whole forwards without a cache: the router and each linear's gather run at every step. An
    encoder-decoder decodes from `start` (its decoder's first tokens), a causal LM continues `ids`. The end-of-sequence
    token is never chosen (`min_new_tokens=steps`)."""
    seq, logits = (ids if start is None else start), []
    eos = model.generation_config.eos_token_id
    for _ in range(steps):
        inputs = {"input_ids": seq} if start is None else {"input_ids": ids, "decoder_input_ids": seq}
        last = model(**inputs, task_ids=tasks, use_cache=False).logits[:, -1]  # (batch, vocab)
        logits.append(last)
        allowed = last.clone()
        if eos is not None:
            allowed[:, eos] = float("-inf")
        seq = torch.cat([seq, allowed.argmax(-1, keepdim=True)], dim=1)
    return seq, torch.stack(logits, dim=1)


@pytest.mark.parametrize("arch", ARCHS)
def test_generation_gathers_each_rows_factors_once_and_never_serves_another_calls(arch):
    """`generate` runs the router once and gathers each linear's rows' factors at its first step, kept for the call's
    later steps only: a second call with other task ids (the same rows permuted, then one row) gets its own, and every
    call decodes what whole forwards without a cache decode."""
    model = move_apart(low_rank(arch, selection="hard"), scale=1.0)
    assert len({tuple(model.hard_route(t.name)) for t in TASKS}) > 1  # the tasks take different experts
    ids = inputs(arch, model)["input_ids"]
    router_calls = []
    model.router.register_forward_hook(lambda *args: router_calls.append(1))
    kwargs = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, return_dict_in_generate=True,
                  output_logits=True)
    with torch.no_grad():
        for tasks in (torch.tensor([0, 1, 2, 0]), torch.tensor([2, 0, 1, 1]), torch.tensor([1, 1, 1, 1])):
            router_calls.clear()
            out = model.generate(ids, task_ids=tasks, **kwargs)
            causal = arch in ("gpt2", "llama")
            # the first step's decisions serve the later steps (an encoder-decoder's encoder routes once before it)
            assert len(router_calls) == (1 if causal else 2)
            router_calls.clear()
            expected, logits = greedy_by_forward(model, ids, tasks, 4, None if causal else out.sequences[:, :1])
            assert len(router_calls) == 4
            assert torch.equal(out.sequences, expected), tasks
            torch.testing.assert_close(torch.stack(out.logits, dim=1), logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
def test_export_task_merges_the_routes_deltas(arch):
    model = move_apart(low_rank(arch, selection="hard"))
    batch = inputs(arch, model)
    for task in range(len(TASKS)):
        exported = model.export_task(TASKS[task].name)
        assert type(exported) is type(dense(arch))
        with torch.no_grad():
            routed = model(**batch, task_ids=torch.full((4,), task)).logits
            torch.testing.assert_close(exported(**batch).logits, routed, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("value", [True, 0, -2, 1.5, "8"])
def test_a_rank_that_is_not_a_positive_int_is_refused(value):
    with pytest.raises(ValueError, match="`expert_rank`"):
        TaskRoutedLMConfig(tasks=[t.to_dict() for t in TASKS], expert_rank=value)


def test_low_rank_options_without_a_rank_and_unknown_targets_are_refused():
    with pytest.raises(ValueError, match="expert_alpha"):
        TaskRoutedLMConfig(tasks=[t.to_dict() for t in TASKS], expert_alpha=16)
    with pytest.raises(ValueError, match="expert_dropout"):
        TaskRoutedLMConfig(tasks=[t.to_dict() for t in TASKS], expert_rank=4, expert_dropout=1.0)
    with pytest.raises(ValueError, match="`expert_targets`"):
        TaskRoutedLMConfig(tasks=[t.to_dict() for t in TASKS], expert_rank=4, expert_targets="q_proj")
    with pytest.raises(ValueError, match=r"`expert_targets` \['nope'\] match no linear"):
        low_rank("llama", expert_targets=["q_proj", "nope"])


@pytest.mark.parametrize("selection", ["hard", "softmax", "gumbel_softmax_st"])
def test_a_training_step_reads_nothing_back(selection):
    model = move_apart(low_rank("llama", selection=selection)).train()
    batch = inputs("llama", model)
    with host_reads() as calls:
        out = model(**batch, task_ids=MIXED, labels=batch["input_ids"], values_checked=True)
        out.loss.backward()
    assert not calls, Counter(calls)


# ---------------------------------------------------------------------------------------- exact export to peft
def _load_exported(folder, arch: str, tasks: list[str]):
    """The export read back with plain transformers + peft only."""
    from peft import PeftModel

    auto = AutoModelForCausalLM if arch in ("gpt2", "llama") else AutoModelForSeq2SeqLM
    base = auto.from_pretrained(folder / "base").eval()
    peft_model = PeftModel.from_pretrained(base, folder / tasks[0], adapter_name=tasks[0])
    for task in tasks[1:]:
        peft_model.load_adapter(folder / task, adapter_name=task)
    return peft_model.eval()


@pytest.mark.parametrize("arch", ARCHS)
def test_exported_adapters_are_the_routes_deltas_exactly(arch, tmp_path):
    import json

    model = move_apart(low_rank(arch, selection="hard"), scale=1.0)
    names = [t.name for t in TASKS]
    result = model.export_task_adapters(tmp_path / "out")
    manifest = json.loads((tmp_path / "out" / "hf_taskmoe_adapters.json").read_text())
    assert manifest["exact"] is True and manifest["method"] == "low_rank_experts" and result.rank == 4
    adapter = json.loads((tmp_path / "out" / "x" / "adapter_config.json").read_text())
    assert adapter["r"] == 4 and adapter["lora_alpha"] == model.config.lora_alpha
    assert adapter["fan_in_fan_out"] is (arch == "gpt2")
    peft_model = _load_exported(tmp_path / "out", arch, names)
    # peft may write the names as shorter suffixes (20 or more targets): the same modules take the adapters
    adapted = {n.removeprefix("base_model.model.") for n, m in peft_model.named_modules() if hasattr(m, "lora_A")}
    assert adapted == set(result.target_modules) and len(adapter["target_modules"]) <= len(adapted)
    batch = inputs(arch, model)
    with torch.no_grad():
        routed = {t: model(**batch, task_ids=torch.full((4,), t)).logits for t in range(len(names))}
        for t, name in enumerate(names):
            peft_model.set_adapter(name)
            torch.testing.assert_close(peft_model(**batch).logits, routed[t], rtol=1e-5, atol=1e-5)
        rows = [0, 1, 2, 1]
        mixed = peft_model(**batch, adapter_names=[names[t] for t in rows]).logits
        for i, t in enumerate(rows):
            torch.testing.assert_close(mixed[i], routed[t][i], rtol=1e-5, atol=1e-5)
        # greedy tokens of a mixed batch, peft's per-row adapters against the routed model
        ids = batch["input_ids"]
        kwargs = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False)
        ours = model.generate(ids, task_ids=torch.tensor(rows), **kwargs)
        theirs = peft_model.generate(input_ids=ids, adapter_names=[names[t] for t in rows], **kwargs)
        assert torch.equal(ours, theirs)


def test_the_low_rank_export_refuses_the_svd_options(tmp_path):
    model = low_rank("llama", selection="hard")
    with pytest.raises(ValueError, match="`rank` must be 'full' or 4"):
        model.export_task_adapters(tmp_path / "a", rank=8)
    with pytest.raises(ValueError, match="`base` and `svd`"):
        model.export_task_adapters(tmp_path / "b", base="majority")


def test_the_model_card_names_the_rank_and_the_trainable_share():
    from hf_taskmoe.hub import render_model_card

    model = low_rank("llama")
    report = hf_taskmoe.parameter_report(model)
    text = str(render_model_card(model))
    assert "LoRA delta of rank 4" in text and "dense weights frozen" in text
    assert f"trainable {report.trainable:,} ({100 * report.trainable / report.total:.2f}%" in text


def test_bf16_forward_keeps_the_dense_outputs_and_both_paths_agree():
    model = low_rank("llama", selection="hard").to(torch.bfloat16)
    batch = inputs("llama", model)
    with torch.no_grad():
        reference = dense("llama").to(torch.bfloat16)(**batch).logits
        out = model(**batch, task_ids=MIXED, output_router_logits=True)
        assert out.logits.dtype == torch.bfloat16 and torch.equal(out.logits, reference)
        move_apart(model)
        one = model(**batch, task_ids=MIXED, output_router_logits=True)
        mixed = model(**batch, task_ids=MIXED, routing_weights=one.routing_decisions).logits
    torch.testing.assert_close(one.logits.float(), mixed.float(), rtol=0.05, atol=0.05)


@pytest.mark.parametrize("arch", ["llama", "bart"])
def test_beam_search_of_a_mixed_batch_equals_each_row_alone(arch):
    model = move_apart(low_rank(arch, selection="hard"), scale=1.0)
    ids = inputs(arch, model)["input_ids"]
    tasks = torch.tensor([2, 0, 1, 2])
    kwargs = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, num_beams=3)
    with torch.no_grad():
        together = model.generate(ids, task_ids=tasks, **kwargs)
        for row in range(ids.shape[0]):
            alone = model.generate(ids[row:row + 1], task_ids=tasks[row:row + 1], **kwargs)
            assert torch.equal(together[row], alone[0]), row


def test_run_multitask_builds_low_rank_experts_and_leaves_the_base_alone(tmp_path, minilm):
    """`run_multitask.py --expert_rank 4 --expert_targets q_proj v_proj` (options read from the config's fields):
    the saved model has the rank and the targets, and its dense weights are the checkpoint's, untouched."""
    from .test_run_multitask_lm import _save_dense, _tasks, run_multitask

    folder = _save_dense("llama", tmp_path / "dense", minilm)
    out = tmp_path / "out"
    run_multitask.main([
        "--model_family", "bart_routed", "--model_name_or_path", str(folder), "--tasks", str(_tasks(tmp_path)),
        "--output_dir", str(out), "--do_train", "--max_steps", "2", "--per_device_train_batch_size", "4",
        "--max_train_samples", "4", "--max_seq_length", "24", "--max_target_length", "4", "--num_experts", "2",
        "--expert_rank", "4", "--expert_targets", "q_proj", "v_proj", "--learning_rate", "1e-2", "--use_cpu",
        "--report_to", "none", "--save_strategy", "no", "--disable_tqdm", "true",
    ])
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.expert_rank == 4 and model.config.expert_targets == ["q_proj", "v_proj"]
    assert {n.rsplit(".", 1)[-1] for n in model.low_rank_modules()} == {"q_proj", "v_proj"}
    dense_state = AutoModelForCausalLM.from_pretrained(folder).state_dict()
    for name, tensor in model.backbone.state_dict().items():
        if name.endswith((".lora_A", ".lora_B")):
            continue
        source = name.replace(".experts.0.", ".").replace(".base_layer.", ".")
        if source in dense_state:  # the vocabulary may have grown with the tokenizer's special tokens
            if tensor.shape == dense_state[source].shape:
                assert torch.equal(tensor, dense_state[source]), name
    assert any(m.lora_B.abs().sum() > 0 for m in model.low_rank_modules().values())
    assert "LoRA delta of rank 4" in (out / "README.md").read_text()


def test_only_the_routed_layers_get_deltas(tmp_path):
    model = move_apart(low_rank("llama", selection="hard", routed_layers=[1]))
    assert model.low_rank_modules() and all(".layers.1." in n for n in model.low_rank_modules())
    batch = inputs("llama", model)
    with torch.no_grad():
        routed = model(**batch, task_ids=torch.full((4,), 2)).logits
        torch.testing.assert_close(model.export_task("z")(**batch).logits, routed, rtol=1e-5, atol=1e-5)
    result = model.export_task_adapters(tmp_path / "out", tasks=["z"])
    assert all(".layers.1." in n for n in result.target_modules)
    peft_model = _load_exported(tmp_path / "out", "llama", ["z"])
    with torch.no_grad():
        torch.testing.assert_close(peft_model(**batch).logits, routed, rtol=1e-5, atol=1e-5)


def test_the_hard_routed_forward_exports_with_torch_export():
    """No host read and no data-dependent shape: `torch.export` traces the forward of a mixed batch."""
    model = move_apart(low_rank("llama", selection="hard"))
    ids = inputs("llama", model)["input_ids"]

    class Logits(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids, task_ids):
            return self.inner(input_ids=input_ids, task_ids=task_ids, values_checked=True, use_cache=False).logits

    wrapper = Logits(model).eval()
    program = torch.export.export(wrapper, (ids, MIXED))
    with torch.no_grad():
        torch.testing.assert_close(program.module()(ids, MIXED), wrapper(ids, MIXED), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("precision", ["autocast", "bf16_weights"])
def test_a_bf16_training_step_leaves_the_frozen_base_alone(precision):
    """A training step under CPU bf16 autocast (fp32 weights), and one with the whole model stored in bf16: the
    frozen weights are bit-identical after it, take no gradient and no optimizer state, and the deltas moved."""
    model = low_rank("llama", selection="gumbel_softmax_st").train()
    if precision == "bf16_weights":
        model = model.to(torch.bfloat16)
    frozen = _frozen_snapshot(model)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    batch = inputs("llama", model)
    for _ in range(2):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "autocast"):
            loss = model(**batch, task_ids=MIXED, labels=batch["input_ids"]).loss
        assert torch.isfinite(loss)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    for name, param in model.named_parameters():
        if name in frozen:
            assert torch.equal(param, frozen[name]), name
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)
    assert {id(p) for p in optimizer.state} == {id(p) for p in params}
    assert any(m.lora_B.abs().sum() > 0 for m in model.low_rank_modules().values())
