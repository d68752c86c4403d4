"""`seq2seq`: a text-to-text task. The target is a text the decoder of a seq2seq family generates
(BartTaskRouted) or the continuation a causal LM generates after the input text (TaskRoutedForCausalLM); the loss is
token cross-entropy, the metrics compare decoded texts.

Two layouts of an example, declared by the model's config (`text_to_text_layout`, read by `text_to_text_layout()`):

- `"encoder-decoder"` (the default): `input_ids` = the input text, `labels` = the target's tokens (the decoder's);
- `"causal"` (a decoder-only LM): one sequence, `input_ids` = the input text (the prompt) then the target's tokens,
  `labels` = the same ids with -100 on the prompt, so the loss is taken on the continuation only. Without labels
  (prediction) the row is the prompt alone, what `generate` continues.
"""

from __future__ import annotations

import numpy as np

from ..utils import check_choice
from .base import IGNORE_INDEX, TEXT_TO_TEXT, ProblemType, as_text, register_problem_type

#: the layouts of a text-to-text example (module docstring)
ENCODER_DECODER_LAYOUT = "encoder-decoder"
CAUSAL_LAYOUT = "causal"
LAYOUTS = (ENCODER_DECODER_LAYOUT, CAUSAL_LAYOUT)


class Seq2Seq(ProblemType):
    name = "seq2seq"
    hub_pipeline_tag = "text2text-generation"
    default_metrics = ("exact_match",)
    capabilities = frozenset({TEXT_TO_TEXT})
    has_classes = False
    pipeline = "text2text"

    def resolve_num_labels(self, spec, prefix):
        from ..utils import check_int

        return None if spec.num_labels is None else check_int(spec.num_labels, f"{prefix}.num_labels", minimum=1)

    def encode_label(self, spec, value, where):
        if isinstance(value, (list, tuple, dict)):
            raise ValueError(f"{where}: the target (field {spec.label_field!r}) must be one text, got {value!r}.")
        value = as_text(value)  # as the file wrote it: true, 3, 2.5
        if not value.strip():
            raise ValueError(f"{where}: the target text (field {spec.label_field!r}) is empty.")
        return value

    def tokenize(self, spec, batch, labels, tokenizer, max_length, where, max_target_length: int = 64,
                 layout: str = ENCODER_DECODER_LAYOUT, **options):
        """`layout`: how the model reads an example (module docstring); `max_length` bounds the input text (the
        prompt), `max_target_length` the target, in both layouts."""
        check_choice(layout, LAYOUTS, "layout")
        # encoder-decoder inputs carry no segment ids, nor does a prompt + continuation
        out = self._encode_texts(spec, batch, tokenizer, max_length, return_token_type_ids=False)
        if labels is None:
            return out
        targets = target_token_ids(tokenizer, list(labels), max_target_length)
        if layout == ENCODER_DECODER_LAYOUT:
            out["labels"] = targets
            return out
        prompts = out["input_ids"]
        return {
            "input_ids": [p + t for p, t in zip(prompts, targets)],
            "attention_mask": [[1] * (len(p) + len(t)) for p, t in zip(prompts, targets)],
            "labels": [[IGNORE_INDEX] * len(p) + t for p, t in zip(prompts, targets)],
        }

    def compute_metrics(self, spec, logits, labels, run_metric, tokenizer=None, eos_token_id=None, **context):
        """Predicted target tokens (generated, without the decoder start token, or the teacher-forced arg-max)
        against the target ids, both decoded by `hf_taskmoe.metrics.decode_texts`."""
        from ..metrics import decode_texts

        if tokenizer is None:
            raise ValueError(
                f"Task {spec.name!r} is seq2seq: its metrics decode texts, so pass the tokenizer (processing_class)."
            )
        predictions = np.asarray(logits)
        if predictions.ndim == 3:  # logits
            predictions = predictions.argmax(-1)
        texts, references = (
            decode_texts(predictions, tokenizer, eos_token_id),
            decode_texts(labels, tokenizer, eos_token_id),
        )
        inputs = {"predictions": texts, "references": references}
        return {name: run_metric(name, inputs, None) for name in spec.metrics}

    def baseline_logits(self, spec, source_labels, num_rows):
        return None

    @staticmethod
    def check_target_ids(labels, vocab_size: int) -> None:
        """Target token ids must lie in the vocabulary (or be -100); a read of the values, done where the batch is
        checked."""
        bad = (labels != IGNORE_INDEX) & ((labels < 0) | (labels >= vocab_size))
        if bad.any():
            row = int(bad.nonzero()[0, 0])
            raise ValueError(
                f"`labels` row {row} holds token id {int(labels[bad][0])} outside the vocabulary [0, {vocab_size})."
            )

    @staticmethod
    def token_loss(logits, labels):
        """Token cross-entropy of each row: `(sum over its target tokens, number of target tokens)`, both
        `(batch,)`; -100 targets are left out."""
        import torch.nn.functional as F

        vocab = logits.shape[-1]
        per_token = F.cross_entropy(
            logits.float().reshape(-1, vocab), labels.reshape(-1), ignore_index=IGNORE_INDEX, reduction="none"
        ).view(labels.shape)  # (batch, target)
        return per_token.sum(-1), (labels != IGNORE_INDEX).sum(-1)

    @staticmethod
    def task_token_loss(logits, labels, task_ids, specs):
        """A text-to-text model's loss: token cross-entropy, mean over the batch's target tokens (as transformers'
        LMs), each task's tokens weighted by its `loss_weight`; plus each task's own mean, for every task on the device
        (a `PresentTasks`: the tasks present are read back only when looked at). `logits` `(batch, target, vocab)`
        and `labels` `(batch, target)` already aligned (a causal LM's shifted by the caller)."""
        import torch

        from ..layers.heads import PresentTasks

        row_sums, counts = Seq2Seq.token_loss(logits, labels.to(logits.device))  # (batch,), (batch,)
        weights = torch.tensor([s.loss_weight for s in specs], device=logits.device)[task_ids]
        loss = (row_sums * weights).sum() / counts.sum().clamp_min(1)
        sums = row_sums.new_zeros(len(specs)).index_add(0, task_ids, row_sums)  # (tasks,)
        tokens = counts.new_zeros(len(specs)).index_add(0, task_ids, counts)  # (tasks,)
        per_task = sums / tokens.clamp_min(1)
        return loss, PresentTasks([s.name for s in specs], task_ids, list(per_task.unbind()), rows=False)

    def entropy(self, spec, logits, attention_mask):
        raise ValueError(
            f"MT-Uncertainty sampling cannot score task {spec.name!r} (problem_type {self.name!r}): it needs class "
            "probabilities; regression is handled by `regression_uncertainty`."
        )

    def card_labels(self, spec, label_range=None):
        return "text"


def text_to_text_layout(model_or_config) -> str:
    """The layout of a text-to-text example a model reads, as its config declares it (`text_to_text_layout`:
    `TaskRoutedLMConfig` says `"causal"`); `"encoder-decoder"` when the config declares none."""
    config = getattr(model_or_config, "config", model_or_config)
    return check_choice(getattr(config, "text_to_text_layout", ENCODER_DECODER_LAYOUT), LAYOUTS, "text_to_text_layout")


def target_token_ids(tokenizer, texts: list[str], max_length: int = 64) -> list[list[int]]:
    """Token ids of seq2seq target texts, under the library's one convention: the text's tokens and the end
    token (EOS, or [SEP] for a BERT vocabulary), never a leading BOS or [CLS].

    The model puts its `decoder_start_token_id` in front of the targets itself (decoder inputs = targets shifted
    right), and `generate()` starts from it; a target that also began with a BOS-like token would feed the
    decoder `[CLS] [CLS] w ...` and teach it to answer a start token with a start token, the loop a BERT warm
    start falls into. At most `max_length` tokens, the end token included."""
    leading = {tokenizer.bos_token_id, tokenizer.cls_token_id} - {None}
    probe = tokenizer(text_target="a")["input_ids"]
    strip = bool(probe) and probe[0] in leading  # does this tokenizer put a BOS / [CLS] first?
    rows = tokenizer(text_target=list(texts), truncation=True, max_length=max_length + int(strip))["input_ids"]
    rows = [row[1:] for row in rows] if strip else rows
    # GPT-2's and Llama's tokenizers end a text with no end token: without one a model never learns to stop
    end = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.sep_token_id
    if end is None:
        return rows
    return [row if row and row[-1] == end else row[: max_length - 1] + [end] for row in rows]


register_problem_type(Seq2Seq())
