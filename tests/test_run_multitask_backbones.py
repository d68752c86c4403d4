"""`run_multitask.py --model_family <method> --model_name_or_path <a dense checkpoint of any declared encoder>`: the
script takes the method from the first and the backbone from the second. For every declared encoder architecture and
each of MT-TaG, PALs and CA-MTL, a tiny random checkpoint saved with a WordPiece tokenizer beside it trains two steps,
evaluates, saves, and the result loads with `AutoModel`."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModel

from hf_taskmoe.models import family_of, get_family

from .backbone_matrix import ENCODER_ARCHS, ENCODER_CONFIGS

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
import run_multitask  # noqa: E402

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json")
#: MiniLM's WordPiece vocabulary: the checkpoints' tables must hold its ids ([PAD] 0, [CLS] 101, [SEP] 102)
WORDPIECE = dict(vocab_size=30522)
SPECIAL = dict(pad_token_id=0, bos_token_id=101, eos_token_id=102, cls_token_id=101, sep_token_id=102,
               mask_token_id=103)
#: the script's method names (`--model_family`) and the class each builds on a non-BERT checkpoint
METHODS = {"bert_taskmoe": "TaskMoEForMultiTask", "bert_pals": "PALsForMultiTask", "camtl": "CAMTLForMultiTask"}


@pytest.fixture(scope="module", params=ENCODER_ARCHS)
def dense_checkpoint(request, tmp_path_factory, minilm):
    arch = request.param
    config = ENCODER_CONFIGS[arch]()
    for name, value in WORDPIECE.items():
        setattr(config, name, value)
    if arch == "modernbert":
        for name, value in SPECIAL.items():
            setattr(config, name, value)
    folder = tmp_path_factory.mktemp(arch)
    torch.manual_seed(0)
    from transformers import AutoModel as Auto

    Auto.from_config(config).save_pretrained(folder)
    for name in TOKENIZER_FILES:
        shutil.copy(minilm / name, folder / name)
    return arch, folder


@pytest.mark.parametrize("method", list(METHODS))
def test_the_script_builds_each_method_on_each_encoder(tmp_path, dense_checkpoint, method):
    arch, folder = dense_checkpoint
    out = tmp_path / "out"
    extra = []
    if method == "camtl" and arch == "deberta-v2":  # no seam for an additive attention bias: refused by name
        extra = ["--conditional_attention", "false"]
    metrics = run_multitask.main([
        "--model_family", method, "--model_name_or_path", str(folder), "--output_dir", str(out), "--do_train",
        "--do_eval", "--max_steps", "2", "--per_device_train_batch_size", "4", "--max_train_samples", "8",
        "--max_eval_samples", "4", "--max_seq_length", "24", "--use_cpu", "--report_to", "none",
        "--save_strategy", "no", "--disable_tqdm", "true", *extra,
    ])
    assert any(k.startswith("eval_") and k.endswith("_loss") for k in metrics)
    model = AutoModel.from_pretrained(out)
    expected = METHODS[method] if arch != "bert" else type(model).__name__
    assert type(model).__name__ == expected
    family = family_of(model.config)
    assert family.method == get_family(method).method
    card = (out / "README.md").read_text()
    if arch != "bert":  # the card's method line names the backbone (a local checkpoint has no repo id for base_model)
        assert model.config.dense_config.model_type == arch and f"on a {arch} encoder" in card


def test_an_unsupported_model_type_is_refused_listing_the_supported_ones(tmp_path, capsys):
    from transformers import GPT2Config, GPT2Model

    folder = tmp_path / "gpt2"
    GPT2Model(GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=100)).save_pretrained(folder)
    code = run_multitask.cli(["--model_family", "bert_taskmoe", "--model_name_or_path", str(folder), "--output_dir",
                              str(tmp_path / "out"), "--do_train", "--use_cpu", "--report_to", "none"])
    assert code == 2
    err = capsys.readouterr().err
    assert "cannot be built from a 'gpt2' checkpoint" in err and "'roberta'" in err and "'modernbert'" in err
