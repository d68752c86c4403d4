"""Low-rank experts (`expert_rank`, issue 56) over every declared architecture task-level routing takes with them: the
list is read from the declarations (`backbone_names()` filtered by `Backbone.supports("task-routing", low_rank=True)`:
Falcon, refused for whole experts, is in), so an architecture declared later is covered without touching this file
(its tiny config goes in `tests/backbone_matrix.py`).

For each, in the default run, on its tiny random dense LM (built once per module):

- `from_dense(..., num_experts=3, expert_rank=4, selection="hard")` computes the dense model's logits under any
  route (every `B` zero): random routing weights given by hand, and the router's own hard routes;
- with random `B`s (the deltas then matter), `export_task_adapters` writes the base and one peft LoRA adapter per
  task that plain transformers + peft load (`AutoModelFor...`, `PeftModel.from_pretrained`, `load_adapter`): each
  task's logits are the routed model's (1e-5), and so are peft's mixed-adapter batch's (`adapter_names`) and
  `export_task(task)`'s (its merged weights, compared in float64), and greedy decoding of a mixed batch through
  peft's adapters gives the routed model's tokens;
- `save_pretrained` / the Auto class give back the same model (its low-rank modules, trainable set and logits);
- one training step changes only the trainable parameters: the frozen dense weights stay bit-identical and take
  neither a gradient nor optimizer state, with activation checkpointing too.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

from hf_taskmoe import TaskSpec
from hf_taskmoe.backbones import DECODER_BACKBONE, backbone_names, get_backbone
from hf_taskmoe.compat import CHECKPOINTING_ENABLE
from hf_taskmoe.models import family_of
from hf_taskmoe.models.task_routing import TaskRoutedForCausalLM, TaskRoutedForSeq2SeqLM

from .backbone_matrix import NEW_CONFIGS
from .test_backbones_new import new_dense
from .test_bart_routed import dense_bart
from .test_task_routed_lm import dense_model as dense_lm
from .test_task_routed_t5 import dense_model as dense_t5

#: every architecture task-level routing takes with low-rank experts, as declared now (those it refuses for whole
#: experts only, `Backbone.low_rank_only`, included: Falcon)
ROUTED_ARCHS = [a for a in backbone_names() if get_backbone(a).supports("task-routing", low_rank=True)]
TASKS = [TaskSpec(name=n, problem_type="seq2seq") for n in ("x", "y", "z")]
MIXED = torch.tensor([0, 1, 2, 1])
ATOL = 1e-5


def _dense(arch: str):
    """The tiny dense LM of `arch`, seeded: the first seven from their own test files, the later ones from the
    backbone matrix."""
    if arch in NEW_CONFIGS:
        return new_dense(arch)
    if arch in ("t5", "mt5"):
        return dense_t5(arch)
    return dense_bart() if arch == "bart" else dense_lm(arch)


@pytest.fixture(scope="module")
def dense_models():
    """One tiny dense model per architecture for the whole module (`from_dense` copies its weights, never edits it)."""
    cache = {}

    def get(arch: str):
        if arch not in cache:
            cache[arch] = _dense(arch)
        return cache[arch]

    return get


def _auto(arch: str):
    return AutoModelForCausalLM if get_backbone(arch).kind == DECODER_BACKBONE else AutoModelForSeq2SeqLM


def _low_rank(arch: str, dense):
    model_class = TaskRoutedForCausalLM if get_backbone(arch).kind == DECODER_BACKBONE else TaskRoutedForSeq2SeqLM
    torch.manual_seed(0)  # the router's init (the tasks' routes): the same whatever ran before
    return model_class.from_dense(dense, TASKS, num_experts=3, expert_rank=4, selection="hard").eval()


def text_batch(model, task_ids: torch.Tensor, seed: int = 0) -> dict:
    """Rows of tasks `task_ids`, tokens in [4, vocab): a decoder's first row left-padded, its labels its own ids (the
    prompt's first 3 and the padding -100); an encoder-decoder's first input row right-padded, its labels a target
    ending in the eos token (the layout its tokenizer makes; the model derives its decoder inputs from them)."""
    g = torch.Generator().manual_seed(seed)
    config = model.config.dense_config
    n, vocab = len(task_ids), config.vocab_size
    ids = torch.randint(4, vocab, (n, 8), generator=g)
    mask = torch.ones_like(ids)
    if not config.is_encoder_decoder:
        mask[0, :2] = 0
        labels = ids.masked_fill(mask == 0, -100)
        labels[:, :3] = -100
    else:
        mask[0, -2:] = 0
        labels = torch.randint(4, vocab, (n, 5), generator=g)
        labels[:, -1] = config.eos_token_id
    pad = config.pad_token_id if config.pad_token_id is not None else 0
    return dict(input_ids=ids.masked_fill(mask == 0, pad), attention_mask=mask, labels=labels,
                task_ids=torch.as_tensor(task_ids))


def _plain(batch: dict) -> dict:
    return {k: v for k, v in batch.items() if k != "task_ids"}


def _move_apart(model, seed: int = 1):
    """Random `B`s (the deltas then change the outputs), and a router whose hard route sends task `i` to expert
    `(i + l) % experts` at routed layer `l` (the tasks take different experts in every layer): the MLP router's
    hidden units copy the task's one-hot embedding (GELU(10) = 10, GELU(0) = 0) and its output layer maps unit `i` to
    that expert."""
    g = torch.Generator().manual_seed(seed)
    router = model.router
    tasks, layers, experts = len(TASKS), model.config.num_routed_layers, model.config.num_experts
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".lora_B"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
            elif name.startswith("router."):
                p.zero_()
        router.task_embeddings.weight[:, :tasks] = 10 * torch.eye(tasks)
        router.net.dense_in.weight[:tasks, :tasks] = torch.eye(tasks)
        out = router.net.dense_out.weight.view(layers, experts, -1)  # (layers, experts, hidden)
        for layer in range(layers):
            for task in range(tasks):
                out[layer, (task + layer) % experts, task] = 1.0
    return model


@pytest.mark.parametrize("arch", ROUTED_ARCHS)
def test_upcycled_low_rank_experts_compute_the_dense_model_under_any_route(arch, dense_models):
    dense = dense_models(arch)
    model = _low_rank(arch, dense)
    assert model.low_rank_modules(), arch
    batch = text_batch(model, MIXED)
    with torch.no_grad():
        reference = dense(**_plain(batch)).logits
        torch.testing.assert_close(model(**batch).logits, reference, rtol=0, atol=ATOL)  # the router's hard routes
        g = torch.Generator().manual_seed(3)
        shape = (len(MIXED), model.config.num_routed_layers, model.config.num_experts)
        weights = torch.randn(shape, generator=g) * 3  # any mixture, given by hand
        torch.testing.assert_close(model(**batch, routing_weights=weights).logits, reference, rtol=0, atol=ATOL)
        if not model.config.is_encoder_decoder:
            # each layer's recorded output is its hidden-states tensor (Falcon's layers return a tuple), the dense
            # model's own before the final norm
            states = model(**batch, output_hidden_states=True).hidden_states
            expected = dense(**_plain(batch), output_hidden_states=True).hidden_states
            assert len(states) == len(expected), arch
            for ours, theirs in zip(states[:-1], expected[:-1]):
                torch.testing.assert_close(ours, theirs, rtol=0, atol=ATOL)


def _load_exported(folder, arch: str, tasks: list[str]):
    """The export read back with plain transformers + peft only."""
    from peft import PeftModel

    base = _auto(arch).from_pretrained(folder / "base").eval()
    peft_model = PeftModel.from_pretrained(base, folder / tasks[0], adapter_name=tasks[0])
    for task in tasks[1:]:
        peft_model.load_adapter(folder / task, adapter_name=task)
    return peft_model.eval()


@pytest.mark.parametrize("arch", ROUTED_ARCHS)
def test_the_exported_adapters_and_export_task_are_each_tasks_routed_model(arch, dense_models, tmp_path):
    dense = dense_models(arch)
    model = _move_apart(_low_rank(arch, dense))
    names = [t.name for t in TASKS]
    layers = model.config.num_routed_layers
    assert [model.hard_route(n) for n in names] == [[(i + k) % 3 for k in range(layers)] for i in range(3)]
    result = model.export_task_adapters(tmp_path / "out")
    assert result.method == "low_rank_experts" and result.rank == 4
    peft_model = _load_exported(tmp_path / "out", arch, names)
    adapted = [m for m in peft_model.modules() if hasattr(m, "lora_A") and hasattr(m, "base_layer")]
    assert len(adapted) == len(model.low_rank_modules())  # every wrapped linear carries its adapter
    rows = len(MIXED)
    batch = text_batch(model, MIXED)
    with torch.no_grad():
        dense_logits = dense(**_plain(batch)).logits
        routed = {}
        for i, task in enumerate(names):
            batch["task_ids"] = torch.full((rows,), i)
            routed[task] = model(**batch).logits
            assert not torch.allclose(routed[task], dense_logits, atol=1e-3), task  # the deltas act
            peft_model.set_adapter(task)
            torch.testing.assert_close(peft_model(**_plain(batch)).logits, routed[task], rtol=ATOL, atol=ATOL)
        # peft's mixed-adapter batch: each row its task's adapter, as the routed model's mixed batch
        batch["task_ids"] = MIXED
        mixed = peft_model(**_plain(batch), adapter_names=[names[t] for t in MIXED.tolist()]).logits
        torch.testing.assert_close(mixed, model(**batch).logits, rtol=ATOL, atol=ATOL)
    # greedy decoding of the mixed batch: peft's adapters per row give the routed model's tokens
    kwargs = dict(attention_mask=batch["attention_mask"], max_new_tokens=3, min_new_tokens=3, do_sample=False)
    with torch.no_grad():
        tokens = model.generate(batch["input_ids"], task_ids=MIXED, **kwargs)
        peft_tokens = peft_model.generate(input_ids=batch["input_ids"], **kwargs,
                                          adapter_names=[names[t] for t in MIXED.tolist()])
    assert torch.equal(tokens, peft_tokens)
    with torch.no_grad():
        # `export_task` merges the route's deltas into the weights: compared in float64, where the merge is exact (in
        # float32, `W + BA` rounds differently from `Wx + BAx`: T5's unscaled attention amplifies that to ~4e-5)
        # on rows without padding (Gemma 2's dense model itself gives NaN on a left-padded row in float64)
        model = model.double()
        batch["attention_mask"] = torch.ones_like(batch["attention_mask"])
        for i, task in enumerate(names):
            batch["task_ids"] = torch.full((rows,), i)
            merged = model.export_task(task).eval()
            torch.testing.assert_close(merged(**_plain(batch)).logits, model(**batch).logits, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointing"])
@pytest.mark.parametrize("arch", ROUTED_ARCHS)
def test_a_training_step_changes_only_the_trainable_parameters(arch, checkpointing, dense_models):
    model = _move_apart(_low_rank(arch, dense_models(arch)))
    if checkpointing:  # the frozen base under activation checkpointing (non-reentrant: the routes are restored)
        getattr(model, CHECKPOINTING_ENABLE)()
    model.train()
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    trainable = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    assert frozen and trainable and all(n.endswith((".lora_A", ".lora_B")) or n.startswith("router.")
                                        for n in trainable)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    runs = []
    next(iter(model.low_rank_modules().values())).register_forward_hook(lambda *_: runs.append(1))
    model(**text_batch(model, MIXED)).loss.backward()
    optimizer.step()
    assert len(runs) == (2 if checkpointing else 1)  # a checkpointed layer runs again in the backward pass
    for name, param in model.named_parameters():
        if name in frozen:
            assert param.grad is None and torch.equal(param, frozen[name]), name
    assert {id(p) for p in optimizer.state} <= {id(p) for p in params}
    moved = [n for n, p in model.named_parameters() if n in trainable and not torch.equal(p, trainable[n])]
    assert any(n.endswith(".lora_A") for n in moved) and any(n.endswith(".lora_B") for n in moved)


@pytest.mark.parametrize("arch", ROUTED_ARCHS)
def test_save_and_load_through_the_auto_class(arch, dense_models, tmp_path):
    model = _move_apart(_low_rank(arch, dense_models(arch)))
    model.save_pretrained(tmp_path)
    loaded = _auto(arch).from_pretrained(tmp_path).eval()
    assert type(loaded) is family_of(model.config.model_type).model_class and loaded.config.expert_rank == 4
    assert set(loaded.low_rank_modules()) == set(model.low_rank_modules())
    assert {n for n, p in loaded.named_parameters() if p.requires_grad} == \
        {n for n, p in model.named_parameters() if p.requires_grad}
    batch = text_batch(model, MIXED)
    with torch.no_grad():
        assert torch.equal(loaded(**batch).logits, model(**batch).logits)


def test_low_rank_only_lifts_a_refusal_the_declaration_makes():
    from hf_taskmoe.backbones import ENCODER_DECODER_BACKBONE, Backbone, FFNSite, register_backbone

    with pytest.raises(ValueError, match=r"`low_rank_only` of backbone 'toy' names methods it does not refuse"):
        register_backbone(Backbone("toy", ENCODER_DECODER_BACKBONE, "layers", FFNSite("mlp"),
                                   low_rank_only=("task-routing",)))
    assert "toy" not in backbone_names()
    lifted = [a for a in ROUTED_ARCHS if not get_backbone(a).supports("task-routing")]
    assert "falcon" in lifted  # whole experts refused (tests/test_backbones_new.py), low-rank ones run here
