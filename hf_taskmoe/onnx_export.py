"""Export a model for serving: `torch.export` (`export_program`) and ONNX (`export_onnx`), with a dynamic batch size
(and sequence length), one program for every task mix. What the program computes depends on the model:

- A task-level encoder model (`BertForTaskMoE`, `BertWithPALs`, `CAMTLModel`, and the backbone-generic
  `TaskMoEForMultiTask`, `PALsForMultiTask`, `CAMTLForMultiTask` on any declared encoder): `ServingLogits`,
  `(input_ids, attention_mask, task_ids[, token_type_ids]) -> logits (batch, max_width)`, each row's logits from its
  own task's head, in batch order, zeros beyond the task's own width (`task_widths(model)[task]`). `token_type_ids`
  is an input only where the architecture has a segment table (`config.type_vocab_size`; not DistilBERT, not
  ModernBERT). Under export the model's forward has no shape that depends on the values of the batch: every head
  runs on every row and each row takes its task's logits (`MultiTaskHeads.every_row_logits`), the experts of MT-TaG
  run as a masked dense mixture (each token weighted by its gate for the experts it chose, 0 for the others), and
  PALs gather each row's group weights (`ProjectedAttentionLayers.forward` with per-row group ids).
- `MMoEModel` (tabular): `(numeric_features, categorical_features) -> logits (batch, sum of task widths)`, every
  task's logits side by side in task order (`MMoEOutput.logits`; `task_widths(model)` columns each); an input only
  where the config has such features.
- `BartTaskRouted`: two programs, `part="encoder"`, `(input_ids, attention_mask, task_ids) -> encoder_hidden_states`,
  and `part="decoder_step"`, `(decoder_input_ids, encoder_hidden_states, attention_mask, task_ids) -> logits
  (batch, vocab)`, the next token's logits after the given decoder inputs (no key/value cache: each step reads the
  whole prefix). Under export every expert of a routed layer runs on every row, weighted by the row's decisions
  (0 for an expert its route does not use; `hf_taskmoe.layers.routing.plan_routes`).

The values a program cannot check (task ids in range, category codes, finite features) must be checked where the
batch is made (`hf_taskmoe.training.batches.BatchChecker` for the encoder families).

Serve several tasks in one batch with onnxruntime::

    path = export_onnx(model, "model.onnx")
    session = onnxruntime.InferenceSession(path)
    feed = {"input_ids": ..., "attention_mask": ..., "task_ids": ..., "token_type_ids": ...}  # int64 arrays
    logits = session.run(["logits"], feed)[0]
    row_logits = logits[i, : task_widths(model)[task_ids[i]]]
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from pathlib import Path
from typing import NamedTuple

import torch
from torch import nn

#: the text program's input names, in order (`token_type_ids` only when exported with them)
INPUT_NAMES = ("input_ids", "attention_mask", "task_ids", "token_type_ids")
#: the programs (`part=`) of a model whose family exports it as an encoder and a decoding step
#: (`Family.export_kind == "encoder_decoder"`: `BartTaskRouted`)
SEQ2SEQ_PARTS = ("encoder", "decoder_step")


class ServingLogits(nn.Module):
    """A task-level encoder model (`BertForTaskMoE`, `BertWithPALs`, `CAMTLModel`, `TaskMoEForMultiTask`,
    `PALsForMultiTask`, `CAMTLForMultiTask`) as the exported programs see it: `(input_ids, attention_mask, task_ids[,
    token_type_ids]) -> logits (batch, max_width)`, each row its own task's logits padded with zeros (widths:
    `task_widths`). Calls the model's forward with `values_checked=True`."""

    def __init__(self, model: nn.Module):
        super().__init__()
        heads = getattr(model, "heads", None)
        if heads is None or not hasattr(heads, "check_exportable"):
            raise ValueError(
                f"export_onnx / export_program take a task-level encoder model with per-task heads (BertForTaskMoE, "
                f"BertWithPALs, CAMTLModel, TaskMoEForMultiTask, PALsForMultiTask, CAMTLForMultiTask), an MMoEModel "
                f"or a BartTaskRouted (with part='encoder' or 'decoder_step'), got {type(model).__name__}."
                + (" Export one task's route as a plain model of the dense class (`model.export_task(task)`) and serve "
                   "it with transformers' own export path (torch.export / ONNX of a causal LM or T5)."
                   if hasattr(model, "export_task") else "")
            )
        heads.check_exportable()
        self.model = model

    def forward(self, input_ids, attention_mask, task_ids, token_type_ids=None):
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids,
                         task_ids=task_ids, values_checked=True, return_dict=True)
        return out.logits  # (batch, max_width)


class _Wrapper(nn.Module):
    """A program's module: the model, called as the program's inputs say."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model


class _TabularLogits(_Wrapper):
    """`MMoEModel` as its program sees it: its feature tensors (those the config has, numeric first) -> every task's
    logits side by side, `(batch, sum of task widths)`."""

    def forward(self, *features):
        out = self.model(**dict(zip(_tabular_inputs(self.model), features)), values_checked=True, return_dict=True)
        return out.logits


class _RoutedEncoder(_Wrapper):
    """A `BartTaskRouted`'s encoder with its task routes: `(input_ids, attention_mask, task_ids) ->
    encoder_hidden_states (batch, seq, d_model)`."""

    def forward(self, input_ids, attention_mask, task_ids):
        encoder = self.model.get_encoder()
        return encoder(input_ids=input_ids, attention_mask=attention_mask, task_ids=task_ids, values_checked=True,
                       return_dict=True).last_hidden_state


class _DecoderStep(_Wrapper):
    """One decoding step of a `BartTaskRouted` without a cache: `(decoder_input_ids, encoder_hidden_states,
    attention_mask, task_ids) -> logits (batch, vocab)` of the token after the given decoder inputs."""

    def forward(self, decoder_input_ids, encoder_hidden_states, attention_mask, task_ids):
        out = self.model(encoder_outputs=(encoder_hidden_states,), attention_mask=attention_mask,
                         decoder_input_ids=decoder_input_ids, task_ids=task_ids, use_cache=False,
                         values_checked=True, return_dict=True)
        return out.logits[:, -1]


class _Program(NamedTuple):
    module: nn.Module
    inputs: tuple[torch.Tensor, ...]
    shapes: tuple[dict, ...]
    input_names: list[str]
    output_names: list[str]


def task_widths(model) -> list[int]:
    """How many logits of the exported program's row belong to each task (task id order): for an encoder family the
    first `task_widths(model)[task]` of the row's task (the rest is padding); for an `MMoEModel` the columns of each
    task, side by side in task order."""
    if _export_kind(model) == "tabular":
        return list(model.config.task_output_sizes)
    return model.heads.logit_widths()


def example_inputs(model, batch: int = 3, seq: int = 8, token_type_ids: bool | None = None) -> tuple[torch.Tensor, ...]:
    """A batch to trace a task-level encoder model with: every task present, one row padded. Sizes of at least 2
    (torch.export specialises a dimension traced at size 0 or 1). `token_type_ids` defaults to whether the model has
    a segment table."""
    token_type_ids = _segments(model, token_type_ids)
    limit = _max_length(model)
    seq = max(2, min(seq, limit))
    batch = max(2, batch)
    inputs = _text_batch(torch.Generator().manual_seed(0), 1, model.get_input_embeddings().num_embeddings, batch, seq,
                         len(model.config.task_names))
    if token_type_ids:
        inputs += (torch.zeros(batch, seq, dtype=torch.long),)
    return tuple(t.to(model.device) for t in inputs)


def _text_batch(g: torch.Generator, low: int, vocab: int, batch: int, seq: int, num_tasks: int):
    """`(input_ids, attention_mask, task_ids)` of a traced batch: random ids from `low`, the first row padded at its
    end, the tasks in turn."""
    attention_mask = torch.ones(batch, seq, dtype=torch.long)
    attention_mask[0, -1] = 0
    return torch.randint(low, vocab, (batch, seq), generator=g), attention_mask, torch.arange(batch) % num_tasks


def dynamic_shapes(model, token_type_ids: bool | None = None, max_length: int | None = None) -> tuple[dict, ...]:
    """`torch.export` dynamic shapes of `ServingLogits`'s inputs: a batch of any size, up to `max_length` tokens
    (default: the longest input the model takes)."""
    token_type_ids = _segments(model, token_type_ids)
    batch = torch.export.Dim("batch", min=1)
    seq = torch.export.Dim("seq", min=1, max=max_length or _max_length(model))
    shapes = ({0: batch, 1: seq}, {0: batch, 1: seq}, {0: batch})
    return shapes + (({0: batch, 1: seq},) if token_type_ids else ())


def export_program(
    model, token_type_ids: bool | None = None, max_length: int | None = None, part: str | None = None
) -> torch.export.ExportedProgram:
    """`torch.export.export` of the model's serving program (the module docstring says which, per model kind) in eval
    mode, with a dynamic batch size and sequence length; `program.module()(*inputs)` gives what `export_onnx`'s
    file gives, e.g. `program.module()(input_ids, attention_mask, task_ids[, token_type_ids])` the padded logits of
    an encoder family. `token_type_ids` defaults to whether the model has a segment table; `part` names a
    `BartTaskRouted`'s program (`"encoder"` or `"decoder_step"`)."""
    with _eval(model):
        spec = _program(model, token_type_ids, max_length, part)
        spec.module.eval()
        return torch.export.export(spec.module, spec.inputs, dynamic_shapes=spec.shapes)


def export_onnx(
    model,
    path: str | os.PathLike,
    token_type_ids: bool | None = None,
    max_length: int | None = None,
    opset_version: int | None = None,
    part: str | None = None,
) -> Path:
    """Export a model to ONNX (`torch.onnx.export(..., dynamo=True)`) and return the file's path.

    A task-level encoder model (`BertForTaskMoE`, `BertWithPALs`, `CAMTLModel`, `TaskMoEForMultiTask`,
    `PALsForMultiTask`, `CAMTLForMultiTask`): the program's inputs are `input_ids`, `attention_mask`, `task_ids`
    (int64, `(batch, seq)` / `(batch,)`) and, where the model has a segment table (`config.type_vocab_size`; the
    default of `token_type_ids=None`), `token_type_ids`; its output `logits` `(batch, max_width)` holds each row's
    own task's logits, padded with zeros beyond `task_widths(model)[task]`. Batch size and sequence length (up to
    `max_length`, default the model's limit) are dynamic, and a batch may mix tasks in any proportion.
    `token_type_ids=True` on a model without a segment table is refused (the program would ignore the input).

    An `MMoEModel`: inputs `numeric_features` (float, `(batch, features)`) and `categorical_features` (int64
    codes), each where the config has such features; output `logits`, every task's side by side (`task_widths`).

    A `BartTaskRouted`, one program per call: `part="encoder"` (inputs `input_ids`, `attention_mask`, `task_ids`;
    output `encoder_hidden_states`) or `part="decoder_step"` (inputs `decoder_input_ids`, `encoder_hidden_states`,
    `attention_mask`, `task_ids`; output `logits` `(batch, vocab)`, the next token's, without a key/value cache).

    The attention is exported in its eager form (the exporter cannot decompose transformers' SDPA call with a dynamic
    length); the model is left as it was. Needs `pip install hf_taskmoe[export]` (onnx, onnxscript; onnxruntime to
    run the file).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with _eval(model), _eager_attention(model), _quiet_exporter():
        spec = _program(model, token_type_ids, max_length, part)
        spec.module.eval()  # the wrapper too: the exporter reads its own flag (a fresh module's is training mode)
        program = torch.onnx.export(
            spec.module, spec.inputs, dynamic_shapes=spec.shapes, input_names=spec.input_names,
            output_names=spec.output_names, opset_version=opset_version, dynamo=True, verbose=False,
        )
        program.save(str(path))
    return path


def _program(model, token_type_ids, max_length, part) -> _Program:
    """The module to export, its example inputs, their dynamic shapes and the program's input and output names."""
    kind = _export_kind(model)
    name = type(model).__name__
    if kind == "encoder_decoder":
        if part not in SEQ2SEQ_PARTS:
            raise ValueError(
                f"A {name} exports as two programs: pass part='encoder' (input_ids, attention_mask, task_ids -> "
                f"encoder_hidden_states) or part='decoder_step' (decoder_input_ids, encoder_hidden_states, "
                f"attention_mask, task_ids -> the next token's logits), got part={part!r}."
            )
    elif part is not None:
        raise ValueError(f"`part` names a program of an encoder-decoder model (BartTaskRouted); a {name} exports as "
                         "one program (part=None).")
    if kind != "text" and token_type_ids:
        raise ValueError(f"A {name} takes no `token_type_ids`: leave `token_type_ids` unset.")
    if kind == "tabular":
        if max_length is not None:
            raise ValueError(f"An {name} takes rows of features, not token sequences: leave `max_length` unset.")
        return _tabular_program(model)
    if kind == "encoder_decoder":
        return _seq2seq_program(model, part, max_length)
    token_type_ids = _segments(model, token_type_ids)
    names = list(INPUT_NAMES if token_type_ids else INPUT_NAMES[:3])
    return _Program(ServingLogits(model), example_inputs(model, token_type_ids=token_type_ids),
                    dynamic_shapes(model, token_type_ids, max_length), names, ["logits"])


def _tabular_program(model) -> _Program:
    config, names = model.config, _tabular_inputs(model)
    g = torch.Generator().manual_seed(0)
    batch = 3
    inputs = []
    if "numeric_features" in names:
        inputs.append(torch.randn(batch, len(config.numeric_features), generator=g).to(model.dtype))
    if "categorical_features" in names:
        inputs.append(torch.stack(
            [torch.randint(0, card, (batch,), generator=g) for card in config.categorical_cardinalities], dim=1
        ))
    rows = torch.export.Dim("batch", min=1)
    return _Program(_TabularLogits(model), tuple(t.to(model.device) for t in inputs),
                    (tuple({0: rows} for _ in inputs),), names, ["logits"])  # one entry: `*features`


def _seq2seq_program(model, part: str, max_length: int | None) -> _Program:
    config = model.config
    # T5 has no position table: its programs take any length up to `max_length` (default 512)
    limit = max_length or config.max_position_embeddings or 512
    g = torch.Generator().manual_seed(0)
    batch, seq, steps = 3, min(8, limit), min(3, limit)
    input_ids, attention_mask, task_ids = _text_batch(g, 4, config.vocab_size, batch, seq, config.num_tasks)
    rows = torch.export.Dim("batch", min=1)
    length = torch.export.Dim("seq", min=1, max=limit)
    per_token = {0: rows, 1: length}
    if part == "encoder":
        inputs = (input_ids, attention_mask, task_ids)
        shapes = (per_token, per_token, {0: rows})
        module, names, outputs = _RoutedEncoder(model), ["input_ids", "attention_mask", "task_ids"], [
            "encoder_hidden_states"]
    else:
        decoder_input_ids = torch.randint(4, config.vocab_size, (batch, steps), generator=g)
        decoder_input_ids[:, 0] = config.dense_config.decoder_start_token_id
        hidden = torch.randn(batch, seq, config.hidden_size, generator=g).to(model.dtype)
        inputs = (decoder_input_ids, hidden, attention_mask, task_ids)
        target = torch.export.Dim("decoder_seq", min=1, max=config.max_position_embeddings or limit)
        shapes = ({0: rows, 1: target}, per_token, per_token, {0: rows})
        module, outputs = _DecoderStep(model), ["logits"]
        names = ["decoder_input_ids", "encoder_hidden_states", "attention_mask", "task_ids"]
    return _Program(module, tuple(t.to(model.device) for t in inputs), shapes, names, outputs)


def _export_kind(model) -> str:
    """What its family says the model exports as (`Family.export_kind`); a model of no registered family is taken
    as a text model (`ServingLogits` then says what it accepts)."""
    from .models.registry import family_of

    try:
        return family_of(model).export_kind
    except ValueError:
        return "text"


def _tabular_inputs(model) -> list[str]:
    config = model.config
    return [name for name in ("numeric_features", "categorical_features") if getattr(config, name)]


def _segments(model, token_type_ids: bool | None) -> bool:
    """Whether the program takes `token_type_ids`: by default where the model has a segment table."""
    has_table = bool(getattr(model.config, "type_vocab_size", None))
    if token_type_ids is None:
        return has_table
    if token_type_ids and not has_table:
        dense = getattr(model.config, "dense_config", None)
        arch = f" on {dense.model_type}" if dense is not None else ""
        raise ValueError(
            f"This {type(model).__name__}{arch} has no segment table (config.type_vocab_size is None): segment ids "
            "would have nowhere to go, so its program takes input_ids, attention_mask and task_ids only. Leave "
            "`token_type_ids` unset (or False)."
        )
    return bool(token_type_ids)


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


#: what torch's ONNX exporter says on every successful export of these models, none of it the user's to act on:
#: the torchvision ops it cannot register (no model here uses nms or roi_align), torch's own pytree deprecation
#: (LeafSpec, raised inside the exporter), and that an input's dynamic axis is named by the axis it shares (we give
#: every input the same `batch` and `seq` dims on purpose). Errors and any other warning still come through.
_EXPORTER_NOISE = (
    (FutureWarning, r".*`isinstance\(treespec, LeafSpec\)` is deprecated"),
    (UserWarning, r"# The axis name: \w+ will not be used, since it shares the same shape constraints"),
)
_EXPORTER_REGISTRATION_LOGGER = "torch.onnx._internal.exporter._registration"  # "torchvision is not installed"


@contextlib.contextmanager
def _quiet_exporter():
    """Silence `_EXPORTER_NOISE` and the exporter's registration warnings for one export."""
    registration = logging.getLogger(_EXPORTER_REGISTRATION_LOGGER)
    level = registration.level
    registration.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            for category, message in _EXPORTER_NOISE:
                warnings.filterwarnings("ignore", message=message, category=category)
            yield
    finally:
        registration.setLevel(level)


@contextlib.contextmanager
def _eager_attention(model):
    before = model.config._attn_implementation
    if _export_kind(model) == "tabular" or before == "eager":  # feature rows: no attention
        yield
        return
    model.set_attn_implementation("eager")
    try:
        yield
    finally:
        if before is not None:
            model.set_attn_implementation(before)
