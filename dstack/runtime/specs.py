"""The spec a served model is exposed with (its tensors and max batch), from its config."""

from __future__ import annotations

import sys

from dstack.common.config import ConfigError, ModelConfig
from dstack.common.types import DType, ModelSpec, TensorSpec
from models.specs import ModelZooError, builtin_spec


def served_spec(m: ModelConfig) -> ModelSpec:
    """The zoo's spec with the configured max batch (or one built from the config for a
    TorchScript / builder model outside the zoo). The zoo's own models are looked up
    without torch (`models.specs`); the zoo itself is asked about any other name, and
    about every name once a process has it (a model registered at run time counts)."""
    base = builtin_spec(m.zoo) if "models.registry" not in sys.modules else None
    try:
        if base is None:
            import models

            base = models.spec(m.zoo)
    except ModelZooError as e:
        if m.input_shape is None or m.num_classes is None:
            if m.torchscript is not None or m.builder is not None:
                raise ConfigError(
                    f"models.{m.name}: not in the zoo, so give input_shape and num_classes"
                ) from None
            raise ConfigError(f"models.{m.name}: {e}") from None
        base = ModelSpec(
            m.name,
            (TensorSpec("input", DType.FP32, (-1, *m.input_shape)),),
            (TensorSpec("output", DType.FP32, (-1, m.num_classes)),),
            m.max_batch_size,
        )
    if m.input_shape is not None:
        base = ModelSpec(base.name, (TensorSpec(base.inputs[0].name, base.inputs[0].datatype,
                                                (-1, *m.input_shape)), *base.inputs[1:]),
                         base.outputs, base.max_batch_size)
    return ModelSpec(m.name, base.inputs, base.outputs, m.max_batch_size)
