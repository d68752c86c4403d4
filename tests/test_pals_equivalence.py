"""PALs keeps the numbers of the BERT-only implementation it replaced (issue 45): `tests/fixtures/pals_reference/` holds
a tiny PALs model on BERT, its weights those that implementation saved (re-saved in today's layout when the conversion
of that layout was dropped, issue 58), a fixed batch, the logits that implementation gave on it, and one training step
it took (loss, each task's loss and every parameter's gradient, dropout 0). Today's model must give the same,
to 1e-6."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModel

from hf_taskmoe import BertWithPALs, PALsForMultiTask

REFERENCE = Path(__file__).parent / "fixtures" / "pals_reference"
# not bit for bit: loaded tensors sit at other memory alignments than freshly built ones, and CPU kernels round
# differently on them
ATOL = 1e-6


def reference() -> tuple[dict, dict, dict]:
    tensors = load_file(REFERENCE / "outputs.safetensors")
    batch = {k[len("input."):]: v for k, v in tensors.items() if k.startswith("input.")}
    logits = {k[len("logits."):]: v for k, v in tensors.items() if k.startswith("logits.")}
    step = {k[len("step."):]: v for k, v in tensors.items() if k.startswith("step.")}
    return batch, logits, step


@pytest.mark.parametrize("load", [AutoModel.from_pretrained, PALsForMultiTask.from_pretrained,
                                  BertWithPALs.from_pretrained], ids=["AutoModel", "PALsForMultiTask", "BertWithPALs"])
def test_pals_gives_the_logits_of_the_bert_only_implementation(load):
    model, info = load(REFERENCE, output_loading_info=True)
    assert not any(info.values()), info  # nothing missing, unexpected or mismatched
    assert isinstance(model, PALsForMultiTask)
    batch, expected, _ = reference()
    with torch.no_grad():
        out = model.eval()(**batch)
    assert set(out.task_logits) == set(expected)
    for task, logits in expected.items():
        torch.testing.assert_close(out.task_logits[task], logits, atol=ATOL, rtol=0)


def test_pals_takes_the_training_step_of_the_bert_only_implementation():
    model = AutoModel.from_pretrained(REFERENCE).train()
    batch, _, step = reference()
    out = model(**batch, labels=step["labels"])
    out.loss.backward()
    torch.testing.assert_close(out.loss.detach(), step["loss"], atol=ATOL, rtol=0)
    losses = {k[len("task_loss."):]: v for k, v in step.items() if k.startswith("task_loss.")}
    assert set(out.task_losses) == set(losses)
    for task, loss in losses.items():
        torch.testing.assert_close(out.task_losses[task].detach(), loss, atol=ATOL, rtol=0)
    expected = {k[len("grad."):]: v for k, v in step.items() if k.startswith("grad.")}
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert set(got) == set(expected)
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, atol=ATOL, rtol=0, msg=lambda m, name=name: f"{name}: {m}")


def test_the_comparison_sees_a_changed_weight():
    """The reference is tight enough to catch a wrong number: one PAL weight nudged changes the logits beyond it."""
    model = AutoModel.from_pretrained(REFERENCE).eval()
    batch, expected, _ = reference()
    name = next(n for n, _ in model.named_parameters() if n.startswith("pals."))
    with torch.no_grad():
        model.get_parameter(name).add_(1e-2)
        out = model(**batch)
    assert any(not torch.allclose(out.task_logits[t], v, atol=ATOL, rtol=0) for t, v in expected.items())
