"""Export an encoder family for serving: `torch.export` (`export_program`) and ONNX (`export_onnx`), with a dynamic
batch size and sequence length, one program for every task mix.

What the exported program computes (`ServingLogits`): each row's logits from its own task's head, in batch order,
`(batch, max_width)` with zeros beyond the task's own width (`task_widths(model)[task]`). Under export the model's
forward has no shape that depends on the values of the batch: every head runs on every row and each row takes its
task's logits (`MultiTaskHeads.every_row_logits`), the experts of MT-TaG run as a masked dense mixture (each token
weighted by its gate for the experts it chose, 0 for the others), and PALs gather each row's group weights
(`ProjectedAttentionLayers.forward` with per-row group ids). The values a program cannot check (task ids in range)
must be checked where the batch is made (`hf_taskmoe.modeling_utils.BatchChecker`).

Serve several tasks in one batch with onnxruntime::

    path = export_onnx(model, "model.onnx")
    session = onnxruntime.InferenceSession(path)
    feed = {"input_ids": ..., "attention_mask": ..., "task_ids": ..., "token_type_ids": ...}  # int64 arrays
    logits = session.run(["logits"], feed)[0]
    row_logits = logits[i, : task_widths(model)[task_ids[i]]]
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch
from torch import nn

#: the program's input names, in order (`token_type_ids` only when exported with them)
INPUT_NAMES = ("input_ids", "attention_mask", "task_ids", "token_type_ids")


class ServingLogits(nn.Module):
    """A task-level encoder model (`BertForTaskMoE`, `BertWithPALs`, `CAMTLModel`) as the exported programs see it:
    `(input_ids, attention_mask, task_ids[, token_type_ids]) -> logits (batch, max_width)`, each row its own task's
    logits padded with zeros (widths: `task_widths`). Calls the model's forward with `values_checked=True`."""

    def __init__(self, model: nn.Module):
        super().__init__()
        heads = getattr(model, "heads", None)
        if heads is None or not hasattr(heads, "check_exportable"):
            raise ValueError(
                f"export_onnx / export_program take a task-level encoder model with per-task heads (BertForTaskMoE, "
                f"BertWithPALs, CAMTLModel), got {type(model).__name__}."
            )
        heads.check_exportable()
        self.model = model

    def forward(self, input_ids, attention_mask, task_ids, token_type_ids=None):
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids,
                         task_ids=task_ids, values_checked=True, return_dict=True)
        return out.logits  # (batch, max_width)


def task_widths(model) -> list[int]:
    """How many logits of the exported program's row belong to each task (task id order); the rest is padding."""
    return model.heads.logit_widths()


def example_inputs(model, batch: int = 3, seq: int = 8, token_type_ids: bool = True) -> tuple[torch.Tensor, ...]:
    """A batch to trace with: every task present, one row padded. Sizes of at least 2 (torch.export specialises a
    dimension traced at size 0 or 1)."""
    limit = _max_length(model)
    seq = max(2, min(seq, limit))
    batch = max(2, batch)
    g = torch.Generator().manual_seed(0)
    vocab = model.get_input_embeddings().num_embeddings
    input_ids = torch.randint(1, vocab, (batch, seq), generator=g)
    attention_mask = torch.ones(batch, seq, dtype=torch.long)
    attention_mask[0, -1] = 0
    task_ids = torch.arange(batch) % len(model.config.task_names)
    inputs = (input_ids, attention_mask, task_ids)
    if token_type_ids:
        inputs += (torch.zeros(batch, seq, dtype=torch.long),)
    return tuple(t.to(model.device) for t in inputs)


def dynamic_shapes(model, token_type_ids: bool = True, max_length: int | None = None) -> tuple[dict, ...]:
    """`torch.export` dynamic shapes of `ServingLogits`'s inputs: a batch of any size, up to `max_length` tokens
    (default: the longest input the model takes)."""
    batch = torch.export.Dim("batch", min=1)
    seq = torch.export.Dim("seq", min=1, max=max_length or _max_length(model))
    shapes = ({0: batch, 1: seq}, {0: batch, 1: seq}, {0: batch})
    return shapes + (({0: batch, 1: seq},) if token_type_ids else ())


def export_program(model, token_type_ids: bool = True, max_length: int | None = None) -> torch.export.ExportedProgram:
    """`torch.export.export` of `ServingLogits(model)` in eval mode with a dynamic batch size and sequence length;
    `program.module()(input_ids, attention_mask, task_ids, token_type_ids)` gives the padded logits."""
    with _eval(model):
        return torch.export.export(
            ServingLogits(model), example_inputs(model, token_type_ids=token_type_ids),
            dynamic_shapes=dynamic_shapes(model, token_type_ids, max_length),
        )


def export_onnx(
    model,
    path: str | os.PathLike,
    token_type_ids: bool = True,
    max_length: int | None = None,
    opset_version: int | None = None,
) -> Path:
    """Export a task-level encoder model to ONNX (`torch.onnx.export(..., dynamo=True)`) and return the file's path.

    The program's inputs are `input_ids`, `attention_mask`, `task_ids` (int64, `(batch, seq)` / `(batch,)`) and, with
    `token_type_ids=True`, `token_type_ids`; its output `logits` `(batch, max_width)` holds each row's own task's
    logits, padded with zeros beyond `task_widths(model)[task]`. Batch size and sequence length (up to `max_length`,
    default the model's limit) are dynamic, and a batch may mix tasks in any proportion. The attention is exported
    in its eager form (the exporter cannot decompose transformers' SDPA call with a dynamic length); the model is
    left as it was. Needs `pip install hf_taskmoe[export]` (onnx, onnxscript; onnxruntime to run the file).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    names = list(INPUT_NAMES if token_type_ids else INPUT_NAMES[:3])
    with _eval(model), _eager_attention(model):
        program = torch.onnx.export(
            ServingLogits(model), example_inputs(model, token_type_ids=token_type_ids),
            dynamic_shapes=dynamic_shapes(model, token_type_ids, max_length), input_names=names,
            output_names=["logits"], opset_version=opset_version, dynamo=True, verbose=False,
        )
        program.save(str(path))
    return path


def _max_length(model) -> int:
    limit = model.max_input_length() if hasattr(model, "max_input_length") else None
    return int(limit or model.config.max_position_embeddings)


@contextlib.contextmanager
def _eval(model):
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


@contextlib.contextmanager
def _eager_attention(model):
    before = model.config._attn_implementation
    if before != "eager":
        model.set_attn_implementation("eager")
    try:
        yield
    finally:
        if before != "eager" and before is not None:
            model.set_attn_implementation(before)
