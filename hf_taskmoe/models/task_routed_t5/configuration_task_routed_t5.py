"""Configuration of `TaskRoutedForSeq2SeqLM`: task-level routing (Ye et al. 2022) over the encoder and decoder blocks
of a T5 / mT5 (`hf_taskmoe.backbones.backbone_names("encoder-decoder")`)."""

from __future__ import annotations

from typing import ClassVar

from transformers import AutoConfig

from ...backbones import ENCODER_DECODER_BACKBONE
from ...problem_types.seq2seq import ENCODER_DECODER_LAYOUT
from ...utils import check_layer_list
from ..task_routed_lm.configuration_task_routed_lm import TaskRoutedLMConfig

__all__ = ["TaskRoutedSeq2SeqConfig"]


class TaskRoutedSeq2SeqConfig(TaskRoutedLMConfig):
    r"""
    Configuration of `TaskRoutedForSeq2SeqLM` (Ye et al. 2022, sections 4 and 5.1, on T5 / mT5): a dense
    encoder-decoder whose routed encoder and decoder blocks are each forked into `num_experts` experts, mixed per task
    by a router that reads a task embedding. Every field of `TaskRoutedLMConfig` means the same here, except that the
    routed layers are named per stack (`routed_layers` is not used):

    Args:
        dense_config (`dict` or `PreTrainedConfig`):
            The config of the dense T5 / mT5 the model wraps (`T5Config`, `MT5Config`: a declared encoder-decoder
            backbone). `from_dense` fills it from the checkpoint.
        routed_encoder_layers (`list[int]`, *optional*):
            Indices of the encoder blocks forked into experts; default: all of them (the paper routes every layer).
        routed_decoder_layers (`list[int]`, *optional*):
            Indices of the decoder blocks forked into experts; default: all of them.
        is_encoder_decoder (`bool`, *optional*, defaults to `True`):
            Always `True` (what `generate` and the text-to-text pipeline read).

    The router's layer axis lists the routed encoder blocks, then the routed decoder blocks (`route_names`:
    `E0, E1, ..., D0, D1, ...`).
    """

    model_type = "taskmoe_routed_t5"
    #: a text-to-text example: the input text to the encoder, the target's tokens as labels
    text_to_text_layout: ClassVar[str] = ENCODER_DECODER_LAYOUT
    method_name: ClassVar[str] = "Task-level routing (TaskRoutedForSeq2SeqLM)"
    backbone_kind: ClassVar[str] = ENCODER_DECODER_BACKBONE
    sub_configs: ClassVar = {"dense_config": AutoConfig}
    #: the dense model type of a config built without `dense_config` (transformers builds default configs)
    dense_config_default: ClassVar[str] = "t5"

    routed_encoder_layers: list | None = None
    routed_decoder_layers: list | None = None
    is_encoder_decoder: bool = True

    def _validate(self) -> None:
        if self.routed_layers is not None:
            raise ValueError(
                "`routed_layers` is not used by TaskRoutedSeq2SeqConfig: name the routed blocks per stack with "
                f"`routed_encoder_layers` / `routed_decoder_layers`, got routed_layers={self.routed_layers!r}."
            )
        super()._validate()
        self.routed_encoder_layers = check_layer_list(self.routed_encoder_layers, "routed_encoder_layers",
                                                      self.num_layers)
        self.routed_decoder_layers = check_layer_list(self.routed_decoder_layers, "routed_decoder_layers",
                                                      self.num_decoder_layers)
        self.is_encoder_decoder = True

    # ------------------------------------------------------------------ views
    @property
    def num_decoder_layers(self) -> int:
        decoder = self.dense_value("num_decoder_layers")
        return decoder if decoder is not None else self.num_layers

    @property
    def encoder_route_layers(self) -> list[int]:
        routed = self.routed_encoder_layers
        return list(range(self.num_layers)) if routed is None else list(routed)

    @property
    def decoder_route_layers(self) -> list[int]:
        routed = self.routed_decoder_layers
        return list(range(self.num_decoder_layers)) if routed is None else list(routed)

    @property
    def route_layers(self) -> list[int]:
        """The routed blocks' indices in the router's layer order (encoder blocks, then decoder blocks)."""
        return self.encoder_route_layers + self.decoder_route_layers

    @property
    def route_names(self) -> list[str]:
        """Names of the routed blocks, in the order of the router's layer axis (`E3` = encoder block 3)."""
        return [f"E{i}" for i in self.encoder_route_layers] + [f"D{i}" for i in self.decoder_route_layers]

