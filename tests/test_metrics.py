import numpy as np
import pytest
from scipy import stats
from sklearn import metrics as skm

from hf_taskmoe import TaskSpec
from hf_taskmoe.metrics import SHIPPED_METRICS, aggregate_scores, compute_task_metrics, load_metric

rng = np.random.default_rng(0)
REF3 = rng.integers(0, 3, 200)
PRED3 = np.where(rng.random(200) < 0.6, REF3, rng.integers(0, 3, 200))
REF2, PRED2 = REF3 % 2, PRED3 % 2
X = rng.normal(size=100)
Y = 0.5 * X + rng.normal(size=100)
Y_TIES = np.round(Y, 0)


def _compute(name, **inputs):
    module, kwargs, key = SHIPPED_METRICS[name]
    config = "multilabel" if np.asarray(inputs["predictions"]).ndim == 2 and name.startswith("f1") else None
    return load_metric(name, config).compute(**{k: np.asarray(v).tolist() for k, v in inputs.items()}, **kwargs)[key]


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
    assert _compute("f1_micro", predictions=preds, references=refs) == pytest.approx(skm.f1_score(refs, preds, average="micro"))


def test_multiple_choice_accuracy_and_exact_match():
    scores = [[0.1, 0.9], [2.0, -1.0], [0.3, 0.2]]
    assert load_metric("multiple_choice_accuracy").compute(predictions=scores, references=[1, 0, 1])["multiple_choice_accuracy"] == pytest.approx(2 / 3)
    em = load_metric("exact_match").compute(predictions=["Yes ", "no", "maybe"], references=["Yes", "No", "maybe"])
    assert em["exact_match"] == pytest.approx(2 / 3)


def test_metrics_load_offline_from_the_package():
    # conftest sets HF_HUB_OFFLINE=1: every shipped module loads from its local folder
    for name in SHIPPED_METRICS:
        assert load_metric(name) is not None


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
        compute_task_metrics(TaskSpec(name="c3", num_labels=3, metrics=["roc_auc"]), rng.normal(size=(10, 3)), np.arange(10) % 3)


def test_rouge_against_hand_counts():
    from hf_taskmoe.metrics import load_metric

    rouge = load_metric("rouge1")
    out = rouge.compute(predictions=["the cat sat on the mat"], references=["The cat was on the mat!"])
    # unigrams: 5 of 6 predicted tokens match (the x2, cat, on, mat) -> P = R = 5/6
    assert out["rouge1"] == pytest.approx(5 / 6)
    # bigrams: (the cat), (on the), (the mat) of 5 -> 3/5
    assert out["rouge2"] == pytest.approx(3 / 5)
    # LCS: the cat on the mat = 5 -> 5/6
    assert out["rougeL"] == pytest.approx(5 / 6)
    assert rouge.compute(predictions=[""], references=["x"])["rouge1"] == 0.0


def test_seq2seq_metrics_decode_generated_ids(minilm_tokenizer):
    import numpy as np

    from hf_taskmoe import TaskSpec
    from hf_taskmoe.metrics import compute_task_metrics
    from hf_taskmoe.training.data import target_token_ids

    task = TaskSpec(name="t", problem_type="seq2seq", metrics=["exact_match", "rouge1"])
    labels = target_token_ids(minilm_tokenizer, ["fresh", "rotten tomatoes"])
    assert [minilm_tokenizer.convert_ids_to_tokens(r) for r in labels] == [["fresh", "[SEP]"], ["rotten", "tomatoes", "[SEP]"]]
    labels = np.array([labels[0] + [-100], labels[1]])
    # generated rows after the start token: the answer, [SEP], then padding
    predictions = np.array([[*target_token_ids(minilm_tokenizer, ["fresh"])[0], 0], target_token_ids(minilm_tokenizer, ["rotten x"])[0]])
    out = compute_task_metrics(task, predictions, labels, tokenizer=minilm_tokenizer)
    assert out["exact_match"] == 0.5 and out["rouge1"] == pytest.approx((1 + 1 / 2) / 2)
    with pytest.raises(ValueError, match="tokenizer"):
        compute_task_metrics(task, predictions, labels)


def test_seq2seq_metrics_do_not_hide_a_looping_prefix(minilm_tokenizer):
    """A prediction that repeats [CLS] before the right words is wrong (skip_special_tokens would hide it), and
    everything after the first [SEP] is ignored."""
    import numpy as np

    from hf_taskmoe import TaskSpec
    from hf_taskmoe.metrics import compute_task_metrics, decode_texts

    cls, sep = minilm_tokenizer.cls_token_id, minilm_tokenizer.sep_token_id
    fresh = minilm_tokenizer.convert_tokens_to_ids("fresh")
    labels = np.array([[fresh, sep], [fresh, sep]])
    predictions = np.array([[cls, cls, fresh, sep], [fresh, sep, cls, cls]])
    assert decode_texts(predictions, minilm_tokenizer) == ["[CLS] [CLS] fresh", "fresh"]
    task = TaskSpec(name="t", problem_type="seq2seq", metrics=["exact_match"])
    assert compute_task_metrics(task, predictions, np.pad(labels, ((0, 0), (0, 2)), constant_values=-100),
                                tokenizer=minilm_tokenizer)["exact_match"] == 0.5
