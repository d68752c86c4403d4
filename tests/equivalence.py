"""Two implementations of one method on the same weights (issue 45: a BERT-specific class and its backbone-generic
twin): a key map from one state dict to the other, the weights moved through it, and the comparison of what both
compute -- in evaluation (logits, per-task losses) and in one training step (the loss and the gradient of every
mapped parameter).

A key map is a list of `(regex, replacement)` pairs applied in order to each name (`re.sub`), so a map reads as the
difference between the two layouts."""

from __future__ import annotations

import re

import torch

KeyMap = list[tuple[str, str]]

#: `BertWithPALs` -> `PALsForMultiTask`: the same names
PALS_KEYS: KeyMap = []


def renamed(name: str, keys: KeyMap) -> str:
    for pattern, replacement in keys:
        name = re.sub(pattern, replacement, name)
    return name


def load_mapped(model: torch.nn.Module, reference: torch.nn.Module, keys: KeyMap,
                may_miss: str | None = None) -> dict[str, str]:
    """Load `reference`'s state dict into `model` through `keys`: nothing left over, nothing missing (but names
    matching `may_miss`: buffers one layout keeps and the other does not). Returns the map of parameter names,
    reference -> model."""
    state = {renamed(k, keys): v for k, v in reference.state_dict().items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected, unexpected
    assert all(may_miss and re.search(may_miss, k) for k in missing), missing
    names = {name: renamed(name, keys) for name, _ in reference.named_parameters()}
    # the map is one to one over the parameters: no two reference weights land on one weight of the model
    assert sorted(names.values()) == sorted(n for n, _ in model.named_parameters()), "parameters not one to one"
    return names


@torch.no_grad()
def perturb(model: torch.nn.Module, seed: int = 1, scale: float = 0.1) -> torch.nn.Module:
    """Add N(0, scale^2) to every parameter: the zero-started modules (gates, FiLMs, PAL decoders, bottlenecks) then
    do something, and experts differ, so agreement is not an accident of the initialisation. `scale` 0.1 keeps the
    activations of a tiny model near 1 (float32 noise ~1e-7); larger values blow them up."""
    g = torch.Generator().manual_seed(seed)
    for param in model.parameters():
        param.add_(torch.randn(param.shape, generator=g) * scale)
    return model


def close(got, expected, what: str, atol: float = 1e-6, rtol: float = 1e-6) -> None:
    torch.testing.assert_close(got, expected, atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")


def assert_same_eval(reference, model, batch: dict, fields=(), atol: float = 1e-6) -> None:
    """Evaluation mode, no gradient: the last hidden states, each task's logits and loss, the loss, and `fields`
    (other output fields, compared as they are)."""
    reference.eval(), model.eval()
    with torch.no_grad():
        expected = reference(**batch, output_hidden_states=True)
        got = model(**batch, output_hidden_states=True)
    close(got.hidden_states[-1], expected.hidden_states[-1], "last hidden states", atol)
    assert set(got.task_logits) == set(expected.task_logits)
    for task, logits in expected.task_logits.items():
        close(got.task_logits[task], logits, f"logits of {task!r}", atol)
    if "labels" in batch:
        assert set(got.task_losses) == set(expected.task_losses)
        for task, loss in expected.task_losses.items():
            close(got.task_losses[task], loss, f"loss of {task!r}", atol)
        close(got.loss, expected.loss, "loss", atol)
    for field in fields:
        close(getattr(got, field), getattr(expected, field), field, atol)


def assert_same_training_step(reference, model, batch: dict, names: dict[str, str], atol: float = 1e-6) -> None:
    """Training mode (the callers build both with dropout 0): the same loss and per-task losses, and for every
    parameter of `reference` the same `requires_grad` and the same gradient as its image in `model` (`names`:
    `load_mapped`'s map); at least one gradient is not zero."""
    reference.train(), model.train()
    reference.zero_grad(set_to_none=True), model.zero_grad(set_to_none=True)
    expected, got = reference(**batch), model(**batch)
    close(got.loss, expected.loss, "training loss", atol)
    for task, loss in expected.task_losses.items():
        close(got.task_losses[task], loss, f"training loss of {task!r}", atol)
    expected.loss.backward()
    got.loss.backward()
    params = dict(model.named_parameters())
    moved = 0
    for name, param in reference.named_parameters():
        twin = params[names[name]]
        assert param.requires_grad == twin.requires_grad, f"{name}: requires_grad differs"
        if param.grad is None or twin.grad is None:  # frozen, or a head / expert without rows in this batch
            assert _zero(param.grad) and _zero(twin.grad), name
            continue
        close(twin.grad, param.grad, f"gradient of {name}", atol)
        moved += bool(param.grad.abs().sum() > 0)
    assert moved, "no gradient reached any parameter"


def _zero(grad) -> bool:
    return grad is None or not grad.abs().sum()
