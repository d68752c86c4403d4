"""`from_pretrained(None, config=..., state_dict=...)`: no checkpoint on file, so nothing is refused; what the state
dict lacks is initialised by `_init_weights`, as in transformers (its `test_can_init_all_missing_weights` relies on
it). A checkpoint on file that lacks a weight is still refused (tests/family_tester.py)."""

from __future__ import annotations

import pytest
import torch
from transformers import BertConfig

from hf_taskmoe import TaskMoEConfig, TaskMoEForMultiTask, TaskSpec

TASKS = [TaskSpec(name="a", num_labels=3), TaskSpec(name="b", problem_type="regression")]


def _config():
    return TaskMoEConfig(dense_config=BertConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                                 intermediate_size=32, vocab_size=60), tasks=TASKS, num_experts=3)


def test_a_partial_state_dict_without_checkpoint_loads_and_initialises_the_rest():
    torch.manual_seed(0)
    model = TaskMoEForMultiTask(_config())
    full = model.state_dict()
    kept = {k: v for k, v in full.items() if not k.startswith("heads.")}
    loaded, info = TaskMoEForMultiTask.from_pretrained(None, config=_config(), state_dict=kept,
                                                       output_loading_info=True)
    assert {k for k in info["missing_keys"]} == set(full) - set(kept)
    got = loaded.state_dict()
    for name, tensor in kept.items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=0)
    heads = [n for n in got if n.startswith("heads.") and n.endswith("weight")]
    assert heads and all(torch.isfinite(got[n]).all() and got[n].abs().sum() > 0 for n in heads)


def test_a_checkpoint_on_file_lacking_a_weight_is_still_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    TaskMoEForMultiTask(_config()).save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    gone = sorted(k for k in tensors if k.startswith("heads."))[0]
    save_file({k: v for k, v in tensors.items() if k != gone}, tmp_path / "model.safetensors",
              metadata={"format": "pt"})
    with pytest.raises(ValueError, match="not on file"):
        TaskMoEForMultiTask.from_pretrained(tmp_path)
