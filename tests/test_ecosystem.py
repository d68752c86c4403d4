"""peft on every family, and sharded safetensors checkpoints that load without unpickling."""

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModel

from hf_taskmoe import BertForTaskMoE, BertWithPALs, MMoEModel
from hf_taskmoe.models import family_of

from .conftest import random_batch, tiny_config
from .test_bart_routed import batch as seq2seq_batch
from .test_bart_routed import routed as bart_routed
from .test_bert_pals import pals_config
from .test_camtl import _model as camtl_model
from .test_mmoe import batch as tabular_batch
from .test_mmoe import config as mmoe_config

# family -> (build a tiny model, a batch, the LoRA target modules documented in docs/deployment.md, or LoraConfig's
# targeting keywords)
FAMILIES = {
    # the experts' weights are stacked parameters (`ExpertBank`, transformers' experts layout): LoRA reaches them by
    # `target_parameters`, in MT-TaG's implementation and in transformers' (each reads the adapted weights)
    **{
        f"bert_taskmoe_{implementation}": (
            lambda implementation=implementation: BertForTaskMoE(
                tiny_config(num_experts=3, experts_implementation=implementation, intermediate_size=40)  # 8 | 40
            ),
            lambda m: random_batch(m.config),
            {"target_modules": ["query", "value"], "target_parameters": ["experts.up_proj", "experts.down_proj"]},
        )
        for implementation in ("taskmoe_sorted", "grouped_mm")
    },
    "bert_pals": (
        lambda: BertWithPALs(pals_config(pal_decoder_init="normal")),
        lambda m: random_batch(m.config),
        ["query", "value", "intermediate.dense", "output.dense"],
    ),
    "camtl": (
        lambda: camtl_model().train(),
        lambda m: random_batch(m.config),
        ["query", "value", "intermediate.dense", "output.dense"],
    ),
    "mmoe": (lambda: MMoEModel(mmoe_config()), lambda m: tabular_batch(), ["gates", "click", "genre", "rating"]),
    # every expert is a whole BART layer: LoRA on its attention and FFN reaches each expert's copy
    "bart_routed": (
        lambda: bart_routed("gumbel_softmax_st"),
        lambda m: seq2seq_batch(),
        ["q_proj", "v_proj", "fc1", "fc2"],
    ),
}


def _labels(model, batch):
    if "labels" in batch:
        return batch
    specs = model.config.task_specs
    labels = [0.5 if specs[t].problem_type == "regression" else 1.0 for t in batch["task_ids"].tolist()]
    return {**batch, "labels": torch.tensor(labels)}


def _outputs(model, batch):
    with torch.no_grad():
        out = model(**{k: v for k, v in batch.items() if k != "labels"})
    return out.task_logits if hasattr(out, "task_logits") else {"lm": out.logits}  # seq2seq: one LM head


@pytest.mark.parametrize("family", list(FAMILIES))
def test_lora_trains_saves_reloads_and_merges(family, tmp_path):
    build, make_batch, targets = FAMILIES[family]
    torch.manual_seed(0)
    base = build().eval()
    state = {k: v.clone() for k, v in base.state_dict().items()}
    batch = _labels(base, make_batch(base))
    targeting = targets if isinstance(targets, dict) else {"target_modules": targets}
    peft_model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, **targeting))
    assert peft_model.get_nb_trainable_parameters()[0] > 0
    for target in targeting.get("target_parameters", ()):  # the adapted parameters' modules carry LoRA weights
        assert any(target.split(".")[0] in n and "lora_A" in n for n, _ in peft_model.named_parameters()), target
    optimizer = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=1e-2)
    peft_model.train()
    for _ in range(3):
        loss = peft_model(**batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    for target in targeting.get("target_parameters", ()):  # B starts at zero: trained, so the forward read A B
        module = target.split(".")[0]
        assert any(module in n and "lora_B" in n and p.abs().sum() > 0 for n, p in peft_model.named_parameters())
    peft_model.eval()
    tuned = _outputs(peft_model, batch)
    peft_model.save_pretrained(tmp_path / "adapter")

    fresh = build()
    fresh.load_state_dict(state)
    reloaded = PeftModel.from_pretrained(fresh.eval(), tmp_path / "adapter").eval()
    for name, logits in _outputs(reloaded, batch).items():
        torch.testing.assert_close(logits, tuned[name], atol=1e-5, rtol=0)

    merged = reloaded.merge_and_unload()
    assert type(merged) is type(base)
    for name, logits in _outputs(merged, batch).items():
        torch.testing.assert_close(logits, tuned[name], atol=1e-5, rtol=1e-5)
    untouched = build()
    untouched.load_state_dict(state)
    assert any(
        not torch.allclose(_outputs(untouched.eval(), batch)[n], tuned[n]) for n in tuned
    )  # LoRA changed something


@pytest.mark.parametrize("family", list(FAMILIES))
def test_sharded_safetensors_round_trip_without_unpickling(family, tmp_path, monkeypatch):
    build, make_batch, _ = FAMILIES[family]
    torch.manual_seed(0)
    model = build().eval()
    model.save_pretrained(tmp_path, max_shard_size="1KB")
    shards = sorted(tmp_path.glob("model-*-of-*.safetensors"))
    assert len(shards) > 1 and (tmp_path / "model.safetensors.index.json").exists()
    assert not list(tmp_path.glob("*.bin")) and not list(tmp_path.glob("*.pt"))

    def no_unpickling(*args, **kwargs):
        raise AssertionError("loading a checkpoint must not unpickle anything")

    monkeypatch.setattr(torch, "load", no_unpickling)
    loaded = AutoModel.from_pretrained(tmp_path).eval()
    assert type(loaded) is family_of(model.config.model_type).model_class  # what the model_type loads as
    saved, restored = model.state_dict(), loaded.state_dict()
    assert saved.keys() == restored.keys() and all(torch.equal(saved[k], restored[k]) for k in saved)
    batch = make_batch(model)
    expected = _outputs(model, batch)
    for name, logits in _outputs(loaded, batch).items():
        torch.testing.assert_close(logits, expected[name], atol=1e-6, rtol=0)


def test_lora_on_bart_routed_generates_per_task_and_explains_peft_task_type():
    """A PeftModel without `task_type` passes `task_ids` on to `generate`; peft's task-specific wrappers keep
    `task_ids` for themselves, and the error says so."""
    torch.manual_seed(0)
    model = bart_routed("gumbel_softmax_st")
    batch = seq2seq_batch()
    kwargs = dict(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], task_ids=batch["task_ids"],
                  max_new_tokens=4, num_beams=2, do_sample=False)
    expected = model.generate(**kwargs)
    lora = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=True)).eval()
    assert torch.equal(lora.generate(**kwargs), expected)  # LoRA B starts at zero: same tokens
    lora = lora.unload()
    wrapped = get_peft_model(lora, LoraConfig(r=4, target_modules=["q_proj"], task_type="SEQ_2_SEQ_LM")).eval()
    with pytest.raises(ValueError, match="Leave the LoraConfig's `task_type` unset"):
        wrapped(**batch)


@pytest.mark.slow
def test_bert_large_shaped_mttag_saves_sharded_and_loads_lazily_onto_a_device(tmp_path):
    """A BERT-large-shaped MT-TaG (24 layers of 1024, 4 experts: about 0.94B parameters) saves in shards and loads
    with `AutoModel.from_pretrained` memory-mapped (resident memory grows by far less than the weights) and straight
    onto a device with `device_map` (accelerate)."""
    import resource

    from hf_taskmoe import BertForTaskMoE, BertTaskMoEConfig, TaskSpec

    config = BertTaskMoEConfig(tasks=[TaskSpec(name="a", num_labels=2)], hidden_size=1024, num_hidden_layers=24,
                               num_attention_heads=16, intermediate_size=4096, num_experts=4)
    model = BertForTaskMoE._from_config(config, dtype=torch.bfloat16)
    total = sum(p.numel() for p in model.parameters())
    assert 0.9e9 < total < 1.0e9
    model.save_pretrained(tmp_path, max_shard_size="500MB")
    assert len(list(tmp_path.glob("model-*.safetensors"))) >= 4
    probe = {n: p.detach().clone() for n, p in list(model.named_parameters())[-3:]}
    del model
    import gc

    gc.collect()
    before = int(open("/proc/self/statm").read().split()[1]) * 4096
    loaded = AutoModel.from_pretrained(tmp_path, dtype=torch.bfloat16, device_map="cpu")
    grown = int(open("/proc/self/statm").read().split()[1]) * 4096 - before
    assert type(loaded).__name__ == "TaskMoEForMultiTask" and loaded.device.type == "cpu"  # the family's model
    assert grown < 0.5 * total * 2, (
        f"resident memory grew by {grown / 2**20:.0f} MB for {total * 2 / 2**20:.0f} MB of weights"
    )
    named = dict(loaded.named_parameters())
    assert all(torch.equal(named[n], p) for n, p in probe.items())
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss > 0
