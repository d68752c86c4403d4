"""Multi-task pipelines, registered with transformers' pipeline registry when hf_taskmoe is imported.

`pipeline("multitask-text-classification", model=..., tokenizer=...)`: one pipeline for every task of a
multi-task encoder (BertForTaskMoE, BertWithPALs, CAMTLModel: text classification, multi-label, regression).

    pipe("a fine film", task="sst2")                                      -> {"task", "label", "score"}
    pipe({"text": "A man plays.", "text_pair": "A man is playing."}, task="stsb")   -> {"task", "score"}
    pipe([{"text": ..., "task": "sst2"}, {"text": ..., "text_pair": ..., "task": "stsb"}], batch_size=16)

Results per problem type: single-label classification `label` + `score` (softmax; `top_k=n` gives the n
best as a list), multi-label `labels` (sigmoid > 0.5) + `scores` per label, regression `score`.

`pipeline("multitask-text2text-generation", model=...)`: generation for every seq2seq task of a
task-routed encoder-decoder (BartTaskRouted), each row generated with its own task's routes.

    pipe("Who wrote Hamlet?", task="trec")                                -> {"task", "generated_text"}
    pipe([{"text": ..., "task": "xsum"}, {"text": q, "text_pair": passage, "task": "boolq"}], num_beams=4)

Generation keywords (`max_new_tokens`, `num_beams`, ...) go to `generate`; the rest come from the model's
generation config. In both pipelines a list may mix tasks (and single texts with pairs): rows are
tokenised and run together, `batch_size` at a time, each with its own `task_ids`.
"""

from __future__ import annotations

import torch
from transformers import AutoModel, AutoModelForSeq2SeqLM, Pipeline
from transformers.pipelines import PIPELINE_REGISTRY

from .modeling_utils import check_generation_counts

PIPELINE_TASK = "multitask-text-classification"
TEXT2TEXT_PIPELINE_TASK = "multitask-text2text-generation"


class _MultiTaskPipeline(Pipeline):
    """Inputs shared by the multi-task pipelines: a string, a `{"text", "text_pair", "task"}` dict, or a list
    of them; each row is routed to its task. Subclasses set `supported` (problem types) and implement
    `_forward` / `postprocess`."""

    supported: tuple[str, ...] = ()
    _load_processor = False
    _load_image_processor = False
    _load_feature_extractor = False
    _load_tokenizer = True

    def _sanitize_parameters(self, task=None, max_length=None, **kwargs):
        preprocess = {"task": task} if task is not None else {}
        if max_length is not None:
            preprocess["max_length"] = max_length
        return preprocess, *self._sanitize_model_parameters(**kwargs)

    def _sanitize_model_parameters(self, **kwargs) -> tuple[dict, dict]:
        """(forward parameters, postprocess parameters) from the call's remaining keywords."""
        if kwargs:
            raise TypeError(f"{type(self).__name__} got unexpected keyword arguments {sorted(kwargs)}.")
        return {}, {}

    # ------------------------------------------------------------------ inputs
    def _normalise(self, item, task: str | None) -> tuple[str, str | None, int]:
        if isinstance(item, str):
            text, pair, name = item, None, task
        elif isinstance(item, dict):
            unknown = set(item) - {"text", "text_pair", "task"}
            if unknown or "text" not in item:
                raise ValueError(f"A pipeline input dict holds 'text' (and optionally 'text_pair', 'task'); got keys {sorted(item)}.")
            text, pair, name = item["text"], item.get("text_pair"), item.get("task", task)
        else:
            raise ValueError(f"Pipeline inputs are strings or {{'text', 'text_pair', 'task'}} dicts, got {type(item).__name__}.")
        names = self.model.config.task_names
        if name is None:
            if len(names) != 1:
                raise ValueError(f"Say which task each input is for (`task=...` or an input's 'task'); this model's tasks are {names}.")
            name = names[0]
        task_id = self.model.task_id(name)  # raises for an unknown task, listing the model's tasks
        problem = self.model.config.task_specs[task_id].problem_type
        if problem not in self.supported:
            raise ValueError(f"Task {name!r} is {problem}; this pipeline serves {list(self.supported)}.")
        return text, pair, task_id

    def max_length(self) -> int:
        """Where inputs are truncated: the length the model was trained with (`run_multitask.py` saves it as the
        tokenizer's `model_max_length`), never beyond what the model takes (`max_input_length`)."""
        limit = self.model.max_input_length() if hasattr(self.model, "max_input_length") else None
        trained = self.tokenizer.model_max_length if self.tokenizer.model_max_length < 1_000_000 else None
        lengths = [n for n in (limit, trained) if n]
        return min(lengths) if lengths else 512

    def preprocess(self, inputs, task=None, max_length=None):
        """`inputs`: a list of normalised `(text, pair, task_id)` rows, tokenised as one padded batch."""
        # encoder-decoders take no segment ids (as `tokenize_task` for seq2seq tasks)
        extra = {"return_token_type_ids": False} if self.model.config.is_encoder_decoder else {}
        if max_length is None:
            max_length = self.max_length()
        elif isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1:
            raise ValueError(f"`max_length` must be a positive integer, got {max_length!r}.")
        # rows one by one (a batch may mix single texts and pairs), then padded together
        rows = [self.tokenizer(text, pair, truncation=True, max_length=max_length, **extra) for text, pair, _ in inputs]
        encoded = self.tokenizer.pad(rows, padding=True, return_tensors="pt")
        encoded["task_ids"] = torch.tensor([i for _, _, i in inputs], dtype=torch.long)
        return encoded

    # ------------------------------------------------------------------ call
    def __call__(self, inputs, task: str | None = None, batch_size: int | None = None, **kwargs):
        """Run on one input or a list (see the module docstring); a list may mix tasks."""
        single = not isinstance(inputs, (list, tuple))
        items = [self._normalise(x, task) for x in ([inputs] if single else inputs)]
        preprocess_params, forward_params, postprocess_params = self._sanitize_parameters(**kwargs)
        preprocess_params = {**self._preprocess_params, **preprocess_params}
        forward_params = {**self._forward_params, **forward_params}
        postprocess_params = {**self._postprocess_params, **postprocess_params}
        size = batch_size if batch_size is not None else (self._batch_size or 8)
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"`batch_size` must be a positive integer, got {size!r}.")
        results = []
        for start in range(0, len(items), size):
            model_inputs = self.preprocess(items[start : start + size], **preprocess_params)
            outputs = self.forward(model_inputs, **forward_params)
            results.extend(self.postprocess(outputs, **postprocess_params))
        return results[0] if single else results


class MultiTaskTextClassificationPipeline(_MultiTaskPipeline):
    """Text (or text-pair) classification and regression for any task of a multi-task model; see the module
    docstring."""

    supported = ("single_label_classification", "multi_label_classification", "regression")

    def _sanitize_model_parameters(self, top_k=None, **kwargs):
        super()._sanitize_model_parameters(**kwargs)
        if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
            raise ValueError(f"`top_k` must be a positive integer (the number of labels to return), got {top_k!r}.")
        return {}, ({"top_k": top_k} if top_k is not None else {})

    def _forward(self, model_inputs):
        task_ids = model_inputs["task_ids"]
        out = self.model(**model_inputs)
        return {"task_ids": task_ids, "task_logits": out.task_logits}

    def postprocess(self, model_outputs, top_k=None):
        task_ids = model_outputs["task_ids"].cpu()
        specs = self.model.config.task_specs
        rows: list[dict | None] = [None] * len(task_ids)
        for name, logits in model_outputs["task_logits"].items():
            spec = specs[self.model.task_id(name)]
            logits = logits.float().cpu()
            positions = (task_ids == self.model.task_id(name)).nonzero(as_tuple=True)[0].tolist()
            for position, row in zip(positions, logits):
                rows[position] = self._row_result(spec, row, top_k)
        return rows

    @staticmethod
    def _row_result(spec, logits: torch.Tensor, top_k: int | None) -> dict:
        labels = spec.label_names or [f"LABEL_{i}" for i in range(logits.shape[-1])]
        if spec.problem_type == "regression":
            value = logits.tolist()
            result = {"task": spec.name, "score": value[0] if len(value) == 1 else value}
            if spec.target_range:
                result["scale"] = list(spec.target_range)  # what the score means: the range of the task's targets
            return result
        if spec.problem_type == "multi_label_classification":
            probs = logits.sigmoid().tolist()
            return {"task": spec.name, "labels": [l for l, p in zip(labels, probs) if p > 0.5],
                    "scores": dict(zip(labels, probs))}
        probs = logits.softmax(-1)
        if top_k is None:
            best = int(probs.argmax())
            return {"task": spec.name, "label": labels[best], "score": float(probs[best])}
        order = probs.argsort(descending=True)[:top_k].tolist()
        return {"task": spec.name, "top": [{"label": labels[i], "score": float(probs[i])} for i in order]}


class MultiTaskText2TextGenerationPipeline(_MultiTaskPipeline):
    """Generation for any seq2seq task of a task-routed encoder-decoder (BartTaskRouted); see the module
    docstring. Returns `{"task", "generated_text"}` per input."""

    supported = ("seq2seq",)
    # generation keywords given to `pipeline(...)` or to a call reach `_forward` through `_sanitize_parameters`, merged
    # by `Pipeline` itself; no private generation helper of transformers' pipelines (they change between 5.x releases)
    _pipeline_calls_generate = False

    def _sanitize_model_parameters(self, **generate_kwargs):
        check_generation_counts(generate_kwargs)  # at the call, before any input is tokenised
        return generate_kwargs, {}

    def _forward(self, model_inputs, **generate_kwargs):
        task_ids = model_inputs["task_ids"]
        generated = self.model.generate(**model_inputs, **generate_kwargs)
        return {"task_ids": task_ids, "generated": generated}

    def postprocess(self, model_outputs):
        from .metrics import decode_texts

        names = self.model.config.task_names
        # position 0 is the decoder start token; the text ends at the first EOS (what evaluation scores: other
        # special tokens are kept, so a model that loops on a start token shows it)
        generated = model_outputs["generated"][:, 1:].cpu()
        texts = decode_texts(generated, self.tokenizer, self.model.generation_config.eos_token_id)
        return [{"task": names[int(t)], "generated_text": text} for t, text in zip(model_outputs["task_ids"], texts)]


PIPELINE_REGISTRY.register_pipeline(PIPELINE_TASK, pipeline_class=MultiTaskTextClassificationPipeline, pt_model=AutoModel)
PIPELINE_REGISTRY.register_pipeline(
    TEXT2TEXT_PIPELINE_TASK, pipeline_class=MultiTaskText2TextGenerationPipeline, pt_model=AutoModelForSeq2SeqLM
)
