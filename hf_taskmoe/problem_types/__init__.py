"""Problem types: one class per kind of task (head, labels, tokenisation, loss, metrics, uncertainty, pipeline
output, Hub tag), kept in a registry like the families. See `base.ProblemType` for the hooks a type provides and
the contributor guide for adding one (one file and one `register_problem_type` call)."""

from .base import (
    ENCODER,
    PROBLEM_TYPES,
    TABULAR,
    TEXT_TO_TEXT,
    ProblemType,
    compute_task_metrics,
    get_problem_type,
    problem_type_names,
    problem_type_of,
    register_problem_type,
)
from .classification import DEFAULT_PROBLEM_TYPE  # registers the encoder types
from .extractive_qa import ExtractiveQA  # registers extractive question answering
from .seq2seq import target_token_ids  # registers seq2seq

__all__ = [
    "DEFAULT_PROBLEM_TYPE",
    "ExtractiveQA",
    "ENCODER",
    "PROBLEM_TYPES",
    "TABULAR",
    "TEXT_TO_TEXT",
    "ProblemType",
    "compute_task_metrics",
    "get_problem_type",
    "problem_type_names",
    "problem_type_of",
    "register_problem_type",
    "target_token_ids",
]
