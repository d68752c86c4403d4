"""Pre-computed task representations for `BartTaskRouted.set_task_embeddings` (Ye et al. 2022, section 5.1 (i)-(k),
appendix A.1).

- `text_task_embeddings`: TextEmb, the mean over a task's training inputs of the last encoder layer's states,
  mean-pooled over real tokens (`"avg"`) or at the first token (`"bos"`). Pass a model fine-tuned on each task
  (`finetune_steps > 0` does it here on a copy) for FT-TextEmb.
- `fisher_task_embeddings`: TaskEmb, the diagonal empirical Fisher information of a parameter-efficient probe
  trained on the task (eq. 3), over the probe's parameters only, reduced by PCA. The paper's probe is a Houlsby
  adapter; peft has no Houlsby adapter for BART, so the probe here is LoRA (peft) on the attention projections.

Inputs are `{task: [(source text, target text), ...]}` in the model's task order.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence

import torch


def _batches(pairs: Sequence[tuple[str, str]], tokenizer, batch_size: int, max_length: int, device):
    for start in range(0, len(pairs), batch_size):
        chunk = pairs[start : start + batch_size]
        enc = tokenizer(
            [s for s, _ in chunk],
            text_target=[t for _, t in chunk],
            truncation=True,
            max_length=max_length,
            padding=True,
            return_tensors="pt",
            return_token_type_ids=False,
        )
        enc["labels"] = enc["labels"].masked_fill(enc["labels"] == tokenizer.pad_token_id, -100)
        yield {k: v.to(device) for k, v in enc.items()}


def _finetune(model, pairs, tokenizer, steps: int, learning_rate: float, batch_size: int, max_length: int, seed: int):
    """A few AdamW steps of `model` (in place) on `(source, target)` pairs, cycling through them."""
    generator = torch.Generator().manual_seed(seed)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=learning_rate)
    model.train()
    order = torch.randperm(len(pairs), generator=generator).tolist()
    batches = list(_batches([pairs[i] for i in order], tokenizer, batch_size, max_length, model.device))
    for step in range(steps):
        loss = model(**batches[step % len(batches)]).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()


def _check(tasks: Mapping[str, Sequence[tuple[str, str]]]) -> None:
    if not tasks:
        raise ValueError("Pass at least one task: {task: [(source, target), ...]}.")
    for name, pairs in tasks.items():
        if not pairs:
            raise ValueError(f"Task {name!r} has no examples.")


@torch.no_grad()
def _pooled(model, tokenizer, pairs, pooling: str, batch_size: int, max_length: int) -> torch.Tensor:
    total, count = None, 0
    encoder = model.get_encoder()
    for batch in _batches(pairs, tokenizer, batch_size, max_length, model.device):
        states = encoder(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
        if pooling == "avg":  # mean over real tokens, then over examples
            mask = batch["attention_mask"].unsqueeze(-1).to(states.dtype)
            rows = (states * mask).sum(1) / mask.sum(1).clamp_min(1)
        else:  # the first token (BART's <s>, BERT's [CLS])
            rows = states[:, 0]
        total = rows.sum(0) if total is None else total + rows.sum(0)
        count += rows.shape[0]
    return total / count


def text_task_embeddings(
    model, tokenizer, tasks: Mapping[str, Sequence[tuple[str, str]]], pooling: str = "avg", finetune_steps: int = 0,
    learning_rate: float = 5e-5, batch_size: int = 16, max_length: int = 128, seed: int = 0,
) -> torch.Tensor:
    """TextEmb (`finetune_steps=0`) or FT-TextEmb (`finetune_steps > 0`: a copy of `model` is fine-tuned on each
    task first): `(tasks, d_model)`, in the order of `tasks`. `model`: a seq2seq model (a plain BART)."""
    if pooling not in ("avg", "bos"):
        raise ValueError(f"`pooling` must be 'avg' or 'bos', got {pooling!r}.")
    _check(tasks)
    rows = []
    for pairs in tasks.values():
        probe = model
        if finetune_steps:
            probe = copy.deepcopy(model)
            _finetune(probe, list(pairs), tokenizer, finetune_steps, learning_rate, batch_size, max_length, seed)
        probe.eval()
        rows.append(_pooled(probe, tokenizer, list(pairs), pooling, batch_size, max_length))
    return torch.stack(rows).float().cpu()


def fisher_task_embeddings(
    model, tokenizer, tasks: Mapping[str, Sequence[tuple[str, str]]], dim: int, probe_steps: int = 100,
    learning_rate: float = 1e-3, lora_rank: int = 8, target_modules: Sequence[str] = ("q_proj", "v_proj"),
    batch_size: int = 16, max_length: int = 128, seed: int = 0,
) -> torch.Tensor:
    """TaskEmb (appendix A.1): per task, train a LoRA probe on a copy of `model` (`probe_steps` steps), then the
    diagonal of the empirical Fisher `F = 1/n sum_i (d log p(y_i|x_i) / d alpha)^2` over the probe's parameters
    `alpha` (log-likelihood averaged over target tokens); the tasks' Fisher vectors are reduced to `dim`
    dimensions by PCA (centred, as sklearn). PCA gives at most `tasks` components: columns past that are 0.
    Returns `(tasks, dim)`."""
    from peft import LoraConfig, get_peft_model

    _check(tasks)
    fishers = []
    for pairs in tasks.values():
        torch.manual_seed(seed)
        probe = get_peft_model(copy.deepcopy(model), LoraConfig(r=lora_rank, lora_alpha=2 * lora_rank,
                                                                 target_modules=list(target_modules), lora_dropout=0.0))
        pairs = list(pairs)
        if probe_steps:
            _finetune(probe, pairs, tokenizer, probe_steps, learning_rate, batch_size, max_length, seed)
        params = [p for p in probe.parameters() if p.requires_grad]
        fisher = [torch.zeros_like(p) for p in params]
        probe.eval()
        for batch in _batches(
            pairs, tokenizer, 1, max_length, probe.device
        ):  # one example at a time: per-example gradients
            log_likelihood = -probe(**batch).loss  # mean token log-likelihood of y_i given x_i
            grads = torch.autograd.grad(log_likelihood, params)
            for f, g in zip(fisher, grads):
                f.add_(g.detach() ** 2)
        fishers.append(torch.cat([f.flatten() for f in fisher]) / len(pairs))
    stacked = torch.stack(fishers).double()  # (tasks, probe parameters)
    centred = stacked - stacked.mean(0, keepdim=True)
    _, _, v = torch.linalg.svd(centred, full_matrices=False)
    components = min(dim, v.shape[0])
    embeddings = torch.zeros(len(fishers), dim, dtype=torch.float64)
    embeddings[:, :components] = centred @ v[:components].T
    return embeddings.float()
