"""Trained by tests/test_distributed.py under `torchrun --nproc_per_node 2` (gloo, CPU):
`sharded_train.py OUT FAMILY ENGINE MODE`.

FAMILY: `task_moe` (MT-TaG, the backbone-generic `TaskMoEForMultiTask` over a tiny BERT, three tasks of which one
regression), `pals` or `camtl` (`PALsForMultiTask`, `CAMTLForMultiTask`: the same BERT and tasks), or
`routed_llama` (`TaskRoutedForCausalLM` over a tiny Llama, three text-to-text tasks, 3 experts per layer) or
`routed_llama_low_rank` (the same with low-rank experts, `expert_rank=4`, hard routes, the dense weights frozen: frozen
and trainable parameters in one `fully_shard` unit). ENGINE:
`fsdp2` (accelerate's FSDP2, one `fully_shard` unit per block the family declares, sharded checkpoints), a
DeepSpeed config file (ZeRO-3) or `ddp` (DDP, nothing sharded: the reference). MODE: `full` (8 steps, a checkpoint
every 3), `kill` (the same run, each rank SIGKILLs itself at the end of step 5, after checkpoint-3 was saved and
before checkpoint-6) or `resume` (from the newest complete checkpoint of OUT/run, to step 8). Batches mix the tasks
(`heterogeneous`), two rows per rank, so a rank's batch leaves some task's head (and PALs) idle. Each rank writes
<out>/<mode><rank>.json: the per-step losses, the wrapper, the units FSDP sharded, and a checksum of the full
(gathered) weights; and for every run, whether the frozen parameters' gathered weights are bit-identical to the
start (`frozen_unchanged`, rank 0) and how many elements the optimizer holds state for on this rank
(`optimizer_numel`: AdamW's `exp_avg`, the rank's shard under FSDP2 and ZeRO-3) against the trainable ones.
"""

import json
import os
import signal
import sys

import datasets
import torch
import transformers
from transformers import TrainerCallback

from hf_taskmoe import (
    CAMTLBackboneConfig,
    CAMTLForMultiTask,
    PALsConfig,
    PALsForMultiTask,
    TaskMoEForMultiTask,
    TaskRoutedForCausalLM,
    TaskSpec,
)
from hf_taskmoe.training import MultiTaskTrainer, MultiTaskTrainingArguments
from hf_taskmoe.training.sharding import fsdp_config

out, family, engine, mode = sys.argv[1:5]
rank = int(os.environ["RANK"])
torch.manual_seed(0)
g = torch.Generator().manual_seed(1)
if family in ("task_moe", "pals", "camtl"):
    tasks = [TaskSpec(name="a", num_labels=2), TaskSpec(name="b", num_labels=3),
             TaskSpec(name="c", problem_type="regression")]
    bert = transformers.BertConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=24)
    if family == "task_moe":
        model = TaskMoEForMultiTask.from_dense(transformers.BertModel(bert), tasks=tasks, num_experts=2)
    elif family == "pals":
        model = PALsForMultiTask(PALsConfig(dense_config=bert, tasks=tasks, pal_size=8, pal_num_heads=2))
    else:
        model = CAMTLForMultiTask(CAMTLBackboneConfig(dense_config=bert, tasks=tasks,
                                                      conditional_attention_max_length=8))

    def labels(task):
        if task.problem_type == "regression":
            return torch.randn(16, generator=g).tolist()
        return torch.randint(0, task.num_labels, (16,), generator=g).tolist()

    train = {t.name: datasets.Dataset.from_dict({
        "input_ids": torch.randint(3, 50, (16, 5), generator=g).tolist(), "attention_mask": [[1] * 5] * 16,
        "labels": labels(t)}) for t in tasks}
else:
    tasks = [TaskSpec(name=n, problem_type="seq2seq") for n in "xyz"]
    dense = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=64, max_position_embeddings=64, bos_token_id=2, eos_token_id=3, pad_token_id=0))
    if family == "routed_llama_low_rank":
        model = TaskRoutedForCausalLM.from_dense(dense, tasks, num_experts=3, expert_rank=4, selection="hard")
    else:
        model = TaskRoutedForCausalLM.from_dense(dense, tasks, num_experts=3, expert_noise_variance=0.0)

    def rows(task: int):
        ids = torch.randint(4, 64, (16, 7), generator=g)
        if family == "routed_llama_low_rank":  # a target the deltas can learn in 8 steps: the task's own token
            ids[:, 3:] = 10 + task
        return {"input_ids": ids.tolist(), "attention_mask": [[1] * 7] * 16,
                "labels": ids.masked_fill(torch.arange(7) < 3, -100).tolist()}  # a 3-token prompt, then the target

    train = {t.name: datasets.Dataset.from_dict(rows(i)) for i, t in enumerate(tasks)}
if isinstance(model, tuple):  # from_dense may hand back (model, report)
    model = model[0]

frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
trainable_numel = sum(p.numel() for p in model.parameters() if p.requires_grad)

if engine == "fsdp2":
    sharding = {"fsdp": True, "fsdp_config": fsdp_config(model)}
elif engine == "ddp":  # the unsharded reference: DDP with a static graph
    sharding = {}
else:
    sharding = {"deepspeed": engine}
args = MultiTaskTrainingArguments(
    output_dir=os.path.join(out, "run"),
    use_cpu=True,
    ddp_backend="gloo",
    per_device_train_batch_size=2,
    max_steps=8,
    learning_rate=1e-2,
    warmup_steps=0,
    lr_scheduler_type="linear",
    task_sampling="proportional",
    batching="heterogeneous",
    report_to="none",
    save_strategy="steps",
    save_steps=3,
    logging_steps=1,
    disable_tqdm=True,
    seed=0,
    **sharding,
)


class KillAt(TrainerCallback):
    """A real kill: the process ends at once (no exception, no cleanup, no save), as `kill -9` would end it."""

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 5:
            sys.stdout.flush()
            sys.stderr.flush()
            os.kill(os.getpid(), signal.SIGKILL)


trainer = MultiTaskTrainer(model=model, args=args, train_dataset=train,
                           callbacks=[KillAt()] if mode == "kill" else None)
seen = []  # each batch's task ids on this rank
collate = trainer.data_collator
trainer.data_collator = lambda feats: (lambda b: (seen.append(b["task_ids"].tolist()), b)[1])(collate(feats))
trainer.train(resume_from_checkpoint="latest" if mode == "resume" else None)
wrapped = trainer.model_wrapped
state = trainer.accelerator.get_state_dict(wrapped)  # the weights (collective); under FSDP2 still DTensors


def full(tensor):
    """A gathered weight: FSDP2's state dict holds DTensors (`full_tensor` is a collective, every rank calls it)."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


# FSDP2's DTensors gathered first (a DTensor's own sum covered this rank's shard only)
checksum = sum(float(full(t).double().abs().sum()) for t in state.values() if t.is_floating_point()) if state else None
frozen_unchanged = None
if state:  # every rank under FSDP2 (DTensors); rank 0 only where the others get an empty dict
    frozen_unchanged = {n: bool(torch.equal(full(state[n]).detach().cpu().to(t.dtype), t)) for n, t in frozen.items()
                        if n in state}
optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # accelerate's wrapper
optimizer = getattr(optimizer, "optimizer", optimizer)  # DeepSpeed's ZeRO optimizer holds torch's
optimizer_numel = 0
for param_state in optimizer.state.values():
    avg = param_state.get("exp_avg")
    if avg is not None:
        optimizer_numel += (avg.to_local() if hasattr(avg, "to_local") else avg).numel()
units = {}
try:
    from torch.distributed.fsdp import FSDPModule

    names = [type(m).__name__ for m in trainer.model.modules() if isinstance(m, FSDPModule)]
    units = {name: names.count(name) for name in sorted(set(names))}
except ImportError:
    pass
with open(os.path.join(out, f"{mode}{rank}.json"), "w") as f:
    json.dump({
        "losses": {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h},
        "world": trainer.args.world_size,
        "seen": seen,
        "wrapper": type(wrapped).__name__,
        "units": units,
        "fsdp": trainer.is_fsdp_enabled,
        "zero_stage": wrapped.zero_optimization_stage() if hasattr(wrapped, "zero_optimization_stage") else None,
        "checksum": checksum,
        "frozen_numel": sum(t.numel() for t in frozen.values()),
        "trainable_numel": trainable_numel,
        "frozen_unchanged": frozen_unchanged,
        "frozen_missing": sorted(set(frozen) - set(state)) if state else None,
        "optimizer_numel": optimizer_numel,
        "checkpoints": sorted(os.listdir(os.path.join(out, "run"))),
    }, f)
if torch.distributed.is_initialized():  # as ddp_train.py: leave the group, skip the interpreter's teardown
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
