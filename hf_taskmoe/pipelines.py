"""Multi-task pipelines, registered with transformers' pipeline registry when hf_taskmoe is imported.

`pipeline("multitask-text-classification", model=..., tokenizer=...)`: one pipeline for every task of a
multi-task encoder (BertForTaskMoE, BertWithPALs, CAMTLModel: text classification, multi-label, regression,
extractive question answering: each problem type whose `pipeline` is "classification").

    pipe("a fine film", task="sst2")                                      -> {"task", "label", "score"}
    pipe({"text": "A man plays.", "text_pair": "A man is playing."}, task="stsb")   -> {"task", "score"}
    pipe([{"text": ..., "task": "sst2"}, {"text": ..., "text_pair": ..., "task": "stsb"}], batch_size=16)

Results per problem type (`ProblemType.pipeline_result`): single-label classification `label` + `score` (softmax;
`top_k=n` gives the n best as a list), multi-label `labels` (sigmoid > 0.5) + `scores` per label, regression
`score`, extractive QA `answer` (`{"question": ..., "context": ..., "task": "qa"}` in).

`pipeline("multitask-text2text-generation", model=...)`: generation for every seq2seq task of a
task-routed encoder-decoder (BartTaskRouted) or decoder-only LM (TaskRoutedForCausalLM: the answer is the
continuation of the input text), each row generated with its own task's routes.

    pipe("Who wrote Hamlet?", task="trec")                                -> {"task", "generated_text"}
    pipe([{"text": ..., "task": "xsum"}, {"text": q, "text_pair": passage, "task": "boolq"}], num_beams=4)

Generation keywords (`max_new_tokens`, `num_beams`, ...) go to `generate`; the rest come from the model's
generation config. In both pipelines a list may mix tasks (and single texts with pairs): rows are
tokenised and run together, `batch_size` at a time, each with its own `task_ids`.
"""

from __future__ import annotations

import torch
from transformers import AutoModel, AutoModelForCausalLM, AutoModelForSeq2SeqLM, Pipeline
from transformers.pipelines import PIPELINE_REGISTRY

from .input_checks import check_generation_counts
from .problem_types import PROBLEM_TYPES, problem_type_of

PIPELINE_TASK = "multitask-text-classification"
TEXT2TEXT_PIPELINE_TASK = "multitask-text2text-generation"


class _MultiTaskPipeline(Pipeline):
    """Inputs shared by the multi-task pipelines: a string, a dict of the task's input fields (`text`, `text_pair`;
    `question`, `context` for extractive QA) with an optional `task`, or a list of them; each input is routed to
    its task. What a task's inputs and answer look like is its problem type's (`ProblemType.pipeline_encode`,
    `pipeline_result`); a subclass serves the types whose `pipeline` is its `serves` and implements `_forward`
    (and `postprocess` when the answer is not read from the task logits)."""

    serves: str = ""
    _load_processor = False
    _load_image_processor = False
    _load_feature_extractor = False
    _load_tokenizer = True

    @property
    def supported(self) -> list[str]:
        """The problem types this pipeline serves (every registered type whose `pipeline` is `serves`)."""
        return [name for name, kind in PROBLEM_TYPES.items() if kind.pipeline == self.serves]

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
    def _normalise(self, item, task: str | None) -> tuple[dict, int]:
        """`(the input's fields, task id)`, the task checked against the model's and the pipeline's."""
        if isinstance(item, dict):
            name = item.get("task", task)
            fields = {k: v for k, v in item.items() if k != "task"}
        elif isinstance(item, str):
            name, fields = task, {"text": item}
        else:
            raise ValueError(
                f"Pipeline inputs are strings or dicts of a task's input fields, got {type(item).__name__}."
            )
        names = self.model.config.task_names
        if name is None:
            if len(names) != 1:
                raise ValueError(
                    f"Say which task each input is for (`task=...` or an input's 'task'); this model's tasks are "
                    f"{names}."
                )
            name = names[0]
        task_id = self.model.task_id(name)  # raises for an unknown task, listing the model's tasks
        spec = self.model.config.task_specs[task_id]
        kind = problem_type_of(spec)
        if kind.pipeline != self.serves:
            raise ValueError(f"Task {name!r} is {spec.problem_type}; this pipeline serves {self.supported}.")
        wanted = kind.pipeline_inputs
        if set(fields) - set(wanted) or wanted[0] not in fields:
            raise ValueError(
                f"A pipeline input of task {name!r} holds {wanted[0]!r} (and optionally {list(wanted[1:])}, 'task'); "
                f"got keys {sorted(item) if isinstance(item, dict) else ['text']}."
            )
        # one text per field: a list would reach the tokenizer as a batch (a TypeError about its types there)
        wrong = {k: type(v).__name__ for k, v in fields.items()
                 if not isinstance(v, str) and (v is not None or k == wanted[0])}
        if wrong:
            raise ValueError(
                f"A pipeline input of task {name!r} holds one string per field, got {wrong}; for several inputs pass "
                f"a list of dicts, one per input (e.g. [{{{wanted[0]!r}: ..., 'task': {name!r}}}, ...])."
            )
        return fields, task_id

    def max_length(self) -> int:
        """Where inputs are truncated: the length the model was trained with (`run_multitask.py` saves it as the
        tokenizer's `model_max_length`), never beyond what the model takes (`max_input_length`)."""
        limit = self.model.max_input_length() if hasattr(self.model, "max_input_length") else None
        trained = self.tokenizer.model_max_length if self.tokenizer.model_max_length < 1_000_000 else None
        lengths = [n for n in (limit, trained) if n]
        return min(lengths) if lengths else 512

    def preprocess(self, inputs, task=None, max_length=None):
        """`inputs`: normalised `(fields, task_id)` inputs, encoded by their tasks' problem types (an input may give
        several rows, e.g. a long QA context in windows) and padded as one batch; `owners[i]` is row i's input."""
        # encoder-decoders take no segment ids (as `tokenize_task` for seq2seq tasks)
        extra = {"return_token_type_ids": False} if self.model.config.is_encoder_decoder else {}
        if max_length is None:
            max_length = self.max_length()
        elif isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1:
            raise ValueError(f"`max_length` must be a positive integer, got {max_length!r}.")
        specs = self.model.config.task_specs
        rows, owners, task_ids, features = [], [], [], []
        for index, (fields, task_id) in enumerate(inputs):
            spec = specs[task_id]
            encoded = problem_type_of(spec).pipeline_encode(spec, fields, self.tokenizer, max_length, **extra)
            for row in encoded:
                model_row = {k: v for k, v in row.items() if k in ("input_ids", "attention_mask", "token_type_ids")}
                rows.append(model_row)
                features.append(row)
                owners.append(index)
                task_ids.append(task_id)
        encoded = self.tokenizer.pad(rows, padding=True, return_tensors="pt")  # rows one by one, then padded together
        encoded["task_ids"] = torch.tensor(task_ids, dtype=torch.long)
        return {"model_inputs": encoded, "owners": owners, "features": features, "inputs": list(inputs)}

    def forward(self, model_inputs, **forward_params):
        """`Pipeline.forward` on the model inputs; the rows' owners and features ride along to `postprocess`."""
        outputs = super().forward(model_inputs["model_inputs"], **forward_params)
        return {**outputs, "owners": model_inputs["owners"], "features": model_inputs["features"],
                "inputs": model_inputs["inputs"]}

    # ------------------------------------------------------------------ call
    def __call__(self, inputs, task: str | None = None, batch_size: int | None = None, **kwargs):
        """Run on one input or a list (see the module docstring); a list may mix tasks."""
        single = not isinstance(inputs, (list, tuple))
        items = [self._normalise(x, task) for x in ([inputs] if single else inputs)]
        preprocess_params, forward_params, postprocess_params = self._sanitize_parameters(**kwargs)
        preprocess_params = {**self._preprocess_params, **preprocess_params}
        forward_params = {**self._forward_params, **forward_params}
        postprocess_params = {**self._postprocess_params, **postprocess_params}
        size = batch_size if batch_size is not None else (self._batch_size if self._batch_size is not None else 8)
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"`batch_size` must be a positive integer, got {size!r}.")
        results = []
        for start in range(0, len(items), size):
            model_inputs = self.preprocess(items[start : start + size], **preprocess_params)
            outputs = self.forward(model_inputs, **forward_params)
            results.extend(self.postprocess(outputs, **postprocess_params))
        return results[0] if single else results


class MultiTaskTextClassificationPipeline(_MultiTaskPipeline):
    """Every task of a multi-task encoder whose problem type answers from its head's logits: text (or text-pair)
    classification, multi-label, regression, extractive question answering; see the module docstring."""

    serves = "classification"

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
        row_logits: list = [None] * len(task_ids)
        for name, logits in model_outputs["task_logits"].items():
            positions = (task_ids == self.model.task_id(name)).nonzero(as_tuple=True)[0].tolist()
            for position, row in zip(positions, logits.float().cpu()):  # a task's rows, in batch order
                row_logits[position] = row
        owners, features, inputs = model_outputs["owners"], model_outputs["features"], model_outputs["inputs"]
        results = []
        for index, (fields, task_id) in enumerate(inputs):
            rows = [r for r, owner in enumerate(owners) if owner == index]
            spec = specs[task_id]
            results.append(problem_type_of(spec).pipeline_result(
                spec, torch.stack([row_logits[r] for r in rows]), [features[r] for r in rows], fields, top_k
            ))
        return results


class MultiTaskText2TextGenerationPipeline(_MultiTaskPipeline):
    """Generation for any seq2seq task of a task-routed encoder-decoder (BartTaskRouted) or decoder-only LM
    (TaskRoutedForCausalLM, whose answer is the continuation of the prompt); see the module docstring. Returns
    `{"task", "generated_text"}` per input."""

    serves = "text2text"
    # generation keywords given to `pipeline(...)` or to a call reach `_forward` through `_sanitize_parameters`, merged
    # by `Pipeline` itself; no private generation helper of transformers' pipelines (they change between 5.x releases)
    _pipeline_calls_generate = False

    def _sanitize_model_parameters(self, **generate_kwargs):
        check_generation_counts(generate_kwargs)  # at the call, before any input is tokenised
        return generate_kwargs, {}

    def _forward(self, model_inputs, **generate_kwargs):
        task_ids = model_inputs["task_ids"]
        generated = self.model.generate(**model_inputs, **generate_kwargs)
        if not self.model.config.is_encoder_decoder:  # a causal LM returns its prompt: the last token acts as a start
            generated = generated[:, model_inputs["input_ids"].shape[1] - 1 :]
        return {"task_ids": task_ids, "generated": generated}

    def postprocess(self, model_outputs):
        from .metrics import decode_texts

        names = self.model.config.task_names
        # position 0 is the decoder start token; the text ends at the first EOS (what evaluation scores: other
        # special tokens are kept, so a model that loops on a start token shows it)
        generated = model_outputs["generated"][:, 1:].cpu()
        texts = decode_texts(generated, self.tokenizer, self.model.generation_config.eos_token_id)
        return [{"task": names[int(t)], "generated_text": text} for t, text in zip(model_outputs["task_ids"], texts)]


PIPELINE_REGISTRY.register_pipeline(
    PIPELINE_TASK, pipeline_class=MultiTaskTextClassificationPipeline, pt_model=AutoModel
)
# a task-routed encoder-decoder (BartTaskRouted) or decoder-only LM (TaskRoutedForCausalLM), loaded by path
PIPELINE_REGISTRY.register_pipeline(
    TEXT2TEXT_PIPELINE_TASK,
    pipeline_class=MultiTaskText2TextGenerationPipeline,
    pt_model=(AutoModelForSeq2SeqLM, AutoModelForCausalLM),
)
