"""`MultiTaskTrainingArguments`: `TrainingArguments` plus task sampling, batching and epoch length."""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import TrainingArguments

from ..utils import check_choice, check_float, check_int
from .samplers import BATCHING, TASK_SAMPLERS


@dataclass
class MultiTaskTrainingArguments(TrainingArguments):
    """Everything of `TrainingArguments`, plus:

    Args:
        task_sampling (`str`, *optional*, defaults to `"proportional"`):
            Task sampling strategy, a key of `hf_taskmoe.training.TASK_SAMPLERS` (`proportional`/`natural`,
            `temperature`, `sqrt`, `uniform`, `round_robin`, `annealed`, and registered model-aware ones).
        sampling_alpha (`float`, *optional*, defaults to 0.5):
            Exponent of `temperature` sampling (p_t ∝ N_t^alpha).
        annealed_min_alpha (`float`, *optional*, defaults to 0.2):
            Last-epoch exponent of `annealed` sampling (PALs eq. 9 uses 0.2).
        uncertainty_candidates_per_task (`int`, *optional*):
            `task_sampling="uncertainty"` (MT-Uncertainty, CA-MTL Algorithm 1): candidates `b` drawn per task each
            step; the `per_device_train_batch_size` most uncertain of the `b x T` are trained on. Default: the batch
            size.
        uncertainty_score_every (`int`, *optional*, defaults to 1):
            MT-Uncertainty: score the candidates every k steps; the steps between keep the last scored batch's
            task composition (bounds the extra forward pass to 1/k of the steps).
        uncertainty_regression (`str`, *optional*, defaults to `"error"`):
            MT-Uncertainty: the uncertainty of regression examples, `"error"` (squared error relative to the
            label variance) or `"mean"` (label free, but starves the task; see `hf_taskmoe.training.uncertainty`).
        batching (`str`, *optional*, defaults to `"heterogeneous"`):
            `heterogeneous`: rows of several tasks per batch (MT-TaG); `homogeneous`: one task per batch.
        steps_per_epoch (`int`, *optional*):
            Batches per epoch. Default: one pass over all training examples.
        training_proportion (`float`, *optional*):
            Epoch length as a share of all training examples (the PALs paper's "training proportion").
        small_task_threshold (`int`, *optional*, defaults to 10000):
            Tasks with at most this many training examples count as small (`eval_small_tasks_average`).
        train_task_specific_only (`bool`, *optional*, defaults to `False`):
            Freeze every shared parameter and train only task-specific ones (heads, task gates, adapters):
            the PALs paper's second stage after joint training.
        log_routing (`bool`, *optional*, defaults to `False`):
            MoE and task-routed models (BertForTaskMoE, BartTaskRouted): log each task's expert shares,
            routing entropy and unused experts on the training batches at every logging step (to every
            `report_to` integration), and write `routing_train.json` and `routing_train_heatmap.png` with each
            checkpoint (`RoutingAnalyticsCallback`).
        group_learning_rates (`dict[str, float]` or `str`, *optional*):
            Learning rates of parameter roles (the roles of the model's `parameter_roles`), e.g. `{"router": 1e-3,
            "task_embedding": 1e-2}` (BartTaskRouted, Ye et al. section 5.2) or, on the command line,
            `router=1e-3,task_embedding=1e-2`. Other parameters use `learning_rate`; each group follows the
            learning-rate schedule.
        trust_remote_metrics (`bool`, *optional*, defaults to `False`):
            Task metric names are data (task files, saved configs). A name that hf_taskmoe neither ships nor has
            registered in code (`hf_taskmoe.metrics.register_metric`) is refused, because `evaluate.load` would import
            and run the code it finds under that name (a local folder or a Hub repo). Set this to allow it.
        resume_incomplete_checkpoint (`bool`, *optional*, defaults to `False`):
            `train(resume_from_checkpoint=...)` refuses a checkpoint without `optimizer.pt`, `scheduler.pt` or the RNG
            state (the run would not continue as it was); set this to resume from one anyway.
        predict_with_generate (`bool`, *optional*, defaults to `True`):
            Seq2seq tasks: evaluate on `generate()`'s output (beam search with `generation_num_beams`), reported
            under the metrics' plain names (`eval_xsum_rouge1`). Set to `False` for the cheaper teacher-forced
            scores (the arg-max token at each target position given the gold prefix): they are not what the model
            produces on its own (an untrained model scores high on them), so they are reported as
            `<metric>_teacher_forced` (`eval_xsum_rouge1_teacher_forced`) and kept out of the averages.
        generation_max_length (`int`, *optional*):
            `max_new_tokens` of evaluation-time generation. Default: the model's generation config (BartTaskRouted:
            the target length it was trained with, `run_multitask.py --max_target_length`).
        generation_num_beams (`int`, *optional*, defaults to 1):
            Beams of evaluation-time generation.
    """

    task_sampling: str = field(default="proportional", metadata={"help": f"One of {sorted(TASK_SAMPLERS)}."})
    sampling_alpha: float = field(default=0.5, metadata={"help": "Exponent of temperature sampling."})
    annealed_min_alpha: float = field(
        default=0.2, metadata={"help": "Exponent of annealed sampling in the last epoch."}
    )
    uncertainty_candidates_per_task: int | None = field(
        default=None, metadata={"help": "MT-Uncertainty: candidates per task per step (default: the batch size)."}
    )
    uncertainty_score_every: int = field(
        default=1, metadata={"help": "MT-Uncertainty: score candidates every k steps."}
    )
    uncertainty_regression: str = field(
        default="error", metadata={"help": "MT-Uncertainty for regression: error | mean."}
    )
    batching: str = field(default="heterogeneous", metadata={"help": f"One of {list(BATCHING)}."})
    steps_per_epoch: int | None = field(default=None, metadata={"help": "Batches per epoch (default: one pass)."})
    training_proportion: float | None = field(
        default=None, metadata={"help": "Epoch length as a share of all training examples (PALs)."}
    )
    small_task_threshold: int = field(default=10_000, metadata={"help": "Training examples of a 'small' task."})
    train_task_specific_only: bool = field(
        default=False, metadata={"help": "Freeze shared parameters; train heads, gates and adapters only."}
    )
    log_routing: bool = field(
        default=False,
        metadata={
            "help": "MoE and task-routed models: log per-task routing of the training batches and save its summary."
        },
    )
    group_learning_rates: dict | str | None = field(
        default=None, metadata={"help": "Learning rates per parameter role, e.g. router=1e-3,task_embedding=1e-2."}
    )
    trust_remote_metrics: bool = field(
        default=False,
        metadata={
            "help": "Allow metric names that are neither shipped nor registered (evaluate.load runs their code)."
        },
    )
    resume_incomplete_checkpoint: bool = field(
        default=False, metadata={"help": "Resume from a checkpoint without its optimizer/scheduler/RNG state anyway."}
    )
    predict_with_generate: bool = field(
        default=True,
        metadata={"help": "Seq2seq tasks: score generated text (default). False: teacher-forced arg-max scores, named "
                          "<metric>_teacher_forced and kept out of the averages."},
    )
    generation_max_length: int | None = field(
        default=None,
        metadata={"help": "max_new_tokens of evaluation generation (default: the model's generation config)."},
    )
    generation_num_beams: int = field(default=1, metadata={"help": "Beams of evaluation generation."})
    release_freed_memory_every: int = field(
        default=0,
        metadata={
            "help": "CPU runs on glibc: hand freed heap memory back to the OS every k optimizer steps "
            "(malloc_trim; 0 = never). MoE experts' activations change size every step and fragment the "
            "heap: with k = 1 the demo's MT-TaG peak fell from 2.8 to 1.8 GB, at about 16-20%% more time per step."
        },
    )
    # Heads, gates and experts of tasks absent from a rank's batch take part in every backward pass
    # (`MultiTaskTrainer._touch_every_parameter`), so DDP runs with a static graph.
    ddp_find_unused_parameters: bool | None = field(
        default=False, metadata={"help": "DDP: search for parameters without gradient each step (not needed here)."}
    )

    def __post_init__(self):
        import torch

        # transformers accepts these and fails later (a ZeroDivisionError, an empty loader) or trains one step at
        # learning rate 0 (max_steps 0): refused here, before any compute
        for name in ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"`{name}` must be a positive integer (examples per device per step), got {value!r}; "
                                 f"set it to 1 or more (--{name} 8).")
        if (
            isinstance(self.max_steps, bool)
            or not isinstance(self.max_steps, int)
            or self.max_steps == 0
            or self.max_steps < -1
        ):
            raise ValueError(
                f"`max_steps` must be a positive number of optimizer steps, or -1 to train for `num_train_epochs`; got "
                f"{self.max_steps!r} (0 would still take one step, at learning rate 0). To evaluate without training, "
                "turn training off instead (--do_train False)."
            )

        import math

        # torch's optimizers refuse these only when the Trainer builds them, after the data and model are ready
        for name in ("learning_rate", "weight_decay"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"`{name}` must be a finite number >= 0, got {value!r}.")
        if self.max_steps == -1 and not (isinstance(self.num_train_epochs, (int, float)) and self.num_train_epochs > 0):
            raise ValueError(
                f"`num_train_epochs` must be > 0 when `max_steps` is -1 (training for epochs), got "
                f"{self.num_train_epochs!r}; it would train nothing. To evaluate without training, turn training off "
                "instead (--do_train False)."
            )

        if self.fp16 and (self.use_cpu or not (torch.cuda.is_available() or torch.xpu.is_available())):
            # transformers would accept it and train in fp32 while reporting fp16
            raise ValueError(
                "`fp16` mixed precision needs a CUDA (or XPU) device, and this run is on the CPU. On a CPU use `bf16` "
                "(with `use_cpu`), or leave the precision at fp32."
            )
        fsdp_version = int((self.fsdp_config or {}).get("version", 2)) if isinstance(self.fsdp_config, dict) else 2
        if self.fsdp and fsdp_version != 2 and (
            self.use_cpu or not (torch.cuda.is_available() or torch.xpu.is_available())
        ):
            # accelerate would wrap the model in plain DDP and say nothing; FSDP2 is turned on by MultiTaskTrainer
            raise ValueError(
                "FSDP version 1 needs CUDA or XPU devices; on the CPU accelerate silently falls back to DDP. On a CPU "
                "use FSDP2 (`fsdp_config={'version': 2}`, the default), DDP (the default under torchrun) or DeepSpeed "
                "ZeRO (`deepspeed=examples/deepspeed/zero2.json`)."
            )
        super().__post_init__()

        if self.dataloader_pin_memory and not torch.cuda.is_available():
            self.dataloader_pin_memory = False  # pinning needs an accelerator; torch warns on every loader otherwise
        check_choice(self.task_sampling, TASK_SAMPLERS, "task_sampling")
        check_choice(self.batching, BATCHING, "batching")
        check_float(self.sampling_alpha, "sampling_alpha", minimum=0.0)
        check_float(self.annealed_min_alpha, "annealed_min_alpha", minimum=0.0, maximum=1.0)
        if self.uncertainty_candidates_per_task is not None:
            check_int(self.uncertainty_candidates_per_task, "uncertainty_candidates_per_task", minimum=1)
        check_int(self.uncertainty_score_every, "uncertainty_score_every", minimum=1)
        check_choice(self.uncertainty_regression, ("mean", "error"), "uncertainty_regression")
        check_int(self.small_task_threshold, "small_task_threshold", minimum=0)
        if self.steps_per_epoch is not None:
            check_int(self.steps_per_epoch, "steps_per_epoch", minimum=1)
        if self.training_proportion is not None:
            check_float(self.training_proportion, "training_proportion", minimum=1e-9)
        self.group_learning_rates = parse_group_learning_rates(self.group_learning_rates)
        if self.generation_max_length is not None:
            check_int(self.generation_max_length, "generation_max_length", minimum=1)
        check_int(self.generation_num_beams, "generation_num_beams", minimum=1)
        if self.steps_per_epoch is not None and self.training_proportion is not None:
            raise ValueError("Set at most one of `steps_per_epoch` and `training_proportion`.")


def parse_group_learning_rates(value) -> dict[str, float] | None:
    """`{"router": 1e-3}` or `"router=1e-3,task_embedding=1e-2"` (or its JSON) -> `{role: rate}`."""
    if value is None or value == "" or value == {}:
        return None
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("{"):
            import json

            value = json.loads(text)
        else:
            value = {}
            for item in text.split(","):
                role, sep, rate = item.partition("=")
                if not sep:
                    raise ValueError(f"`group_learning_rates`: expected role=rate pairs, got {item!r} in {text!r}.")
                try:
                    value[role.strip()] = float(rate)
                except ValueError:
                    raise ValueError(
                        f"`group_learning_rates`: {rate!r} (role {role.strip()!r}) is not a number."
                    ) from None
    if not isinstance(value, dict):
        raise ValueError(f"`group_learning_rates` must be a dict {{role: rate}} or 'role=rate,...', got {value!r}.")
    return {str(k): check_float(v, f"group_learning_rates[{k!r}]", minimum=0.0) for k, v in value.items()}
