"""Trained by tests/test_distributed.py under `torchrun --nproc_per_node 2` (gloo, CPU): `ddp_train.py OUT FAMILY`,
or `ddp_train.py OUT FAMILY,FAMILY+find_unused,...` for several runs in one launch (one after the other, each in its
own <out>/<run> folder: the processes start once).

DDP runs with a static graph (`find_unused_parameters=False`, the default). Batches of one 3-token row leave
experts without tokens, and homogeneous round-robin batching gives each rank one task per step: the other tasks'
heads (and their PALs, gates or routes) take no part in that rank's loss. Each rank writes its final weights'
checksum and what it saw to <out>/rank<k>.json.
"""

import json
import os
import sys

import datasets
import torch
from transformers import BartConfig, BartForConditionalGeneration

from hf_taskmoe import (
    BartTaskRouted,
    BertForTaskMoE,
    BertPALsConfig,
    BertTaskMoEConfig,
    BertWithPALs,
    CAMTLConfig,
    CAMTLModel,
    TaskSpec,
)
from hf_taskmoe.training import MultiTaskTrainer, MultiTaskTrainingArguments


def train(out, family, engine=None):
    """Train `family` (DDP, or ZeRO with a DeepSpeed config as `engine`) and write <out>/rank<k>.json."""
    os.makedirs(out, exist_ok=True)
    torch.manual_seed(0)
    SIZES = dict(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=24)
    if family == "bart_routed":
        tasks = [TaskSpec(name=n, problem_type="seq2seq") for n in "abc"]
        dense = BartForConditionalGeneration(BartConfig(
            vocab_size=50, d_model=16, encoder_layers=2, decoder_layers=2, encoder_ffn_dim=24, decoder_ffn_dim=24,
            encoder_attention_heads=2, decoder_attention_heads=2, max_position_embeddings=32))
        model = BartTaskRouted.from_dense(dense, tasks, selection="hard")  # hard: only the chosen expert runs
    else:
        tasks = [
            TaskSpec(name="a", num_labels=2),
            TaskSpec(name="b", num_labels=3),
            TaskSpec(name="c", problem_type="regression"),
        ]
        model = {
            "bert_taskmoe": lambda: BertForTaskMoE(BertTaskMoEConfig(tasks=tasks, num_experts=4, **SIZES)),
            "bert_pals": lambda: BertWithPALs(BertPALsConfig(tasks=tasks, pal_size=8, pal_num_heads=2, **SIZES)),
            "camtl": lambda: CAMTLModel(CAMTLConfig(tasks=tasks, conditional_attention_max_length=8, **SIZES)),
        }[family]()
    g = torch.Generator().manual_seed(1)

    def labels(task):
        if task.problem_type == "seq2seq":
            return torch.randint(3, 50, (12, 4), generator=g).tolist()
        if task.problem_type == "regression":
            return torch.randn(12, generator=g).tolist()
        return torch.randint(0, task.num_labels, (12,), generator=g).tolist()

    train_sets = {
        t.name: datasets.Dataset.from_dict(
            {
                "input_ids": torch.randint(3, 50, (12, 3), generator=g).tolist(),
                "attention_mask": [[1, 1, 1]] * 12,
                "labels": labels(t),
            }
        )
        for t in tasks
    }
    seen = []
    args = MultiTaskTrainingArguments(
        output_dir=os.path.join(out, "run"),
        use_cpu=True,
        ddp_backend="gloo",
        per_device_train_batch_size=1,
        max_steps=6,
        learning_rate=1e-2,
        task_sampling="round_robin",
        batching="homogeneous",
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        seed=0,
        **({"ddp_find_unused_parameters": True} if engine == "find_unused"
           else {"deepspeed": engine} if engine else {}),
    )
    trainer = MultiTaskTrainer(model=model, args=args, train_dataset=train_sets)
    collate = trainer.data_collator
    trainer.data_collator = lambda feats: (lambda b: (seen.append(b["task_ids"].tolist()), b)[1])(collate(feats))
    trainer.train()
    ddp = trainer.model_wrapped
    checksum = sum(float(p.detach().double().sum()) for p in model.parameters())
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        task_losses = [
            sorted(k for k in h if k[:-5] in ("a", "b", "c") and k.endswith("_loss"))
            for h in trainer.state.log_history
            if "loss" in h
        ]
        json.dump({"checksum": checksum, "seen": seen, "world": trainer.args.world_size, "task_losses": task_losses,
                   "find_unused_parameters": getattr(ddp, "find_unused_parameters", None),
                   "wrapper": type(ddp).__name__,
                   "zero_stage": ddp.zero_optimization_stage() if hasattr(ddp, "zero_optimization_stage") else None,
                   "loss": trainer.state.log_history[-1].get("train_loss")}, f)


out = sys.argv[1]
engine = sys.argv[3] if len(sys.argv) > 3 else None  # a DeepSpeed config (ZeRO) instead of DDP, or "find_unused"
rank = int(os.environ["RANK"])
if "," in sys.argv[2]:  # several runs in one launch, one after the other: <out>/<family>[+find_unused]/rank<k>.json
    for run in sys.argv[2].split(","):
        family, _, option = run.partition("+")
        train(os.path.join(out, run), family, option or engine)
else:
    train(out, sys.argv[2], engine)
# Leave the process group explicitly, then skip the interpreter's teardown: about one run in five under pytest on a
# busy 2-core machine aborted *after* training and writing its results ("terminate called without an active
# exception", SIGABRT: a native thread still joinable at interpreter exit; cause not found). What this script
# checks is training, so it ends here; the abort is noted as an open question in the scale-out issue.
if torch.distributed.is_initialized():
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
