import numpy as np
import pytest
from scipy import stats
from sklearn import metrics as skm

from hf_taskmoe import TaskSpec, metrics
from hf_taskmoe.metrics import DEFAULT_METRICS, METRIC_REGISTRY, aggregate_scores, load_metric
from hf_taskmoe.problem_types import compute_task_metrics

rng = np.random.default_rng(0)
REF3 = rng.integers(0, 3, 200)
PRED3 = np.where(rng.random(200) < 0.6, REF3, rng.integers(0, 3, 200))
REF2, PRED2 = REF3 % 2, PRED3 % 2
X = rng.normal(size=100)
Y = 0.5 * X + rng.normal(size=100)
Y_TIES = np.round(Y, 0)


def _compute(name, **inputs):  # through the evaluate module, which calls the registered function
    return load_metric(name).compute(**{k: np.asarray(v).tolist() for k, v in inputs.items()})[name]


@pytest.mark.parametrize(
    "name, preds, refs, reference",
    [
        ("accuracy", PRED3, REF3, skm.accuracy_score(REF3, PRED3)),
        ("f1", PRED2, REF2, skm.f1_score(REF2, PRED2)),
        ("f1_macro", PRED3, REF3, skm.f1_score(REF3, PRED3, average="macro")),
        ("f1_micro", PRED3, REF3, skm.f1_score(REF3, PRED3, average="micro")),
        ("matthews_correlation", PRED2, REF2, skm.matthews_corrcoef(REF2, PRED2)),
        ("matthews_correlation", PRED3, REF3, skm.matthews_corrcoef(REF3, PRED3)),
        ("pearson", X, Y, stats.pearsonr(X, Y)[0]),
        ("spearmanr", X, Y_TIES, stats.spearmanr(X, Y_TIES)[0]),
        ("f1a", PRED2, REF2, skm.f1_score(REF2, PRED2)),
    ],
)
def test_shipped_metrics_match_scipy_and_sklearn(name, preds, refs, reference):
    assert _compute(name, predictions=preds, references=refs) == pytest.approx(reference, abs=1e-12)


def test_multilabel_micro_f1_matches_sklearn():
    refs = rng.integers(0, 2, (50, 4))
    preds = np.where(rng.random((50, 4)) < 0.7, refs, 1 - refs)
    assert _compute("f1_micro", predictions=preds, references=refs) == pytest.approx(
        skm.f1_score(refs, preds, average="micro")
    )


def test_multiple_choice_accuracy_and_exact_match():
    scores = [[0.1, 0.9], [2.0, -1.0], [0.3, 0.2]]
    assert load_metric("multiple_choice_accuracy").compute(predictions=scores, references=[1, 0, 1])[
        "multiple_choice_accuracy"
    ] == pytest.approx(2 / 3)
    em = load_metric("exact_match").compute(predictions=["Yes ", "no", "maybe"], references=["Yes", "No", "maybe"])
    assert em["exact_match"] == pytest.approx(2 / 3)


def test_metrics_load_offline_from_the_package():
    # conftest sets HF_HUB_OFFLINE=1: every default metric loads from the one local evaluate module
    for name in DEFAULT_METRICS:
        assert load_metric(name).config_name == name
    assert [p.name for p in metrics.EVALUATE_MODULE.parent.iterdir() if p.is_dir()] == ["taskmoe_metric"]


def test_compute_task_metrics_per_problem_type():
    cls = TaskSpec(name="c", num_labels=3, metrics=["accuracy", "f1_macro"])
    logits = np.eye(3)[PRED3] + 0.01
    out = compute_task_metrics(cls, logits, REF3)
    assert out["accuracy"] == pytest.approx(skm.accuracy_score(REF3, PRED3))
    assert out["f1_macro"] == pytest.approx(skm.f1_score(REF3, PRED3, average="macro"))

    reg = TaskSpec(name="r", problem_type="regression")
    out = compute_task_metrics(reg, X[:, None], Y)
    assert out["pearson"] == pytest.approx(stats.pearsonr(X, Y)[0])

    tok = TaskSpec(name="t", problem_type="token_classification", num_labels=3)
    labels = np.array([[-100, 1, 2, -100], [-100, 0, -100, -100]])
    logits = np.zeros((2, 5, 3))  # evaluation pads logits to the longest batch
    logits[0, 1, 1] = logits[0, 2, 0] = logits[1, 1, 0] = 1.0
    assert compute_task_metrics(tok, logits, labels)["accuracy"] == pytest.approx(2 / 3)

    multi = TaskSpec(name="m", problem_type="multi_label_classification", num_labels=2)
    out = compute_task_metrics(multi, np.array([[1.0, -1.0], [1.0, 1.0]]), np.array([[1, 0], [0, 1]]))
    assert out["f1_micro"] == pytest.approx(skm.f1_score([[1, 0], [0, 1]], [[1, 0], [1, 1]], average="micro"))


def test_aggregates():
    scores = {"big": 0.9, "small": 0.5, "tiny": 0.7}
    out = aggregate_scores(scores, {"big": 50_000, "small": 3000, "tiny": 10_000}, small_task_threshold=10_000)
    assert out == {"average": pytest.approx(0.7), "small_tasks_average": pytest.approx(0.6)}


def test_roc_auc_scores_the_positive_class_probability():
    logits = rng.normal(size=(300, 2))
    refs = (logits[:, 1] - logits[:, 0] + rng.normal(size=300) > 0).astype(int)
    task = TaskSpec(name="ctr", num_labels=2, metrics=["roc_auc", "accuracy"])
    got = compute_task_metrics(task, logits, refs)
    assert got["roc_auc"] == pytest.approx(skm.roc_auc_score(refs, logits[:, 1] - logits[:, 0]), abs=1e-12)
    assert 0.6 < got["roc_auc"] <= 1.0
    with pytest.raises(ValueError, match="binary task"):
        compute_task_metrics(
            TaskSpec(name="c3", num_labels=3, metrics=["roc_auc"]), rng.normal(size=(10, 3)), np.arange(10) % 3
        )


def test_rouge_against_hand_counts():
    def rouge(name, predictions, references):
        return load_metric(name).compute(predictions=predictions, references=references)[name]

    texts = dict(predictions=["the cat sat on the mat"], references=["The cat was on the mat!"])
    # unigrams: 5 of 6 predicted tokens match (the x2, cat, on, mat) -> P = R = 5/6
    assert rouge("rouge1", **texts) == pytest.approx(5 / 6)
    # bigrams: (the cat), (on the), (the mat) of 5 -> 3/5
    assert rouge("rouge2", **texts) == pytest.approx(3 / 5)
    # LCS: the cat on the mat = 5 -> 5/6
    assert rouge("rougeL", **texts) == pytest.approx(5 / 6)
    assert rouge("rouge1", predictions=[""], references=["x"]) == 0.0


def test_seq2seq_metrics_decode_generated_ids(minilm_tokenizer):
    import numpy as np

    from hf_taskmoe import TaskSpec
    from hf_taskmoe.problem_types import compute_task_metrics
    from hf_taskmoe.training.data import target_token_ids

    task = TaskSpec(name="t", problem_type="seq2seq", metrics=["exact_match", "rouge1"])
    labels = target_token_ids(minilm_tokenizer, ["fresh", "rotten tomatoes"])
    assert [minilm_tokenizer.convert_ids_to_tokens(r) for r in labels] == [
        ["fresh", "[SEP]"],
        ["rotten", "tomatoes", "[SEP]"],
    ]
    labels = np.array([labels[0] + [-100], labels[1]])
    # generated rows after the start token: the answer, [SEP], then padding
    predictions = np.array(
        [[*target_token_ids(minilm_tokenizer, ["fresh"])[0], 0], target_token_ids(minilm_tokenizer, ["rotten x"])[0]]
    )
    out = compute_task_metrics(task, predictions, labels, tokenizer=minilm_tokenizer)
    assert out["exact_match"] == 0.5 and out["rouge1"] == pytest.approx((1 + 1 / 2) / 2)
    with pytest.raises(ValueError, match="tokenizer"):
        compute_task_metrics(task, predictions, labels)


def test_seq2seq_metrics_do_not_hide_a_looping_prefix(minilm_tokenizer):
    """A prediction that repeats [CLS] before the right words is wrong (skip_special_tokens would hide it), and
    everything after the first [SEP] is ignored."""
    import numpy as np

    from hf_taskmoe import TaskSpec
    from hf_taskmoe.metrics import decode_texts
    from hf_taskmoe.problem_types import compute_task_metrics

    cls, sep = minilm_tokenizer.cls_token_id, minilm_tokenizer.sep_token_id
    fresh = minilm_tokenizer.convert_tokens_to_ids("fresh")
    labels = np.array([[fresh, sep], [fresh, sep]])
    predictions = np.array([[cls, cls, fresh, sep], [fresh, sep, cls, cls]])
    assert decode_texts(predictions, minilm_tokenizer) == ["[CLS] [CLS] fresh", "fresh"]
    task = TaskSpec(name="t", problem_type="seq2seq", metrics=["exact_match"])
    assert compute_task_metrics(task, predictions, np.pad(labels, ((0, 0), (0, 2)), constant_values=-100),
                                tokenizer=minilm_tokenizer)["exact_match"] == 0.5


# ------------------------------------------------------------------------------- one mechanism, same numbers
# Fixed inputs, and the values the ten per-metric evaluate modules (hf_taskmoe/metric_modules/<name>/, replaced by
# the registry) gave on them, computed with those modules before they were removed: the registry must give the
# same floats, bit for bit, directly, through its evaluate module, and through evaluation.
F_REF3 = [0, 1, 2, 2, 1, 0, 0, 2, 1, 1, 0, 2, 2, 1, 0, 1, 2, 0, 0, 1]
F_PRED3 = [0, 1, 1, 2, 1, 0, 2, 2, 0, 1, 0, 2, 1, 1, 0, 2, 2, 0, 1, 1]
F_REF2, F_PRED2 = [r % 2 for r in F_REF3], [p % 2 for p in F_PRED3]
F_X = [0.31, -1.2, 0.05, 2.4, 0.77, -0.4, 1.1, -2.3, 0.5, 0.0, 0.92, -0.61]
F_Y = [0.2, -0.9, 0.4, 1.9, 1.0, -0.1, 0.6, -1.7, 0.6, -0.3, 0.6, -0.8]  # ties for spearmanr
F_MULTI_REF = [[1, 0, 1], [0, 1, 0], [1, 1, 0], [0, 0, 1], [1, 0, 0]]
F_MULTI_PRED = [[1, 0, 0], [0, 1, 1], [1, 1, 0], [0, 0, 1], [0, 0, 0]]
F_CHOICES = [[0.1, 0.9, 0.3], [2.0, -1.0, 0.5], [0.3, 0.2, 0.1], [-0.5, 0.4, 0.45], [1.0, 1.5, -2.0]]
F_CHOICE_REF = [1, 0, 1, 2, 1]
F_SCORES = [0.9, 0.2, 0.65, 0.4, 0.8, 0.1, 0.55, 0.3, 0.7, 0.45]
F_SCORE_REF = [1, 0, 1, 0, 1, 0, 0, 1, 1, 0]
F_TEXTS = ["the cat sat on the mat", "Yes ", "rotten tomatoes are fresh", "", "a b c d"]
F_TEXT_REF = ["The cat was on the mat!", "Yes", "fresh tomatoes", "x", "a c b d"]

FIXED_INPUTS = {
    "accuracy": dict(predictions=F_PRED3, references=F_REF3),
    "f1": dict(predictions=F_PRED2, references=F_REF2),
    "f1_macro": dict(predictions=F_PRED3, references=F_REF3),
    "f1_micro": dict(predictions=F_PRED3, references=F_REF3),
    "matthews_correlation": dict(predictions=F_PRED3, references=F_REF3),
    "pearson": dict(predictions=F_X, references=F_Y),
    "spearmanr": dict(predictions=F_X, references=F_Y),
    "f1a": dict(predictions=F_PRED2, references=F_REF2),
    "multiple_choice_accuracy": dict(predictions=F_CHOICES, references=F_CHOICE_REF),
    "exact_match": dict(predictions=F_TEXTS, references=F_TEXT_REF),
    "roc_auc": dict(prediction_scores=F_SCORES, references=F_SCORE_REF),
    "rouge1": dict(predictions=F_TEXTS, references=F_TEXT_REF),
    "rouge2": dict(predictions=F_TEXTS, references=F_TEXT_REF),
    "rougeL": dict(predictions=F_TEXTS, references=F_TEXT_REF),
}
OLD_MODULE_VALUES = {
    "accuracy": 0.7, "f1": 0.6666666666666666, "f1_macro": 0.7008547008547009, "f1_micro": 0.7,
    "matthews_correlation": 0.5509473189696001, "pearson": 0.9669636123818773, "spearmanr": 0.9507278005253982,
    "f1a": 0.6666666666666666, "multiple_choice_accuracy": 0.8, "exact_match": 0.2, "roc_auc": 0.88, "rouge1": 0.7,
    "rouge2": 0.12, "rougeL": 0.5833333333333334,
}
OLD_EVALUATION_VALUES = {
    "cls3": {
        "accuracy": 0.7,
        "f1_macro": 0.7008547008547009,
        "f1_micro": 0.7,
        "matthews_correlation": 0.5509473189696001,
    },
    "bin": {"accuracy": 0.8, "f1": 0.8, "f1a": 0.8000000000000002, "matthews_correlation": 0.6, "roc_auc": 0.88},
    "reg": {"pearson": 0.9669636120976478, "spearmanr": 0.9507278005253982},
    "multi": {"f1_micro": 0.7692307692307693, "f1": 0.7692307692307693},
    "mc": {"multiple_choice_accuracy": 0.8, "accuracy": 0.8},
    "tok": {"accuracy": 0.3333333333333333, "f1_macro": 0.3},
    "gen": {
        "exact_match": 0.3333333333333333,
        "rouge1": 0.8030303030303031,
        "rouge2": 0.22222222222222218,
        "rougeL": 0.8030303030303031,
    },
}


class WordTokenizer:
    """Just enough of a tokenizer for `decode_texts`: ids are positions in a word list."""

    eos_token_id, sep_token_id, pad_token_id = 1, 1, 0
    words = ["[PAD]", "[SEP]", "the", "cat", "sat", "on", "mat", "fresh", "rotten", "tomatoes", "yes", "no"]

    def decode(self, ids, skip_special_tokens=False):
        return " ".join(self.words[i] for i in ids)


def _evaluation_cases():
    """(task, logits, labels) through `compute_task_metrics`, one per problem type, every default metric once."""
    f32 = np.float32
    binary_logits = np.stack([1 - np.array(F_SCORES), np.array(F_SCORES)], 1).astype(f32) * 3.0
    tokens = np.full((2, 6), -100)
    tokens[0, 1:5], tokens[1, 1:3] = [0, 2, 1, 1], [2, 0]
    token_logits = np.zeros((2, 7, 3), dtype=f32)  # evaluation pads logits to the longest batch
    for (row, col), label in np.ndenumerate(np.array([[0, 2, 1, 0, 1, 2], [0, 2, 2, 0, 0, 0]])):
        token_logits[row, col, label] = 1.0
    generated = np.array([[2, 3, 4, 5, 2, 6, 1, 0], [8, 9, 1, 0, 0, 0, 0, 0], [10, 1, 10, 0, 0, 0, 0, 0]])
    targets = np.array([[2, 3, 5, 2, 6, 1, -100, -100], [7, 9, 1, *[-100] * 5], [10, 1, *[-100] * 6]])
    return [
        (
            TaskSpec(name="cls3", num_labels=3, metrics=["accuracy", "f1_macro", "f1_micro", "matthews_correlation"]),
            (np.eye(3)[F_PRED3] + 0.01).astype(f32),
            np.array(F_REF3),
        ),
        (
            TaskSpec(name="bin", num_labels=2, metrics=["accuracy", "f1", "f1a", "matthews_correlation", "roc_auc"]),
            binary_logits,
            np.array(F_SCORE_REF),
        ),
        (
            TaskSpec(name="reg", problem_type="regression", metrics=["pearson", "spearmanr"]),
            np.array(F_X, dtype=f32)[:, None],
            np.array(F_Y, dtype=f32),
        ),
        (
            TaskSpec(name="multi", problem_type="multi_label_classification", num_labels=3, metrics=["f1_micro", "f1"]),
            np.where(np.array(F_MULTI_PRED) == 1, 0.7, -0.4).astype(f32),
            np.array(F_MULTI_REF),
        ),
        (
            TaskSpec(
                name="mc",
                problem_type="multiple_choice",
                choice_fields=["a", "b", "c"],
                metrics=["multiple_choice_accuracy", "accuracy"],
            ),
            np.array(F_CHOICES, dtype=f32),
            np.array(F_CHOICE_REF),
        ),
        (
            TaskSpec(name="tok", problem_type="token_classification", num_labels=3, metrics=["accuracy", "f1_macro"]),
            token_logits,
            tokens,
        ),
        (
            TaskSpec(name="gen", problem_type="seq2seq", metrics=["exact_match", "rouge1", "rouge2", "rougeL"]),
            generated,
            targets,
        ),
    ]


def test_every_default_metric_is_registered_and_gives_the_old_modules_numbers():
    assert set(FIXED_INPUTS) == set(DEFAULT_METRICS) == set(OLD_MODULE_VALUES)
    assert all(METRIC_REGISTRY[name] is DEFAULT_METRICS[name] for name in DEFAULT_METRICS)
    direct = {name: METRIC_REGISTRY[name](*inputs.values()) for name, inputs in FIXED_INPUTS.items()}
    assert direct == OLD_MODULE_VALUES  # bit-identical, not approx
    wrapped = {name: load_metric(name).compute(**inputs)[name] for name, inputs in FIXED_INPUTS.items()}
    assert wrapped == OLD_MODULE_VALUES


def test_evaluation_calls_the_registry_not_evaluate(monkeypatch):
    import evaluate

    def refuse(*args, **kwargs):
        raise AssertionError(f"evaluate.load{args} during evaluation with registered metrics")

    monkeypatch.setattr(evaluate, "load", refuse)
    cases = _evaluation_cases()
    assert {m for task, _, _ in cases for m in task.metrics} == set(DEFAULT_METRICS)
    got = {
        task.name: compute_task_metrics(task, logits, labels, tokenizer=WordTokenizer())
        for task, logits, labels in cases
    }
    assert got == OLD_EVALUATION_VALUES


def test_class_index_metrics_refuse_multi_hot_rows_as_the_old_modules_did():
    multi = TaskSpec(name="m", problem_type="multi_label_classification", num_labels=3, metrics=["accuracy"])
    with pytest.raises(ValueError, match="accuracy needs one class index per example"):
        compute_task_metrics(multi, np.array(F_MULTI_PRED, dtype=np.float32) - 0.5, np.array(F_MULTI_REF))


def test_register_metric_feeds_what_the_metric_reads_and_guards_the_defaults():
    seen = {}

    def mean_score(predictions, references):
        seen["predictions"] = predictions
        return float(np.mean(predictions))

    try:
        metrics.register_metric("mean_positive_score", mean_score, inputs="positive_scores", description="mean score")
        task = TaskSpec(name="b", num_labels=2, metrics=["mean_positive_score", "accuracy"])
        logits = np.array([[0.0, 1.0], [1.0, 0.0]])
        got = compute_task_metrics(task, logits, np.array([1, 0]))
        assert seen["predictions"] == pytest.approx([1 / (1 + np.exp(-1)), 1 / (1 + np.exp(1))])
        assert got == {"mean_positive_score": pytest.approx(0.5), "accuracy": 1.0}
        module = load_metric("mean_positive_score")  # the evaluate face of a user's metric too
        assert module.compute(prediction_scores=[0.2, 0.4], references=[0, 1])["mean_positive_score"] == pytest.approx(
            0.3
        )
        with pytest.raises(ValueError, match="already registered"):
            metrics.register_metric("mean_positive_score", mean_score)
    finally:
        METRIC_REGISTRY.pop("mean_positive_score", None)
    with pytest.raises(ValueError, match="must be a new non-empty name"):
        metrics.register_metric("accuracy", mean_score, overwrite=True)
    with pytest.raises(ValueError, match=r"`inputs` must be one of \['choice_scores', 'labels'"):
        metrics.register_metric("odd", mean_score, inputs="logits")
    assert "odd" not in METRIC_REGISTRY
    with pytest.raises(ValueError, match="takes no config_name"):
        load_metric("f1_micro", "multilabel")
