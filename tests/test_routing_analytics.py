import json

import pytest
import torch
from huggingface_hub import ModelCard

from hf_taskmoe import BertForTaskMoE, BertWithPALs
from hf_taskmoe.analysis.routing import RoutingStatistics
from hf_taskmoe.training import RoutingAnalyticsCallback

from .conftest import random_batch, tiny_config
from .test_bert_pals import pals_config
from .test_trainer import TASKS, make_trainer


def test_logged_values_match_routing_counted_by_hand():
    torch.manual_seed(0)
    model = BertForTaskMoE(tiny_config(num_experts=3)).eval()
    batch = random_batch(model.config, task_ids=torch.tensor([0, 1, 0, 1, 0, 0]), pad_last=3)
    with torch.no_grad():
        out = model(**batch, output_router_logits=True)
    callback = RoutingAnalyticsCallback(model)
    callback.record(out.routing_counts)
    logs = callback.pop_metrics()

    real = batch["attention_mask"].bool()
    for t, task in enumerate(model.config.task_names):
        rows = batch["task_ids"] == t
        unused = 0
        for layer, chosen in enumerate(out.expert_indices):  # (batch, seq, top_k)
            picks = chosen[rows][real[rows]][:, 0]  # this task's real tokens
            shares = torch.bincount(picks, minlength=3).double() / len(picks)
            unused += int((shares == 0).sum())
            for e in range(3):
                assert logs[f"routing/{task}/L{layer}/expert{e}"] == pytest.approx(shares[e].item(), abs=1e-4)
        assert logs[f"routing/{task}/unused_experts"] == unused
        assert 0.0 <= logs[f"routing/{task}/entropy"] <= 1.0
    assert callback.pop_metrics() == {}  # the window starts afresh after each log
    assert callback.total.counts is not None


def test_statistics_survive_their_dict_and_refuse_a_damaged_one(tmp_path):
    torch.manual_seed(0)
    model = BertForTaskMoE(tiny_config(num_experts=3)).eval()
    with torch.no_grad():
        out = model(**random_batch(model.config, task_ids=torch.tensor([0, 1, 0, 1, 0, 0]), pad_last=3),
                    output_router_logits=True)
    stats = RoutingStatistics.from_output(out, model)
    back = RoutingStatistics.from_dict(json.loads(json.dumps(stats.to_dict())))
    assert back.task_names == stats.task_names and back.layers == stats.layers and back.unit == stats.unit
    assert torch.allclose(back.shares, stats.shares, atol=1e-4) and torch.allclose(
        back.entropy, stats.entropy, atol=1e-3
    )
    assert torch.equal(back.tokens.round().long(), stats.tokens)
    assert back.plot(tmp_path / "back.png").stat().st_size > 0
    broken = stats.to_dict()
    del broken["tasks"][model.config.task_names[0]]["per_layer"]
    with pytest.raises(ValueError, match="missing 'per_layer'"):
        RoutingStatistics.from_dict(broken)


def test_shared_routes_count_the_layers_where_two_tasks_pick_the_same_expert():
    stats = RoutingStatistics(["a", "b", "c"], layers=[0, 1, 2], num_experts=3, unit="examples")
    stats.counts = torch.tensor([
        [[10, 0, 0], [6, 4, 0], [0, 0, 10]],   # layer 0: a and b on expert 0 (b by 60%), c on 2
        [[0, 10, 0], [0, 10, 0], [0, 10, 0]],  # layer 1: all three on expert 1
        [[5, 5, 0], [5, 5, 0], [0, 0, 8]],     # layer 2: a and b undecided (no expert over half), c on 2
    ])
    assert stats.shared_routes().tolist() == [[2, 2, 1], [2, 2, 1], [1, 1, 3]]
    stats.counts = torch.full((3, 3, 3), 1.0)  # average routing: every expert a third, nothing decided
    assert stats.shared_routes().sum() == 0


def test_training_logs_routing_and_writes_it_with_checkpoints_and_card(tmp_path):
    torch.manual_seed(0)
    model = BertForTaskMoE(tiny_config(tasks=TASKS, num_experts=3))
    trainer = make_trainer(tmp_path, model=model, log_routing=True, max_steps=4, logging_steps=2,
                           save_strategy="steps", save_steps=2)
    trainer.train()
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logged) == 2
    for entry in logged:
        tasks = {k.split("/")[1] for k in entry if k.startswith("routing/")}
        assert tasks and tasks <= {"a", "b", "c"}
        for task in tasks:
            shares = [entry[f"routing/{task}/L0/expert{e}"] for e in range(3)]
            assert sum(shares) == pytest.approx(1.0, abs=1e-3)
    checkpoint = tmp_path / "run" / "checkpoint-2"
    summary = json.loads((checkpoint / "routing_train.json").read_text())
    assert set(summary["tasks"]) == {"a", "b", "c"} and (checkpoint / "routing_train_heatmap.png").exists()
    assert (tmp_path / "run" / "routing_train_heatmap.png").exists()
    trainer.create_model_card()
    card = ModelCard.load(tmp_path / "run" / "README.md")
    assert "training tokens per expert" in card.content and "routing_train_heatmap.png" in card.content


def test_routing_analytics_refuse_a_model_without_experts(tmp_path):
    with pytest.raises(ValueError, match="MoE layers"):
        make_trainer(tmp_path, model=BertWithPALs(pals_config(tasks=TASKS)), log_routing=True)
    with pytest.raises(ValueError, match="MoE layers"):
        make_trainer(tmp_path, model=BertForTaskMoE(tiny_config(tasks=TASKS, num_experts=1)), log_routing=True)


def test_summary_counts_every_step_once_across_logs_and_checkpoints():
    model = BertForTaskMoE(tiny_config(num_experts=3))
    callback = RoutingAnalyticsCallback(model)
    steps = [torch.randint(0, 5, (2, 2, 3)) for _ in range(3)]
    callback.record(steps[0])
    callback._sync_total()  # a checkpoint between two logs
    callback.record(steps[1])
    assert callback.pop_metrics()  # the log covers steps 0 and 1
    callback.record(steps[2])
    callback._sync_total()  # end of training
    assert torch.equal(callback.total.counts, steps[0] + steps[1] + steps[2])


@pytest.mark.parametrize("selection", ["softmax", "gumbel_softmax_st"])
def test_task_level_routing_logged_values_match_decisions_by_hand(selection):
    """BartTaskRouted: each row adds its task's routing decision; shares are per task, per routed layer."""
    from .test_bart_routed import batch as bart_batch
    from .test_bart_routed import routed

    model = routed(selection).train()  # training: Gumbel noise per task for ST, soft weights for softmax
    b = bart_batch(rows=7)
    torch.manual_seed(3)
    out = model(**b, output_router_logits=True)
    callback = RoutingAnalyticsCallback(model)
    callback.record(out.routing_counts)
    logs = callback.pop_metrics()
    decisions = out.routing_decisions.detach()  # (rows, routed layers, experts)
    for t, task in enumerate(model.config.task_names):
        rows = decisions[b["task_ids"] == t]
        shares = rows.sum(0) / rows.sum(0).sum(-1, keepdim=True)  # (layers, experts)
        for i, name in enumerate(model.config.route_names):
            for e in range(model.config.num_experts):
                assert logs[f"routing/{task}/{name}/expert{e}"] == pytest.approx(shares[i, e].item(), abs=1e-4)
        assert logs[f"routing/{task}/unused_experts"] == int((shares == 0).sum())
        p = shares.clamp(min=1e-12)
        entropy = (-(shares * p.log()).sum(-1) / torch.log(torch.tensor(3.0))).mean()
        assert logs[f"routing/{task}/entropy"] == pytest.approx(entropy.item(), abs=1e-4)
    if selection == "gumbel_softmax_st":  # hard routes: one expert per (task, layer) in a batch
        assert all(logs[f"routing/{t}/unused_experts"] == 2 * 4 for t in model.config.task_names)
    summary = callback.total.to_dict()
    assert summary["unit"] == "examples" and summary["layers"] == model.config.route_names
    assert summary["tasks"]["cls"]["examples"] == pytest.approx(3.0)  # rows 0, 3, 6


def test_routing_reaches_tensorboard_event_files(tmp_path, monkeypatch):
    """report_to="tensorboard": the routing figures of each log are scalars in the event files, at the logged step."""
    pytest.importorskip("tensorboard", reason="pip install -e '.[test]' installs tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "tb"))  # transformers 5: no `logging_dir` argument
    torch.manual_seed(0)
    model = BertForTaskMoE(tiny_config(tasks=TASKS, num_experts=3))
    trainer = make_trainer(
        tmp_path, model=model, log_routing=True, max_steps=4, logging_steps=2, report_to="tensorboard"
    )
    trainer.train()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    written = {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}
    logged = [h for h in trainer.state.log_history if "loss" in h]
    checked = 0
    for entry in logged:
        for key, value in entry.items():
            if key.startswith("routing/"):
                assert written[f"train/{key}"][entry["step"]] == pytest.approx(value, abs=1e-6)
                checked += 1
    assert checked >= 2 * (3 + 2)  # two logs, each with at least one task's 3 shares + entropy + unused


def test_mmoe_gates_with_a_plain_trainer(tmp_path):
    """MMoE: each task's gate weights summed over the rows; `add_to` brings the callback to a plain Trainer
    (through the README's snippet)."""
    import datasets
    import numpy as np
    from transformers import TrainingArguments

    from hf_taskmoe import MMoEModel

    from .test_docs import _snippet
    from .test_mmoe import batch as tabular_batch
    from .test_mmoe import config as mmoe_config

    torch.manual_seed(0)
    model = MMoEModel(mmoe_config()).eval()
    out = model(**tabular_batch(), output_router_logits=True)
    callback = RoutingAnalyticsCallback(model)
    callback.record(out.routing_counts)
    logs = callback.pop_metrics()
    for t, task in enumerate(model.config.task_names):
        mean_gate = out.gate_weights[:, t].detach().mean(0)  # every row passes every task's gate
        for e in range(4):
            assert logs[f"routing/{task}/gates/expert{e}"] == pytest.approx(mean_gate[e].item(), abs=1e-4)
    with pytest.raises(ValueError, match="routes nothing"):
        RoutingAnalyticsCallback(MMoEModel(mmoe_config(architecture="shared_bottom")))

    rng = np.random.default_rng(0)
    rows = {
        "age": rng.normal(size=64).tolist(),
        "price": rng.normal(size=64).tolist(),
        "city": rng.integers(0, 5, 64).tolist(),
        "device": rng.integers(0, 3, 64).tolist(),
        "click": rng.integers(0, 2, 64).tolist(),
        "genre": rng.integers(0, 3, 64).tolist(),
        "rating": rng.normal(size=64).tolist(),
    }
    args = TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=16,
        max_steps=6,
        logging_steps=3,
        report_to="none",
        use_cpu=True,
        remove_unused_columns=False,
        save_strategy="no",
        disable_tqdm=True,
    )
    model = MMoEModel(mmoe_config())
    scope = {"mmoe": model, "args": args, "data": datasets.Dataset.from_dict(rows)}
    exec(compile(_snippet("### Gates of MMoEModel with a plain `Trainer`"), "README MMoE analytics", "exec"), scope)
    trainer, analytics = scope["trainer"], scope["analytics"]
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logged) == 2
    for entry in logged:
        for task in model.config.task_names:
            assert sum(entry[f"routing/{task}/gates/expert{e}"] for e in range(4)) == pytest.approx(1.0, abs=1e-3)
    summary = json.loads((tmp_path / "routing_train.json").read_text())
    assert summary["unit"] == "examples" and summary["tasks"]["click"]["examples"] == pytest.approx(6 * 16, abs=1e-3)
    assert analytics.total.shares.shape == (1, 3, 4)
    with torch.no_grad():  # the hooks only act in training
        assert model.eval()(**tabular_batch()).routing_counts is None
