"""`pipeline("multitask-text-classification", model=..., tokenizer=...)`: one pipeline for every task of a
multi-task encoder (BertForTaskMoE, BertWithPALs, any family whose tasks are text classification or
regression).

    pipe("a fine film", task="sst2")                                      -> {"task", "label", "score"}
    pipe({"text": "A man plays.", "text_pair": "A man is playing."}, task="stsb")   -> {"task", "score"}
    pipe([{"text": ..., "task": "sst2"}, {"text": ..., "text_pair": ..., "task": "stsb"}], batch_size=16)

A list may mix tasks: rows are tokenised and run together, `batch_size` at a time, each with its own
`task_ids`. Results per problem type: single-label classification `label` + `score` (softmax; `top_k=n`
gives the n best as a list), multi-label `labels` (sigmoid > 0.5) + `scores` per label, regression `score`.
Importing hf_taskmoe registers the pipeline.
"""

from __future__ import annotations

import torch
from transformers import AutoModel, Pipeline
from transformers.pipelines import PIPELINE_REGISTRY

PIPELINE_TASK = "multitask-text-classification"
SUPPORTED = ("single_label_classification", "multi_label_classification", "regression")


class MultiTaskTextClassificationPipeline(Pipeline):
    """Text (or text-pair) classification and regression for any task of a multi-task model; see the module
    docstring. Accepts a string, a `{"text", "text_pair", "task"}` dict, or a list of them."""

    _load_processor = False
    _load_image_processor = False
    _load_feature_extractor = False
    _load_tokenizer = True

    def _sanitize_parameters(self, task=None, top_k=None, max_length=None, **kwargs):
        preprocess = {"task": task} if task is not None else {}
        if max_length is not None:
            preprocess["max_length"] = max_length
        postprocess = {"top_k": top_k} if top_k is not None else {}
        return preprocess, {}, postprocess

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
        if problem not in SUPPORTED:
            raise ValueError(f"Task {name!r} is {problem}; this pipeline serves {list(SUPPORTED)}.")
        return text, pair, task_id

    def preprocess(self, inputs, task=None, max_length=None):
        """`inputs`: a list of normalised `(text, pair, task_id)` rows, tokenised as one padded batch."""
        # rows one by one (a batch may mix single texts and pairs), then padded together
        rows = [self.tokenizer(text, pair, truncation=True, max_length=max_length) for text, pair, _ in inputs]
        encoded = self.tokenizer.pad(rows, padding=True, return_tensors="pt")
        encoded["task_ids"] = torch.tensor([i for _, _, i in inputs], dtype=torch.long)
        return encoded

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
            return {"task": spec.name, "score": value[0] if len(value) == 1 else value}
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

    # ------------------------------------------------------------------ call
    def __call__(self, inputs, task: str | None = None, batch_size: int | None = None, **kwargs):
        """Run on one input or a list (see the module docstring); a list may mix tasks."""
        single = not isinstance(inputs, (list, tuple))
        items = [self._normalise(x, task) for x in ([inputs] if single else inputs)]
        preprocess_params, forward_params, postprocess_params = self._sanitize_parameters(**kwargs)
        preprocess_params = {**self._preprocess_params, **preprocess_params}
        postprocess_params = {**self._postprocess_params, **postprocess_params}
        size = batch_size or self._batch_size or 8
        results = []
        for start in range(0, len(items), size):
            model_inputs = self.preprocess(items[start : start + size], **preprocess_params)
            outputs = self.forward(model_inputs, **forward_params)
            results.extend(self.postprocess(outputs, **postprocess_params))
        return results[0] if single else results


PIPELINE_REGISTRY.register_pipeline(PIPELINE_TASK, pipeline_class=MultiTaskTextClassificationPipeline, pt_model=AutoModel)
