"""A family config's read-only views of its dense config (`hidden_size`, `vocab_size`, `layer_norm_eps`, ...) take an
assignment by writing the dense config's own field, where the model reads it (`TaskConfigMixin._set_dense_view`):
transformers sets them on the outer config (`resize_token_embeddings`, its tests' `set_config_for_less_flaky_test`).
A derived property is still refused."""

from __future__ import annotations

import pytest
import torch
from transformers import BertConfig, GPT2Config

from hf_taskmoe import TaskMoEConfig, TaskMoEForMultiTask, TaskRoutedLMConfig, TaskSpec

ENCODER_TASKS = [TaskSpec(name="a", num_labels=3), TaskSpec(name="b", problem_type="regression")]


def test_an_encoder_view_is_written_to_the_dense_config_and_the_model_reads_it():
    config = TaskMoEConfig(dense_config=BertConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                                   intermediate_size=32, vocab_size=60), tasks=ENCODER_TASKS)
    config.layer_norm_eps = 0.5
    config.vocab_size = 70
    assert (config.dense_config.layer_norm_eps, config.dense_config.vocab_size) == (0.5, 70)
    model = TaskMoEForMultiTask(config)
    assert model.get_input_embeddings().num_embeddings == 70
    assert all(m.eps == 0.5 for m in model.modules() if isinstance(m, torch.nn.LayerNorm))


def test_a_view_under_the_architectures_own_name_and_a_derived_property():
    config = TaskRoutedLMConfig(dense_config=GPT2Config(n_embd=16, n_layer=2, n_head=2, vocab_size=60,
                                                        bos_token_id=1, eos_token_id=2),
                                tasks=[TaskSpec(name="x", problem_type="seq2seq")])
    config.hidden_size = 32
    assert config.dense_config.n_embd == 32 and config.hidden_size == 32
    with pytest.raises(AttributeError, match="router_std"):
        config.router_std = 3.0
