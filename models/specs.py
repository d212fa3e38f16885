"""What the server needs to know of a zoo model, without torch: its tensors' specs.

`dstack serve` looks up each served model's inputs and outputs at start-up; importing the
zoo itself (`models.registry`, which builds the models) imports torch and torchvision, about
4 s of CPU and a few hundred MB in a process that never runs a model. The specs of the
zoo's own models are here; `models.registry` uses them too. A name not here (a model
registered at run time, or a classifier of a newer torchvision) is looked up in the zoo.
"""

from __future__ import annotations

from dstack.common.types import DType, ModelSpec, TensorSpec

DEFAULT_MAX_BATCH = 64

#: Image sizes other than 224 (torchvision's ViT-H/14 takes a fixed one).
INPUT_SIZE = {"inception_v3": 299, "vit_h_14": 518}

#: torchvision's image classifiers, `torchvision.models.list_models(module=torchvision.models)`
#: in the torchvision of constraints.txt (tests/unit/test_model_specs.py checks the one
#: installed).
TORCHVISION_CLASSIFIERS = frozenset({
    "alexnet", "convnext_base", "convnext_large", "convnext_small", "convnext_tiny",
    "densenet121", "densenet161", "densenet169", "densenet201", "efficientnet_b0",
    "efficientnet_b1", "efficientnet_b2", "efficientnet_b3", "efficientnet_b4",
    "efficientnet_b5", "efficientnet_b6", "efficientnet_b7", "efficientnet_v2_l",
    "efficientnet_v2_m", "efficientnet_v2_s", "googlenet", "inception_v3", "maxvit_t",
    "mnasnet0_5", "mnasnet0_75", "mnasnet1_0", "mnasnet1_3", "mobilenet_v2",
    "mobilenet_v3_large", "mobilenet_v3_small", "regnet_x_16gf", "regnet_x_1_6gf",
    "regnet_x_32gf", "regnet_x_3_2gf", "regnet_x_400mf", "regnet_x_800mf", "regnet_x_8gf",
    "regnet_y_128gf", "regnet_y_16gf", "regnet_y_1_6gf", "regnet_y_32gf", "regnet_y_3_2gf",
    "regnet_y_400mf", "regnet_y_800mf", "regnet_y_8gf", "resnet101", "resnet152",
    "resnet18", "resnet34", "resnet50", "resnext101_32x8d", "resnext101_64x4d",
    "resnext50_32x4d", "shufflenet_v2_x0_5", "shufflenet_v2_x1_0", "shufflenet_v2_x1_5",
    "shufflenet_v2_x2_0", "squeezenet1_0", "squeezenet1_1", "swin_b", "swin_s", "swin_t",
    "swin_v2_b", "swin_v2_s", "swin_v2_t", "vgg11", "vgg11_bn", "vgg13", "vgg13_bn",
    "vgg16", "vgg16_bn", "vgg19", "vgg19_bn", "vit_b_16", "vit_b_32", "vit_h_14",
    "vit_l_16", "vit_l_32", "wide_resnet101_2", "wide_resnet50_2",
})


class ModelZooError(ValueError):
    """An unknown model name, a bad builder reference or an unreadable weights file."""


def image_spec(name: str, size: int = 224, classes: int = 1000) -> ModelSpec:
    return ModelSpec(
        name=name,
        inputs=(TensorSpec("input", DType.FP32, (-1, 3, size, size)),),
        outputs=(TensorSpec("output", DType.FP32, (-1, classes)),),
        max_batch_size=DEFAULT_MAX_BATCH,
    )


TINY_CNN_SPEC = ModelSpec(
    "tiny_cnn",
    (TensorSpec("input", DType.FP32, (-1, 3, 32, 32)),),
    (TensorSpec("output", DType.FP32, (-1, 10)),),
    DEFAULT_MAX_BATCH,
)


def builtin_spec(name: str) -> ModelSpec | None:
    """The spec of one of the zoo's own models, or None for any other name."""
    if name == "tiny_cnn":
        return TINY_CNN_SPEC
    if name == "pool_linear" or name in TORCHVISION_CLASSIFIERS:
        return image_spec(name, INPUT_SIZE.get(name, 224))
    return None
