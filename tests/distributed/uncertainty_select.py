"""Run by tests/test_distributed.py under `torchrun --nproc_per_node 2` (gloo, CPU): `uncertainty_select.py OUT`.

Each rank holds a pool of 8 candidates (2 tasks x 4) and trains on a batch of 4. A toy model's confidence is the
first input token: 0 gives the uniform distribution (the most uncertain), 9 a confident one. Rank 0's pool holds
six uncertain candidates, rank 1's two: MT-Uncertainty's global selection (CA-MTL Algorithm 1 over all ranks)
takes all eight uncertain candidates, six on rank 0 and two on rank 1, where a per-rank top-4 would take four and
four. Each rank writes the first tokens of its chosen rows, and what it chooses alone (no process group), to
OUT/select<rank>.json.
"""

import json
import os
import sys
from types import SimpleNamespace

import torch

from hf_taskmoe import TaskSpec
from hf_taskmoe.training import MTUncertaintySampling

out = sys.argv[1]
torch.distributed.init_process_group("gloo")
rank = torch.distributed.get_rank()
specs = [TaskSpec(name="a", num_labels=2), TaskSpec(name="b", num_labels=2)]


class Toy(torch.nn.Module):
    config = SimpleNamespace(task_specs=specs)

    def forward(self, input_ids, task_ids, **kwargs):
        logits = {}
        for t, spec in enumerate(specs):
            x = input_ids[task_ids == t, 0].float()
            logits[spec.name] = torch.stack([x, -x], dim=-1)
        return SimpleNamespace(task_logits=logits)


first = {0: [0, 0, 0, 0, 0, 0, 9, 9], 1: [0, 0, 9, 9, 9, 9, 9, 9]}[rank]
inputs = {
    "input_ids": torch.tensor([[v, 1] for v in first]),
    "task_ids": torch.tensor([0, 0, 0, 0, 1, 1, 1, 1]),
}
chosen = MTUncertaintySampling(seed=0).select(Toy(), inputs, batch_size=4, step=0)
torch.distributed.destroy_process_group()
alone = MTUncertaintySampling(seed=0).select(Toy(), inputs, batch_size=4, step=0)
with open(os.path.join(out, f"select{rank}.json"), "w") as f:
    json.dump({"global": chosen["input_ids"][:, 0].tolist(), "alone": alone["input_ids"][:, 0].tolist()}, f)
