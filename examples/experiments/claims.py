#!/usr/bin/env python
"""The papers' claims, checked from the results files alone, with the suite's one rule: a difference of means counts
only when it exceeds twice the larger standard deviation over seeds (`report.verdict`).

MT-TaG's three claims (section 5; `claims.py` or `claims.py mt_tag`):

(i) low-resource transfer: each multi-task model against single-task fine-tuning on the small tasks (main).
(ii) unseen related task: the held-out task learnt from 1% and 10% of its data by each adapted model against
     single-task, and MT-TaG's new gate copied from a related task against an unrelated one and a random one.
(iii) robustness to unrelated tasks: the related tasks' scores trained alone (robustness) and beside unrelated tasks
     (main), per model.

The task-level MoE paper's three findings on the text-to-text experiment (Ye et al. section 5; `claims.py
text2text`), on the five-task average of each seed (a task's score is the mean of its metrics):
(1) average routing >= multi-task dense BART: reproduced when average routing is higher or no different, not
    reproduced when it is lower;
(2) Gumbel-softmax straight-through is the best selection function: reproduced when it is higher than every other
    selection function that ran (hard, softmax, gumbel_softmax), not reproduced otherwise (no difference included:
    the paper's finding is that the choice matters);
(3) the learned routers do not beat the multi-task baseline: reproduced when no routed model (gumbel_st, hard, ...)
    is higher than multi-task dense BART, not reproduced when one is.
Each is "inconclusive" while a side has fewer than two seeds. Section 7 in the small (text2text_unseen: TREC left
out, learnt from 5 few-shot samples): the average relative gain (ARG) of the multi-task dense and the routing BART
over single-task BART, per (seed, sample) pair, and the paper's finding that multi-task BART gains over single-task
and is not below routing BART (the scores compared pairwise over the (seed, sample) pairs, same rule).

    python examples/experiments/claims.py [mt_tag|text2text] [--results examples/experiments/results] [--suffix ""]

Prints markdown tables (differences x100 with their verdicts).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import current, load_records, mean_std, verdict  # noqa: E402

MULTI_TASK = ("mt_dense", "mt_switch", "mt_tag", "pals", "camtl")


def per_seed(records, method, task, variant=None) -> dict:
    """A method's score on `task` by seed, for one variant; with `variant="*"`, by (seed, variant) over them all."""
    every = variant == "*"
    return {((r["seed"], r.get("variant")) if every else r["seed"]): r["scores"][task] for r in records
            if r["method"] == method and (every or r.get("variant") == variant) and task in r.get("scores", {})}


def paired(a: dict[int, float], b: dict[int, float]) -> tuple[list[float], list[float]]:
    seeds = sorted(set(a) & set(b))
    return [a[s] for s in seeds], [b[s] for s in seeds]


def row(label: str, a: list[float], b: list[float], unit: str = "seeds") -> str:
    if not a or not b:
        return f"| {label} | - | - | - | not run |"
    (ma, sa), (mb, sb) = mean_std(a), mean_std(b)
    return (f"| {label} | {100 * ma:.2f} ± {100 * sa:.2f} | {100 * mb:.2f} ± {100 * sb:.2f} | {100 * (ma - mb):+.2f} | "
            f"{verdict(a, b)} ({len(a)} {unit}) |")


def claim_low_resource(main: list[dict], small: list[str]) -> str:
    lines = ["| model vs single-task, task | model | single-task | difference | verdict |", "|---|---|---|---|---|"]
    for method in MULTI_TASK:
        for task in small:
            a, b = paired(per_seed(main, method, task), per_seed(main, "single_task", task))
            lines.append(row(f"{method}, {task}", a, b))
    return "\n".join(lines)


def claim_unseen(unseen: list[dict], task: str) -> str:
    lines = ["| comparison (data) | first | second | difference | verdict |", "|---|---|---|---|---|"]
    for variant in ("1pct", "10pct"):
        for method in ("mt_dense", "mt_switch", "mt_tag_related", "mt_tag_unrelated", "mt_tag_random"):
            a, b = paired(per_seed(unseen, method, task, variant), per_seed(unseen, "single_task", task, variant))
            lines.append(row(f"{method} vs single-task ({variant})", a, b))
        for other in ("mt_tag_unrelated", "mt_tag_random", "mt_dense", "mt_switch"):
            a, b = paired(per_seed(unseen, "mt_tag_related", task, variant), per_seed(unseen, other, task, variant))
            lines.append(row(f"mt_tag_related vs {other} ({variant})", a, b))
    return "\n".join(lines)


def claim_robustness(main: list[dict], clean: list[dict], common: list[str]) -> str:
    lines = [
        "| model, task | beside unrelated tasks | related tasks alone | difference | verdict |",
        "|---|---|---|---|---|",
    ]
    for method in ("mt_dense", "mt_switch", "mt_tag"):
        for task in [*common, "average"]:
            if task == "average":
                noisy = {s: statistics.mean(per_seed(main, method, t)[s] for t in common)
                         for s in set.intersection(*(set(per_seed(main, method, t)) for t in common))}
                alone = {s: statistics.mean(per_seed(clean, method, t)[s] for t in common)
                         for s in set.intersection(*(set(per_seed(clean, method, t)) for t in common))}
            else:
                noisy, alone = per_seed(main, method, task), per_seed(clean, method, task)
            a, b = paired(noisy, alone)
            lines.append(row(f"{method}, {task}", a, b))
    return "\n".join(lines)


def seed_averages(records: list[dict], method: str, tasks: list[str]) -> dict[int, float]:
    """`{seed: mean of that seed's task scores}` over the seeds that scored every task (single-task methods gather
    their per-task cells by seed)."""
    runs = [per_seed(records, method, t) for t in tasks]
    seeds = set.intersection(*(set(r) for r in runs)) if runs else set()
    return {s: statistics.mean(r[s] for r in runs) for s in sorted(seeds)}


def averages(main: list[dict], tasks: list[str], small: list[str]) -> str:
    """Every multi-task model against single-task and MT-TaG against the others, on the all-task and small-task
    averages (per seed: the mean of that seed's task scores)."""
    lines = ["| comparison, average | first | second | difference | verdict |", "|---|---|---|---|---|"]
    pairs = [(m, "single_task") for m in MULTI_TASK] + [("mt_tag", m) for m in MULTI_TASK if m != "mt_tag"]
    for first, second in pairs:
        for label, names in (("all tasks", tasks), ("small tasks", small)):
            a, b = paired(seed_averages(main, first, names), seed_averages(main, second, names))
            lines.append(row(f"{first} vs {second}, {label}", a, b))
    return "\n".join(lines)


TEXT2TEXT_TASKS = ["rotten_tomatoes", "trec", "sms_spam", "newsgroups", "xsum"]
SELECTION = ("gumbel_st", "hard", "softmax", "gumbel_softmax")  # method names of the learned selection functions


def finding(verdicts: list[str], reproduced, not_reproduced) -> str:
    """'inconclusive' when any comparison is, else which of the two predicates over the verdicts holds."""
    if not verdicts or "inconclusive" in verdicts:
        return "inconclusive"
    return "reproduced" if reproduced(verdicts) else "not reproduced" if not_reproduced(verdicts) else "inconclusive"


def claims_text2text(records: list[dict], tasks: list[str] = TEXT2TEXT_TASKS) -> str:
    """Ye et al.'s three findings (module docstring) on the per-seed five-task averages: one row per comparison,
    then one line per finding with its outcome."""
    avg = {m: seed_averages(records, m, tasks) for m in ("single_task", "mt_dense", "average", *SELECTION)}
    ran = [m for m in SELECTION if avg[m]]

    def compare(a: str, b: str) -> tuple[str, str]:
        first, second = paired(avg[a], avg[b])
        return row(f"{a} vs {b}", first, second), verdict(first, second) if first else "inconclusive"

    lines = ["| comparison, five-task average | first | second | difference | verdict |", "|---|---|---|---|---|"]
    results = {}
    pairs = [("average", "mt_dense")] + [("gumbel_st", m) for m in ran if m != "gumbel_st"] + \
        [(m, "mt_dense") for m in ran] + [(m, "single_task") for m in ("mt_dense", "average", *ran)]
    for a, b in dict.fromkeys(pairs):
        text, results[(a, b)] = compare(a, b)
        lines.append(text)
    others = [results[("gumbel_st", m)] for m in ran if m != "gumbel_st"]
    routed = [results[(m, "mt_dense")] for m in ran]
    outcomes = [
        ("average routing >= multi-task dense BART",
         finding([results[("average", "mt_dense")]], lambda v: v[0] != "lower", lambda v: v[0] == "lower")),
        (f"Gumbel-ST is the best selection function (against {', '.join(m for m in ran if m != 'gumbel_st') or '-'})",
         finding(others if avg["gumbel_st"] else [], lambda v: all(x == "higher" for x in v), lambda v: True)),
        ("the learned routers do not beat multi-task dense BART",
         finding(routed, lambda v: "higher" not in v, lambda v: "higher" in v)),
    ]
    lines += ["", "| finding (Ye et al. section 5) | outcome |", "|---|---|"]
    lines += [f"| {claim} | {outcome} |" for claim, outcome in outcomes]
    return "\n".join(lines)


def claims_text2text_unseen(records: list[dict], task: str = "trec") -> str:
    """Section 7 in the small: each few-shot method against single-task BART (and dense against routing) over the
    (seed, few-shot sample) pairs both ran: scores, ARG (mean relative gain, x100, ± std over the pairs), verdict."""
    from hf_taskmoe.analysis.task_routing import average_relative_gain

    runs = {
        m: per_seed(records, m, task, variant="*") for m in ("fewshot_single_task", "fewshot_dense", "fewshot_routing")
    }
    lines = [f"| {task}, few-shot | first | second | difference | verdict | ARG of first over second |",
             "|---|---|---|---|---|---|"]
    for a, b in (("fewshot_dense", "fewshot_single_task"), ("fewshot_routing", "fewshot_single_task"),
                 ("fewshot_dense", "fewshot_routing")):
        first, second = paired(runs[a], runs[b])
        gains = [average_relative_gain({task: y}, {task: x}) for x, y in zip(first, second) if y > 0]
        arg = f"{100 * mean_std(gains)[0]:+.1f} ± {100 * mean_std(gains)[1]:.1f}%" if gains else "-"
        lines.append(f"{row(f'{a} vs {b}', first, second, unit='seed x sample pairs')} {arg} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("claims", nargs="?", choices=["mt_tag", "text2text"], default="mt_tag")
    parser.add_argument("--results", default=str(Path(__file__).resolve().parent / "results"))
    parser.add_argument("--suffix", default="", help="Results file suffix, e.g. _gpu for main_gpu.jsonl.")
    args = parser.parse_args(argv)
    folder = Path(args.results)
    load = lambda name: load_records(folder / f"{name}{args.suffix}.jsonl")  # noqa: E731
    if args.claims == "text2text":
        for title, name, claims in (
            ("Task-level MoE over BART: the paper's three findings", "text2text", claims_text2text),
            ("Section 7 in the small: TREC unseen, 5 few-shot samples", "text2text_unseen", claims_text2text_unseen),
        ):
            print(f"### {title} ({name})\n")
            records, stale = current(load(name), Path(__file__).resolve().parent / "configs" / f"{name}.json")
            print(claims(records))
            if stale:
                print(f"\n({len(stale)} record(s) ran other options than configs/{name}.json gives now; left out.)")
            print()
        return 0
    main_records, clean, unseen = load("main"), load("robustness"), load("unseen_task")
    print("### Averages\n")
    print(averages(main_records, ["rotten_tomatoes", "trec", "tweet_sentiment", "amazon_sentiment", "sms_spam"],
                   ["amazon_sentiment", "sms_spam"]))
    print("\n### (i) Low-resource transfer: small tasks, multi-task model vs single-task\n")
    print(claim_low_resource(main_records, ["amazon_sentiment", "sms_spam"]))
    print("\n### (ii) Unseen related task (movie_sentiment)\n")
    print(claim_unseen(unseen, "movie_sentiment"))
    print("\n### (iii) Robustness to unrelated tasks: the related tasks beside trec and sms_spam vs alone\n")
    print(claim_robustness(main_records, clean, ["rotten_tomatoes", "tweet_sentiment", "amazon_sentiment"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
