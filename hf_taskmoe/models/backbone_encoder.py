"""Former name of `hf_taskmoe.models.encoder` (the shared encoder base), kept for the modules that still import it:
`BackboneTaskConfig` is `TaskEncoderConfig`, `BackboneTaskMixin` is `TaskEncoderMixin`, `BackboneEncoderOutput` is
`TaskEncoderOutput`."""

from .encoder import TaskEncoderConfig as BackboneTaskConfig
from .encoder import TaskEncoderMixin as BackboneTaskMixin
from .encoder import TaskEncoderOutput as BackboneEncoderOutput
from .encoder import layer_rule

__all__ = ["BackboneEncoderOutput", "BackboneTaskConfig", "BackboneTaskMixin", "layer_rule"]
