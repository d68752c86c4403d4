import numpy as np
import pytest

from hf_taskmoe.training import TASK_SAMPLERS, TaskBatchSampler, build_task_sampling, register_task_sampler
from hf_taskmoe.training.samplers import AnnealedSampling, ModelAwareSampling, TaskSamplingStrategy

SIZES = [8000, 1000, 500]


def _tasks_of(sampler, epoch=0):
    offsets = sampler.offsets
    rows = np.concatenate([np.asarray(b) for b in sampler.epoch_batches(epoch)])
    return np.searchsorted(offsets, rows, side="right") - 1, rows


@pytest.mark.parametrize(
    "name, options, expected",
    [
        ("proportional", {}, np.array(SIZES) / sum(SIZES)),
        ("natural", {}, np.array(SIZES) / sum(SIZES)),
        ("temperature", {"alpha": 0.5}, np.sqrt(SIZES) / np.sqrt(SIZES).sum()),
        ("sqrt", {}, np.sqrt(SIZES) / np.sqrt(SIZES).sum()),
        ("temperature", {"alpha": 0.0}, np.full(3, 1 / 3)),
        ("uniform", {}, np.full(3, 1 / 3)),
        ("round_robin", {}, np.full(3, 1 / 3)),
    ],
)
def test_sampled_task_shares_match_the_strategy(name, options, expected):
    sampler = TaskBatchSampler(
        SIZES, batch_size=32, strategy=build_task_sampling(name, **options), num_batches=1000, seed=7
    )
    np.testing.assert_allclose(sampler.probabilities(), expected, rtol=1e-12)
    tasks, _ = _tasks_of(sampler)
    shares = np.bincount(tasks, minlength=3) / len(tasks)
    # 32,000 draws: a multinomial share's standard deviation is below 0.003; 0.01 is > 3 sigma
    np.testing.assert_allclose(shares, expected, atol=0.01)


def test_annealed_schedule_follows_pals_eq9():
    strategy = AnnealedSampling()
    num_epochs = 5
    alphas = [strategy.alpha(e, num_epochs) for e in range(num_epochs)]
    np.testing.assert_allclose(alphas, [1 - 0.8 * e / (num_epochs - 1) for e in range(num_epochs)])
    assert alphas[0] == 1.0 and alphas[-1] == pytest.approx(0.2)
    sizes = np.array(SIZES)
    for e, alpha in enumerate(alphas):
        expected = sizes**alpha / (sizes**alpha).sum()
        np.testing.assert_allclose(strategy.probabilities(sizes, e, num_epochs), expected)
    assert strategy.alpha(0, 1) == 1.0  # a one-epoch run stays proportional
    sampler = TaskBatchSampler(SIZES, 32, AnnealedSampling(), num_batches=600, num_epochs=3, seed=0)
    first = np.bincount(_tasks_of(sampler, 0)[0], minlength=3) / (600 * 32)
    last = np.bincount(_tasks_of(sampler, 2)[0], minlength=3) / (600 * 32)
    assert first[0] > 0.8 and last[0] < 0.6  # the big task loses share as training goes on


def test_round_robin_cycles_rows_and_batches():
    hetero = TaskBatchSampler(SIZES, 4, build_task_sampling("round_robin"), num_batches=3)
    tasks, _ = _tasks_of(hetero)
    assert tasks.tolist() == [i % 3 for i in range(12)]
    homo = TaskBatchSampler(SIZES, 4, build_task_sampling("round_robin"), batching="homogeneous", num_batches=6)
    batches = list(homo.epoch_batches(0))
    per_batch = [set((np.searchsorted(homo.offsets, b, side="right") - 1).tolist()) for b in batches]
    assert per_batch == [{0}, {1}, {2}, {0}, {1}, {2}]


def test_homogeneous_batches_hold_one_task_and_heterogeneous_mix():
    homo = TaskBatchSampler(SIZES, 16, build_task_sampling("uniform"), batching="homogeneous", num_batches=50, seed=1)
    for batch in homo.epoch_batches(0):
        assert len(set((np.searchsorted(homo.offsets, batch, side="right") - 1).tolist())) == 1
    hetero = TaskBatchSampler(SIZES, 16, build_task_sampling("uniform"), num_batches=50, seed=1)
    mixed = [
        len(set((np.searchsorted(hetero.offsets, b, side="right") - 1).tolist())) > 1 for b in hetero.epoch_batches(0)
    ]
    assert sum(mixed) > 45


def test_batches_depend_only_on_seed_and_epoch():
    def make(seed):
        return TaskBatchSampler(SIZES, 8, build_task_sampling("proportional"), num_batches=20, seed=seed)

    assert list(make(3).epoch_batches(1)) == list(make(3).epoch_batches(1))
    assert list(make(3).epoch_batches(1)) != list(make(3).epoch_batches(2))
    assert list(make(3).epoch_batches(1)) != list(make(4).epoch_batches(1))
    sampler = make(3)
    first = list(sampler)
    assert sampler.epoch == 1 and list(sampler) != first  # advances by itself after a full pass
    sampler.set_epoch(0)
    assert list(sampler) == first


def test_each_task_is_visited_without_replacement_before_repeating():
    sampler = TaskBatchSampler([5, 7], 6, build_task_sampling("uniform"), num_batches=40, seed=2)
    tasks, rows = _tasks_of(sampler)
    small = rows[tasks == 0][:5]
    assert sorted(small.tolist()) == [0, 1, 2, 3, 4]
    big = rows[tasks == 1][:7]
    assert sorted(big.tolist()) == list(range(5, 12))


def test_epoch_length_defaults_to_one_pass():
    sampler = TaskBatchSampler(SIZES, 32, build_task_sampling("proportional"))
    assert len(sampler) == int(np.ceil(sum(SIZES) / 32))


def test_bad_sampler_inputs():
    with pytest.raises(ValueError, match="'b' is in the sampler but has no training examples"):
        TaskBatchSampler([3, 0], 4, build_task_sampling("uniform"), task_names=["a", "b"])
    with pytest.raises(ValueError, match="task_sampling"):
        build_task_sampling("lottery")
    with pytest.raises(ValueError, match="batching"):
        TaskBatchSampler([3], 4, build_task_sampling("uniform"), batching="mixed")
    with pytest.raises(ValueError, match="subclass TaskSamplingStrategy"):
        register_task_sampler("bad", dict)


class _PickFirstRows(ModelAwareSampling):
    name = "pick_first_rows"

    def select(self, model, inputs, batch_size, step):
        return {k: v[:batch_size] for k, v in inputs.items()}


def test_registry_admits_model_aware_strategies():
    register_task_sampler("pick_first_rows", _PickFirstRows, exist_ok=True)
    try:
        strategy = build_task_sampling("pick_first_rows", candidates_per_task=3)
        assert strategy.model_aware and isinstance(strategy, TaskSamplingStrategy)
        sampler = TaskBatchSampler([10, 10, 10], 4, strategy, num_batches=2)
        batch = next(iter(sampler.epoch_batches(0)))
        # candidate pool: 3 examples of every task, in task order
        assert (np.searchsorted(sampler.offsets, batch, side="right") - 1).tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    finally:
        TASK_SAMPLERS.pop("pick_first_rows")
