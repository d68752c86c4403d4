from .configuration_bart_task_routed import BartTaskRoutedConfig
from .modeling_bart_task_routed import BartTaskRouted, TaskRoutedSeq2SeqOutput

__all__ = ["BartTaskRoutedConfig", "BartTaskRouted", "TaskRoutedSeq2SeqOutput"]
