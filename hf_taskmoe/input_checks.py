"""Input checks every multi-task family runs at the top of `forward`, before any layer, so that a bad batch costs no
compute and fails with a message that names the argument (and the task, row or field) at fault: task ids, task
counts, shapes and lengths, token ids against the model's tables, keywords, generation settings.
`hf_taskmoe.training.batches.BatchChecker` runs the same checks on the host where a batch is made."""

from __future__ import annotations

import torch


def resolve_task_ids(
    task_ids, batch_size: int, task_names: list[str], device, check_values: bool = True
) -> torch.LongTensor:
    """Check `task_ids` against the model's tasks; with a single task they may be omitted. `check_values`: also
    their range (a read of the values; skipped for a batch checked on the host, `values_checked=True`)."""
    num_tasks = len(task_names)
    if task_ids is None:
        if num_tasks == 1:
            return torch.zeros(batch_size, dtype=torch.long, device=device)
        raise ValueError(
            f"`task_ids` is required: this model has {num_tasks} tasks {task_names}; pass a LongTensor of shape "
            f"(batch,) holding each row's index into that list. (Wrapped with peft? Leave the LoraConfig's "
            f"`task_type` unset: peft's task-specific wrappers, e.g. PeftModelForSeq2SeqLM, take `task_ids` for "
            f"themselves and do not pass it on.)"
        )
    if not isinstance(task_ids, torch.Tensor):
        given = [task_ids] if isinstance(task_ids, str) else task_ids
        if isinstance(given, (list, tuple)) and any(isinstance(t, str) for t in given):
            unknown = [t for t in given if isinstance(t, str) and t not in task_names]
            fix = (f"pass torch.tensor({[task_names.index(t) if isinstance(t, str) else t for t in given]})"
                   if not unknown else f"{unknown[0]!r} is not one of them")
            raise ValueError(
                f"`task_ids` must hold task indices (a LongTensor of shape (batch,)), got task names {list(given)!r}; "
                f"this model's tasks are {task_names} (task id i is the i-th): {fix}."
            )
        try:
            task_ids = torch.as_tensor(task_ids, device=device)
        except (TypeError, ValueError, RuntimeError) as err:
            raise ValueError(
                f"`task_ids` must be a LongTensor of shape (batch,) holding each row's index into the model's tasks "
                f"{task_names}, got {task_ids!r} ({err})."
            ) from None
    if task_ids.is_floating_point() or task_ids.dtype == torch.bool or task_ids.is_complex():
        raise ValueError(f"`task_ids` must be an integer tensor, got dtype {task_ids.dtype}.")
    if task_ids.dim() != 1 or task_ids.shape[0] != batch_size:
        raise ValueError(
            f"`task_ids` must have shape (batch,) = ({batch_size},) to match the inputs, got {tuple(task_ids.shape)}."
        )
    task_ids = task_ids.long()
    if not check_values:
        return task_ids
    bad = (task_ids < 0) | (task_ids >= num_tasks)
    if bad.any():
        raise ValueError(
            f"Only {num_tasks} tasks available {task_names}: `task_ids` must be in [0, {num_tasks}); found task id = "
            f"{task_ids[bad][0].item()} (row {bad.nonzero()[0, 0].item()})."
        )
    return task_ids


def check_task_counts(task_counts, batch_size: int, task_names: list[str]) -> list[int]:
    """`task_counts` (the rows of each task in the batch, in the model's task order, counted on the host where the
    batch was made: `BatchChecker.check`) as a list of ints, checked against the batch's size without reading
    anything from the device."""
    if isinstance(task_counts, torch.Tensor):
        raise ValueError(
            "`task_counts` must be a tuple of Python ints counted on the host (BatchChecker.check gives it), got a "
            "tensor: reading it back would be the host sync it exists to avoid. Leave it out to count on the device."
        )
    counts = list(task_counts) if isinstance(task_counts, (list, tuple)) else None
    if (
        counts is None
        or len(counts) != len(task_names)
        or any(isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in counts)
        or sum(counts) != batch_size
    ):
        raise ValueError(
            f"`task_counts` must hold one row count per task {task_names} ({len(task_names)} non-negative ints) "
            f"summing to the batch's {batch_size} rows, got {task_counts!r}."
        )
    return counts


def check_input_shapes(input_ids, inputs_embeds, max_length: int | None = None, limit="max_position_embeddings",
                       **per_token: torch.Tensor | None) -> tuple[int, int]:
    """Check that exactly one of `input_ids`/`inputs_embeds` is given, that the batch has rows and tokens (at most
    `max_length`, the model's longest input), and that every other per-token tensor matches its `(batch, seq)`;
    return `(batch, seq)`. `limit`: the name of the config field that sets `max_length`, or a callable giving it
    (called only for the message of an input too long)."""
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("Pass exactly one of `input_ids` or `inputs_embeds`.")
    if input_ids is not None:
        if input_ids.dim() != 2:
            raise ValueError(f"`input_ids` must have shape (batch, seq), got {tuple(input_ids.shape)}.")
        batch, seq = input_ids.shape
    else:
        if inputs_embeds.dim() != 3:
            raise ValueError(f"`inputs_embeds` must have shape (batch, seq, hidden), got {tuple(inputs_embeds.shape)}.")
        batch, seq = inputs_embeds.shape[:2]
    check_lengths(batch, seq, max_length, limit=limit)
    for name, tensor in per_token.items():
        if tensor is None:
            continue
        if name == "position_ids" and tensor.dim() == 2 and tensor.shape[0] == 1 and tensor.shape[1] == seq:
            continue  # broadcast over the batch
        if tensor.dim() != 2 or tuple(tensor.shape) != (batch, seq):
            raise ValueError(f"`{name}` must have shape (batch, seq) = ({batch}, {seq}), got {tuple(tensor.shape)}.")
    return batch, seq


def check_lengths(
    batch: int, seq: int, max_length: int | None, name: str = "input", limit: str = "max_position_embeddings"
) -> None:
    """An empty batch, an empty sequence or one longer than the model takes is refused before any layer runs."""
    if batch == 0:
        raise ValueError(f"The {name} batch is empty (0 rows).")
    if seq == 0:
        raise ValueError(f"The {name} sequences are empty (0 tokens); every row needs at least one token.")
    if max_length is not None and seq > max_length:
        limit = limit() if callable(limit) else limit
        raise ValueError(
            f"The {name} sequences have {seq} tokens; this model takes at most {max_length} (`{limit}`). Truncate them "
            f"(tokenizer(..., truncation=True, max_length={max_length}))."
        )


#: keyword arguments that transformers' Trainer may pass and the families ignore
TOLERATED_KWARGS = frozenset({"num_items_in_batch", "return_loss"})


def check_kwargs(kwargs: dict, forward) -> None:
    """Refuse keyword arguments `forward` does not take (a misspelt `lables=` must not train without a loss)."""
    import difflib
    import inspect

    unknown = sorted(set(kwargs) - TOLERATED_KWARGS)
    if not unknown:
        return
    known = [p for p in inspect.signature(forward).parameters if p not in ("self", "kwargs", "args")]
    hints = {u: difflib.get_close_matches(u, known, n=1) for u in unknown}
    hint = "".join(f" (did you mean `{h[0]}` for `{u}`?)" for u, h in hints.items() if h)
    raise ValueError(f"Unexpected keyword argument(s) {unknown}{hint}; the model's forward takes {known}.")


#: generation keywords that count something: each must be a positive integer (transformers divides by `num_beams`
#: and ends in a ZeroDivisionError on 0)
POSITIVE_GENERATION_KEYWORDS = ("num_beams", "num_beam_groups", "num_return_sequences", "max_new_tokens", "max_length")


def check_generation_counts(generate_kwargs: dict) -> None:
    """Refuse a generation count below 1 (`num_beams=0`, ...) by name, before `generate` runs."""
    for name in POSITIVE_GENERATION_KEYWORDS:
        value = generate_kwargs.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"`{name}` must be a positive integer, got {value!r} (e.g. {name}=4); "
                             f"leave it out to use the model's generation config.")


def check_generation_cache(model, kwargs: dict) -> None:
    """A task-routed model decodes with a dynamic cache only: its routed layers keep one cache slot per expert, which
    a static (fixed-layout) cache cannot hold. A `cache_implementation` other than 'dynamic' -- a keyword of
    `generate`, or set on the `generation_config` passed or on the model's own -- is refused by name and why, before
    transformers builds that cache (and fails with a message about something else)."""
    config = kwargs.get("generation_config") or getattr(model, "generation_config", None)
    asked = kwargs.get("cache_implementation", getattr(config, "cache_implementation", None))
    if asked not in (None, "dynamic"):
        raise ValueError(
            f"{type(model).__name__} cannot decode with a static cache (`cache_implementation={asked!r}`): its routed "
            "layers keep one cache slot per expert, which only the dynamic cache holds. Leave `cache_implementation` "
            "unset (the default dynamic cache)."
        )


def check_id_range(name: str, ids, size: int | None, what: str, fix: str) -> None:
    """Every id of `ids` must index a table of `size` rows (an embedding): one outside is a `ValueError` naming it
    (an `IndexError` deep in the embedding otherwise, or a device-side assert on a GPU)."""
    if size is None or ids is None or not isinstance(ids, torch.Tensor) or ids.numel() == 0:
        return
    if ids.is_floating_point() or ids.dtype == torch.bool:
        raise ValueError(f"`{name}` must hold integer ids, got dtype {ids.dtype}.")
    bad = (ids < 0) | (ids >= size)
    if bad.any():
        row = bad.nonzero()[0].tolist()
        value = int(ids[tuple(row)])
        raise ValueError(
            f"`{name}` holds {value} (row {row[0]}, position {row[-1]}, and {int(bad.sum()) - 1} more out of "
            "range), but "
            f"the model's {what} has {size} entries (ids 0..{size - 1}). {fix}"
        )


def check_token_ids(sizes: dict[str, int | None], **ids: torch.Tensor | None) -> None:
    """Every id must index its table (`sizes`: `token_table_sizes`): `input_ids` / `decoder_input_ids` the vocabulary,
    `token_type_ids` the token type table. One outside is a `ValueError` naming it (an `IndexError: index out of range
    in self` deep in the embedding otherwise, a device-side assert on a GPU). `BatchChecker` checks a batch so on the
    host; a forward that checks values (not `values_checked`) calls it itself. Reads the ids (a host sync)."""
    for name, tensor in ids.items():
        if name == "position_ids":
            check_id_range(name, tensor, sizes.get("position_ids"),
                                   "position table (`max_position_embeddings`)",
                                   "Positions count from 0 along each row; leave `position_ids` out to let the model "
                                   "number them, or truncate the inputs.")
        elif name == "token_type_ids":
            check_id_range(name, tensor, sizes["token_type_ids"], "token type table (`type_vocab_size`)",
                                   "This model takes no second segment ids: tokenise with the model's own tokenizer, "
                                   "or leave `token_type_ids` out.")
        else:
            check_id_range(name, tensor, sizes["input_ids"], "vocabulary (`vocab_size`)",
                                   "The text was tokenised with another tokenizer than the model's: tokenise with the "
                                   "model's own (AutoTokenizer.from_pretrained(<the model's folder>)).")


def token_table_sizes(model) -> dict[str, int | None]:
    """The rows of the tables the model's token ids index: `{"input_ids": vocabulary size, "token_type_ids":
    type_vocab_size, "position_ids": its absolute position table's size}`, None where the model has no such table (a
    family without a token embedding; rotary or relative positions: `position_table_size`)."""
    try:
        embeddings = model.get_input_embeddings()
    except (NotImplementedError, AttributeError):
        embeddings = None
    vocab = getattr(embeddings, "num_embeddings", None) if isinstance(embeddings, torch.nn.Embedding) else None
    types = getattr(model.config, "type_vocab_size", None)
    positions = model.position_table_size() if hasattr(model, "position_table_size") else None
    return {"input_ids": vocab, "token_type_ids": types if isinstance(types, int) else None, "position_ids": positions}


def check_batch_dim(batch: int, **tensors: torch.Tensor | None) -> None:
    for name, tensor in tensors.items():
        if tensor is not None and (tensor.dim() == 0 or tensor.shape[0] != batch):
            raise ValueError(
                f"`{name}` must have {batch} rows (the batch size of the inputs), got shape {tuple(tensor.shape)}."
            )
