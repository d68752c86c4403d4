"""The backbone-generic families in the ecosystem a BERT family lives in: the multi-task text-classification pipeline
(loaded by path with the WordPiece tokenizer saved beside the model) and peft's LoRA (train, save the adapter, reload,
merge back into the same class), for each encoder method on a post-norm (RoBERTa), a BERT-distilled (DistilBERT) and
a pre-norm, rotary, local/global architecture (ModernBERT)."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModel, AutoTokenizer, pipeline

import hf_taskmoe
from hf_taskmoe import (
    CAMTLBackboneConfig,
    CAMTLForMultiTask,
    PALsConfig,
    PALsForMultiTask,
    TaskMoEConfig,
    TaskMoEForMultiTask,
    TaskSpec,
)
from hf_taskmoe.models import family_of

from .backbone_matrix import dense_config

METHODS = {
    "mt-tag": (TaskMoEForMultiTask, TaskMoEConfig, {"num_experts": 2}),
    "pals": (PALsForMultiTask, PALsConfig, {"pal_size": 8, "pal_num_heads": 2}),
    "ca-mtl": (CAMTLForMultiTask, CAMTLBackboneConfig, {"conditional_attention_max_length": 32}),
}
#: each architecture's attention projections, LoRA's targets (peft knows them by the dense model_type only)
LORA_TARGETS = {"roberta": ["query", "value"], "distilbert": ["q_lin", "v_lin"], "modernbert": ["Wqkv"]}
TASKS = [TaskSpec(name="sst2", label_names=["negative", "positive"]),
         TaskSpec(name="stsb", problem_type="regression")]


def _model(method: str, arch: str):
    model_cls, config_cls, kwargs = METHODS[method]
    config = dense_config(arch)
    config.vocab_size = 30522  # MiniLM's WordPiece ids
    if arch == "modernbert":
        config.pad_token_id, config.cls_token_id, config.sep_token_id = 0, 101, 102
    torch.manual_seed(0)
    return model_cls(config_cls(dense_config=config, tasks=TASKS, **kwargs)).eval()


@pytest.mark.parametrize("arch", list(LORA_TARGETS))
@pytest.mark.parametrize("method", list(METHODS))
def test_the_pipeline_serves_each_method_on_each_backbone_by_path(method, arch, tmp_path, minilm):
    model = _model(method, arch)
    model.save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(minilm).save_pretrained(tmp_path)
    pipe = pipeline(hf_taskmoe.pipelines.PIPELINE_TASK, model=str(tmp_path))
    assert type(pipe.model) is family_of(model.config.model_type).model_class  # what the model_type loads as
    got = pipe(["a fine film", "a dull one"], task="sst2")
    enc = pipe.tokenizer(["a fine film", "a dull one"], padding=True, return_tensors="pt")
    with torch.no_grad():
        probs = model(**enc, task_ids=model.task_ids_for(["sst2", "sst2"])).task_logits["sst2"].softmax(-1)
    assert [g["label"] for g in got] == [["negative", "positive"][int(i)] for i in probs.argmax(-1)]
    assert [g["score"] for g in got] == pytest.approx(probs.max(-1).values.tolist(), abs=1e-5)
    score = pipe({"text": "A man plays.", "text_pair": "A man is playing."}, task="stsb")["score"]
    assert isinstance(score, float)


@pytest.mark.parametrize("arch", list(LORA_TARGETS))
@pytest.mark.parametrize("method", list(METHODS))
def test_lora_trains_saves_reloads_and_merges_on_each_backbone(method, arch, tmp_path):
    base = _model(method, arch)
    state = {k: v.clone() for k, v in base.state_dict().items()}
    g = torch.Generator().manual_seed(0)
    batch = {"input_ids": torch.randint(1000, 30000, (4, 12), generator=g),
             "attention_mask": torch.ones(4, 12, dtype=torch.long), "task_ids": torch.tensor([0, 1, 0, 1]),
             "labels": torch.tensor([1.0, 0.3, 0.0, -0.2])}
    lora = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS[arch]))
    optimizer = torch.optim.AdamW([p for p in lora.parameters() if p.requires_grad], lr=1e-2)
    lora.train()
    for _ in range(3):
        loss = lora(**batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    lora.eval()
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    with torch.no_grad():
        tuned = lora(**inputs).task_logits
    lora.save_pretrained(tmp_path / "adapter")

    fresh = _model(method, arch)
    fresh.load_state_dict(state)
    reloaded = PeftModel.from_pretrained(fresh, tmp_path / "adapter").eval()
    merged = reloaded.merge_and_unload()
    assert type(merged) is type(base)
    with torch.no_grad():
        for name, logits in merged(**inputs).task_logits.items():
            torch.testing.assert_close(logits, tuned[name], atol=1e-5, rtol=1e-5)
    merged.save_pretrained(tmp_path / "merged")
    assert type(AutoModel.from_pretrained(tmp_path / "merged")) is type(base)
