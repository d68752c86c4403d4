"""Loading what a training run names -- task data, a checkpoint, a tokenizer -- with each refusal said in one
paragraph (`UsageError`), and fitting the tokenizer and the data to the model (end tokens, vocabulary, positions)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import transformers
from transformers import AutoConfig, AutoTokenizer

from ..input_checks import token_table_sizes
from ..models.registry import FAMILIES
from ..training.data import TASK_PRESETS, DataError, PresetLoadError, load_tasks
from .errors import UsageError

logger = logging.getLogger(__name__)

def _network_failure(err: BaseException) -> BaseException | None:
    """The connection error (offline, unreachable Hub) behind `err`, if any."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, (ConnectionError, TimeoutError)) or type(err).__name__ in (
                "OfflineModeIsEnabled", "ConnectError", "ConnectTimeout", "ReadTimeout", "LocalEntryNotFoundError"):
            return err
        err = err.__cause__ or err.__context__
    return None


def load_task_data(names: list[str], splits: list[str], cache_dir: str | None):
    """`load_tasks`, saying first which presets download from the Hub; a download that fails (offline, Hub
    unreachable) is a one-paragraph `UsageError`."""
    presets = [n for n in names if n in TASK_PRESETS and not Path(n).is_file()]
    if presets:
        print(
            f"Presets {' '.join(presets)}: downloading from the Hugging Face Hub (datasets.load_dataset; cached after "
            "the first run)."
        )
    try:
        return load_tasks(names, splits=splits, cache_dir=cache_dir)
    except (UsageError, DataError):
        raise
    except Exception as err:  # noqa: BLE001 -- only a network failure is re-worded; anything else propagates
        cause = _network_failure(err)
        if cause is None:
            raise
        reason = str(cause).splitlines()[0] if str(cause) else type(cause).__name__
        preset = err if isinstance(err, PresetLoadError) else None
        what = (f"the data of preset task {preset.task!r} (Hub dataset {preset.dataset_id})" if preset is not None
                else "the preset task data")
        raise UsageError(
            f"Could not download {what} from the Hugging Face Hub ({type(cause).__name__}: {reason}). "
            "Presets (and task-config entries with \"preset\") need the network on their first use, or a copy in the "
            "datasets cache (then set HF_DATASETS_OFFLINE=1). For data on disk, write a task-config file (see "
            "docs/task-config.md)."
        ) from None


def select_tasks(task_data, splits: list[str], task_names: list[str] | None = None,
                 max_samples: dict[str, int | None] | None = None, seed: int = 42):
    """`(task_data, labels)`: the tasks kept (`task_names`, all when None), each checked to have every split and
    every row of it valid (`check_tasks`, before any sample leaves rows out), each split sampled down to
    `max_samples[split]` examples (a draw fixed by `seed`), a regression task's `target_range` taken from its training
    targets where its spec gives none; `labels` maps `(task, split)` to the labels kept."""
    import dataclasses
    import random

    from ..problem_types import get_problem_type
    from ..training.data import check_tasks

    if task_names:
        unknown = sorted(set(task_names) - {t.name for t in task_data})
        if unknown:
            raise UsageError(
                f"--task_names {unknown}: not in the task-config(s); its tasks are {[t.name for t in task_data]}."
            )
        task_data = [t for t in task_data if t.name in task_names]
    for t in task_data:
        missing = [s for s in splits if t.split(s) is None]
        if missing:
            raise UsageError(f"Task {t.name!r} has no {missing} split ({t.source}).")
    labels = check_tasks(task_data, splits)  # every row of every file, also those a sample below leaves out
    for t in task_data:
        for split, limit in (max_samples or {}).items():
            if limit is not None and len(t.split(split) or []) > limit:
                keep = sorted(random.Random(seed).sample(range(len(t.split(split))), limit))
                t.splits[split] = t.split(split).select(keep)
                labels[(t.name, split)] = [labels[(t.name, split)][i] for i in keep]
    for t in task_data:  # a regression task's scale, for the pipelines and the card, from its training targets
        if ("target_range" in get_problem_type(t.spec.problem_type).own_spec_fields and t.spec.target_range is None
                and (t.name, "train") in labels):
            values = [v for row in labels[(t.name, "train")] for v in (row if isinstance(row, list) else [row])]
            if min(values) < max(values):
                t.spec = dataclasses.replace(t.spec, target_range=[min(values), max(values)])
    return task_data, labels


def check_continued_tasks(saved, tasks) -> None:
    """A task given again when continuing a saved model must be the same task (labels, their order, problem type,
    metrics); a difference would train and evaluate with two label orders."""
    keys = ("problem_type", "num_labels", "label_names", "label_values", "metrics", "choice_fields")
    by_name = {t.name: t for t in saved}
    differences = [f"task {task.name!r}: {key} saved {getattr(old, key)!r}, task file {getattr(task, key)!r}"
                   for task in tasks if (old := by_name.get(task.name)) is not None
                   for key in keys if getattr(old, key) != getattr(task, key)]
    if differences:
        raise UsageError("The task file contradicts the saved model's tasks:\n  " + "\n  ".join(differences))


def representation_base(path: str, family, cache_dir=None):
    """The plain seq2seq model whose encoder states make TextEmb: the checkpoint at `path`, made what `family` is
    built from first where it says how (`Family.prepare_dense`: a BERT warm-started into a BART, its encoder a copy
    of the BERT, the same on every call)."""
    from transformers import AutoModelForSeq2SeqLM

    if family.prepare_dense is not None:
        prepared = family.prepare_dense(path, AutoConfig.from_pretrained(path, cache_dir=cache_dir))
        if prepared is not path:
            return prepared
    return AutoModelForSeq2SeqLM.from_pretrained(path, cache_dir=cache_dir)


def set_text_representations(model, task_data, tokenizer, base: str, names: list[str], max_length: int,
                             examples: int, cache_dir=None) -> None:
    """TextEmb of the tasks `names` (their first `examples` training pairs) under `base`, set as their
    representations; the recipe is recorded in the config for tasks added later."""
    from ..analysis.task_embeddings import text_task_embeddings
    from ..models.registry import family_of

    if not names:
        return
    if not hasattr(model, "set_task_embedding"):
        raise UsageError(f"--task_representation text: a {type(model).__name__} has no task representations to set "
                         "(set_task_embedding); it applies to the task-routing method on an encoder-decoder "
                         "(--model_family bart_routed).")
    encoder = representation_base(base, family_of(model), cache_dir)
    size = model.router.task_embeddings.weight.shape[1]
    if encoder.config.d_model != size:
        raise UsageError(f"--task_representation text: TextEmb has the base's d_model = {encoder.config.d_model} "
                         f"dimensions, the model's task representations {size}; "
                         f"leave --task_embedding_dim unset.")
    pairs = {}
    for t in task_data:
        if t.name in names:
            rows = t.split("train").select(range(min(examples, len(t.split("train")))))
            pairs[t.name] = [
                (" ".join(str(r[f]) for f in t.spec.text_fields), str(r[t.spec.label_field])) for r in rows
            ]
    embeddings = text_task_embeddings(encoder.to(model.device), tokenizer, pairs, max_length=max_length)
    for name, row in zip(pairs, embeddings):
        model.set_task_embedding(name, row)
    model.config.task_representation_source = {"kind": "text", "base": base, "pooling": "avg", "examples": examples}
    logger.info(f"Task representations of {list(pairs)}: TextEmb under {base} ({examples} examples each at most)")


def text_representations(model, task_data, tokenizer, source: str, max_length: int, examples: int,
                         cache_dir=None) -> None:
    """`--task_representation text` (Ye et al. 5.1 (i)): a model built from the dense checkpoint `source` now gets
    every task's TextEmb under it; a saved model continued gets its added tasks' under the base its saved tasks'
    were made with (their config's `task_representation_source`), so that the router picks their routes from their
    data."""
    saved_config = AutoConfig.from_pretrained(source, cache_dir=cache_dir)
    if not is_task_model_config(saved_config):
        set_text_representations(model, task_data, tokenizer, str(source), model.config.task_names, max_length,
                                 examples, cache_dir)
        return
    recipe = getattr(saved_config, "task_representation_source", None)
    if not recipe or recipe.get("kind") != "text":
        raise UsageError("--task_representation text: the saved model's task representations were not made "
                         "from text (its config has no task_representation_source), so an added task's would "
                         "not be comparable.")
    added = [n for n in model.config.task_names if n not in saved_config.task_names]
    set_text_representations(model, task_data, tokenizer, recipe["base"], added, max_length, examples, cache_dir)


def check_family_tasks(family, tasks, option: str = "--model_family") -> None:
    """Refuse tasks whose problem type `family` (a `Family`) does not take (`Family.supported_problem_types`), in one
    paragraph, before its checkpoint is loaded or prepared (task-level routing is text-to-text only: a classification
    task would otherwise be refused by the config after the weights loaded, below transformers' load report)."""
    supported = family.supported_problem_types
    refused = [t for t in tasks if supported and t.problem_type not in supported]
    if not refused:
        return
    takes = sorted({f.method or f.name for f in FAMILIES.values() if f.buildable_from_dense
                    and all(t.problem_type in f.supported_problem_types for t in refused)})
    raise UsageError(
        f"{option}: {family.name} ({family.model_class.__name__}) cannot train "
        + ", ".join(f"task {t.name!r} ({t.problem_type})" for t in refused)
        + f": it supports the problem types {list(supported)}. "
        + (f"Methods that take those tasks: {', '.join(takes)}." if takes else "No method takes all of them.")
    )


def is_task_model_config(config) -> bool:
    """Whether a checkpoint's config is a saved hf_taskmoe model (continued) rather than a dense one (upcycled)."""
    return any(m.model_type == config.model_type for f in FAMILIES.values() for m in f.members)


def unloadable(option: str, name: str, what: str, err: BaseException) -> UsageError:
    """The refusal of a checkpoint or tokenizer the user named (`option name`) that transformers cannot load: what is
    wrong with it in one paragraph (no such folder, not on the Hub, a config.json naming an unknown model type,
    weights missing), instead of transformers' traceback and an "internal error"."""
    reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    path = Path(os.path.expanduser(name))
    if not path.exists():
        from huggingface_hub.utils import HFValidationError, validate_repo_id

        try:
            validate_repo_id(name)
            hub_id = not name.startswith((".", "~")) and not os.path.isabs(name)
        except HFValidationError:
            hub_id = False
        if not hub_id:
            return UsageError(f"{option} {name}: no such folder (nor a model id on the Hugging Face Hub). Pass the "
                              f"folder that holds the {what}, or a Hub model id such as bert-base-uncased.")
        return UsageError(f"{option} {name}: not a local folder, and the {what} could not be loaded from the "
                          f"Hugging Face Hub ({reason}). Check the spelling and the network (offline, it must be in "
                          "the Hugging Face cache).")
    if path.is_file():
        return UsageError(f"{option} {name} is a file; pass the folder that holds the {what}.")
    config = path / "config.json"
    if what == "checkpoint" and config.is_file():
        try:
            declared = json.loads(config.read_text())
        except (OSError, ValueError) as bad:
            return UsageError(f"{option} {name}: its config.json is not readable JSON ({bad}).")
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING

        model_type = declared.get("model_type") if isinstance(declared, dict) else None
        if model_type is None:
            return UsageError(f"{option} {name}: its config.json names no model_type, so no model class can be "
                              "chosen for it. Pass a checkpoint saved by transformers' save_pretrained.")
        if model_type not in CONFIG_MAPPING:
            own_code = (" and asks to run code of its own (auto_map), which this script never does"
                        if declared.get("auto_map") else "")
            return UsageError(f"{option} {name}: its config.json names model_type {model_type!r}, which neither "
                              f"transformers {transformers.__version__} nor hf_taskmoe knows{own_code}. Pass a "
                              "checkpoint of a supported architecture (--help: --model_family).")
    elif what == "checkpoint":
        return UsageError(f"{option} {name}: the folder holds no config.json; pass a checkpoint's folder (saved with "
                          "save_pretrained: config.json and weights).")
    return UsageError(f"{option} {name}: cannot load the {what} there ({reason}).")


def load_tokenizer(name, cache_dir, model, option_given: bool = True):
    """`AutoTokenizer`'s tokenizer for `name`, unless it does not fit the model's vocabulary while the class the
    tokenizer's own files declare (`tokenizer_class` in tokenizer_config.json) does. transformers 5 loads the class
    registered for some model types (qwen2, phi3, ...) whatever tokenizer_config.json says, so a Qwen2 checkpoint
    saved with a WordPiece tokenizer beside it would be read by a byte-level BPE tokenizer (characters, and an EOS
    outside the model's vocabulary)."""
    from transformers.models.auto.tokenization_auto import get_tokenizer_config, tokenizer_class_from_name

    try:
        tokenizer = AutoTokenizer.from_pretrained(name, cache_dir=cache_dir)
    except (OSError, ValueError, TypeError) as err:  # no tokenizer files there, or ones transformers cannot read
        option = "--tokenizer_name" if option_given else "--model_name_or_path"
        hint = "" if option_given else " (the tokenizer is read from the model's folder unless --tokenizer_name says)"
        raise UsageError(str(unloadable(option, str(name), "tokenizer", err)) + hint) from err
    size = token_table_sizes(model)["input_ids"]
    if size is None or len(tokenizer) <= size:
        return tokenizer
    declared = get_tokenizer_config(name, cache_dir=cache_dir).get("tokenizer_class")
    own_class = tokenizer_class_from_name(declared) if declared else None
    if own_class is None or isinstance(tokenizer, own_class):
        return tokenizer
    own = own_class.from_pretrained(name, cache_dir=cache_dir)
    if len(own) > size:
        return tokenizer
    logger.warning(f"{name}: AutoTokenizer loads a {type(tokenizer).__name__} of {len(tokenizer)} tokens, more than "
                   f"the model's {size}; using the {declared} its tokenizer_config.json declares ({len(own)} tokens).")
    return own


def prepare_causal_lm(model, tokenizer, max_seq_length: int, max_target_length: int,
                      generation_max_length: int | None = None) -> int:
    """A decoder-only LM reads a text-to-text example as one sequence, prompt then target (the causal layout of
    `hf_taskmoe.problem_types.seq2seq`). Make its tokenizer and generation config agree on the token that ends a
    target, check that a prompt and its continuation fit the model's positions, and return the padding id.

    The end token is the tokenizer's EOS or, for a WordPiece vocabulary (which names none), [SEP]: the token its
    targets end with (`target_token_ids`), named as the tokenizer's EOS (saved with it, so pipelines and metrics
    read it) and made the generation config's EOS, so that generation stops where the targets did. The dense
    checkpoint's own end tokens stay beside it where they lie in the vocabulary (GPT-2's 50256 does not in a
    WordPiece one). The padding id is the tokenizer's, or the end token's when it names none."""
    end = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else tokenizer.sep_token_id
    if end is None:
        raise UsageError(
            f"The tokenizer {tokenizer.name_or_path} names no end token (EOS or [SEP]): a causal LM's targets end with "
            "one, and generation stops there. Pass a tokenizer that has one (--tokenizer_name)."
        )
    if tokenizer.eos_token_id is None:
        tokenizer.eos_token = tokenizer.sep_token
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    declared = model.generation_config.eos_token_id
    declared = [] if declared is None else [declared] if isinstance(declared, int) else list(declared)
    stops = [end] + [t for t in declared if t != end and 0 <= t < model.config.vocab_size]
    start = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.cls_token_id
    # the config and the generation config say what the tokenizer does (the Trainer would align them before training)
    for config in (model.config, model.generation_config):
        config.eos_token_id = stops[0] if len(stops) == 1 else stops
        config.pad_token_id = tokenizer.pad_token_id
        if start is not None:
            config.bos_token_id = start  # what a prompt begins with

    positions = model.max_input_length() if hasattr(model, "max_input_length") else None
    generated = max(max_target_length, generation_max_length or 0)
    if positions is not None and max_seq_length + generated > positions:
        longest = ("--max_target_length" if generated == max_target_length else "--generation_max_length")
        raise UsageError(
            f"--max_seq_length {max_seq_length} (the prompt) + {longest} {generated} (the continuation) "
            f"exceed the {positions} positions of this causal LM, which reads prompt and continuation as one "
            f"sequence. Lower them so that they add up to at most {positions}."
        )
    return tokenizer.pad_token_id


def name_special_tokens(tokenizer, config) -> None:
    """Give the tokenizer the model's BOS and EOS where it names none (a BERT vocabulary read by a BART warm-started
    from the BERT: [CLS] and [SEP]). Named on the tokenizer, and saved with it, they survive a transformers release
    that aligns the model's special tokens to the tokenizer's before training, and reach every pipeline."""
    for name in ("bos", "eos"):
        token_id = getattr(config, f"{name}_token_id", None)
        if getattr(tokenizer, f"{name}_token_id") is None and token_id is not None:
            setattr(tokenizer, f"{name}_token", tokenizer.convert_ids_to_tokens(token_id))


def fit_tokenizer(model, tokenizer, max_seq_length: int, max_target_length: int,
                  generation_max_length: int | None = None) -> tuple[str, int | None]:
    """Make the tokenizer, the model's generation settings and the lengths agree before any data is tokenised:
    inputs truncated where training does (saved with the tokenizer, so pipelines truncate there too), an
    encoder-decoder's end tokens named on its tokenizer, a causal LM's end and padding tokens set
    (`prepare_causal_lm`), generation as long as the targets, and inputs no longer than the model's positions.
    Returns `(layout, pad_token_id)`: how a text-to-text example is laid out for this model
    (`hf_taskmoe.problem_types.seq2seq.text_to_text_layout`) and the padding id the collator must use where the
    model's config does not give it (None: the config's)."""
    from ..problem_types.seq2seq import CAUSAL_LAYOUT, text_to_text_layout

    tokenizer.model_max_length = max_seq_length
    layout = text_to_text_layout(model)
    pad_token_id = None
    encoder_decoder = getattr(model.config, "is_encoder_decoder", False)
    if encoder_decoder:
        name_special_tokens(tokenizer, model.config)
    elif layout == CAUSAL_LAYOUT:
        pad_token_id = prepare_causal_lm(model, tokenizer, max_seq_length, max_target_length, generation_max_length)
    if encoder_decoder or layout == CAUSAL_LAYOUT:
        model.generation_config.max_new_tokens = max_target_length  # as long as the targets it learned
    positions = model.max_input_length() if hasattr(model, "max_input_length") else None
    if layout != CAUSAL_LAYOUT and positions is not None and max_seq_length > positions:
        # (a causal LM's prompt and continuation share its positions: `prepare_causal_lm` checks their sum)
        raise UsageError(
            f"--max_seq_length {max_seq_length} exceeds the {positions} positions of this model: a longer "
            f"input would be refused mid-run. Pass --max_seq_length {positions} or less."
        )
    return layout, pad_token_id


def check_token_ids(model, sets: dict, split: str, tokenizer_name: str) -> None:
    """Every token id of the tokenised `sets` ({task: dataset}) must be in the model's vocabulary, and every
    segment id in its `type_vocab_size`: an id beyond them means a tokenizer that is not the model's (an
    IndexError deep in the embedding otherwise). Checked after tokenising, before any compute."""
    sizes = token_table_sizes(model)  # the sizes BatchChecker checks each batch against
    limits = {"input_ids": (sizes["input_ids"], "vocabulary (vocab_size)"),
              "token_type_ids": (sizes["token_type_ids"], "token type table (type_vocab_size)")}
    for task, dataset in sets.items():
        for column, (size, what) in limits.items():
            if size is None or column not in dataset.column_names:
                continue
            for row, ids in enumerate(dataset[column]):
                high = max(ids, default=0)
                if high >= size or min(ids, default=0) < 0:
                    raise UsageError(
                        f"Task {task!r}, {split} example {row}: the tokenizer {tokenizer_name} gives {column} {high}, "
                        "but the "
                        f"model's {what} has {size} entries: the tokenizer is not the model's. Pass the model's own "
                        "tokenizer (--tokenizer_name, or leave it unset to use the one saved with the model)"
                        + (", or a model that takes segment ids" if column == "token_type_ids" else "")
                        + "."
                    )

