"""Trained by tests/test_distributed.py under `torchrun --nproc_per_node 2` (gloo, CPU).

Batches of one 3-token row over 4 experts leave at least one expert per layer without tokens on every
rank, and homogeneous round-robin batching gives each rank one task per step: other heads get no rows.
Each rank writes its final weights' checksum and what it saw to <out>/rank<k>.json.
"""

import json
import os
import sys

import datasets
import torch

from hf_taskmoe import BertForTaskMoE, BertTaskMoEConfig, TaskSpec
from hf_taskmoe.training import MultiTaskTrainer, MultiTaskTrainingArguments

out = sys.argv[1]
rank = int(os.environ["RANK"])
torch.manual_seed(0)
tasks = [TaskSpec(name="a", num_labels=2), TaskSpec(name="b", num_labels=3), TaskSpec(name="c", problem_type="regression")]
config = BertTaskMoEConfig(tasks=tasks, vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                           intermediate_size=24, num_experts=4)
model = BertForTaskMoE(config)
g = torch.Generator().manual_seed(1)
train = {
    t.name: datasets.Dataset.from_dict({
        "input_ids": torch.randint(1, 50, (12, 3), generator=g).tolist(),
        "attention_mask": [[1, 1, 1]] * 12,
        "labels": (torch.randn(12, generator=g).tolist() if t.problem_type == "regression"
                   else torch.randint(0, t.num_labels, (12,), generator=g).tolist()),
    })
    for t in tasks
}
seen = []
args = MultiTaskTrainingArguments(
    output_dir=os.path.join(out, "run"), use_cpu=True, ddp_backend="gloo", per_device_train_batch_size=1,
    max_steps=6, learning_rate=1e-2, task_sampling="round_robin", batching="homogeneous", report_to="none",
    save_strategy="no", logging_steps=1, disable_tqdm=True, seed=0,
)
trainer = MultiTaskTrainer(model=model, args=args, train_dataset=train)
collate = trainer.data_collator
trainer.data_collator = lambda feats: (lambda b: (seen.append(b["task_ids"].tolist()), b)[1])(collate(feats))
trainer.train()
checksum = sum(float(p.double().sum()) for p in model.parameters())
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    task_losses = [sorted(k for k in h if k[:-5] in ("a", "b", "c") and k.endswith("_loss")) for h in trainer.state.log_history if "loss" in h]
    json.dump({"checksum": checksum, "seen": seen, "world": trainer.args.world_size, "task_losses": task_losses,
               "loss": trainer.state.log_history[-1].get("train_loss")}, f)
