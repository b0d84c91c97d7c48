"""The model protocol: what the platform needs of a model, and how ``model.factory`` builds one.

The trainer, the evaluation, the performance model and ``parallelize()`` use a model only through
this protocol, so a lab's own network trains, checkpoints, resumes and evaluates through the same
stages as the built-in one (trainer/models/video.py:VideoFlowModel, one implementation of it):

    model:
      factory: mypackage.models:build     # "" (the default): the built-in video model
      dim: 256                            # the ModelConfig fields are the factory's to read
      num_layers: 8
      num_heads: 4

``build(config: ExperimentConfig) -> torch.nn.Module`` returns a module that has

    blocks: nn.ModuleList
        The repeated layers. parallelize() wraps each in activation checkpointing and, under FSDP,
        makes each one sharding unit; the rest of the module is the root unit.
    init_weights(*, seed: int) -> None
        Deterministic initialization from the seed alone, on CPU, before the model is moved or sharded.
    noise_shape(clip_shape: (T, H, W)) -> tuple[int, ...]
        Shape of one sample's noise, and of one generated sample, for batches of that clip shape:
        the space the model generates in ([T, H, W, 3] pixels for a video model, [1, H, W, 3] for an
        image model, [A] for an audio model).
    forward(video, audio, has_audio, noise, t) -> Tensor [B]
        The per-sample rectified-flow loss, in fp32: with x0 the model's clean target for the batch,
        x_t = (1 - t) x0 + t noise and the loss the mean over a sample of (v_pred - (noise - x0))^2.
        video uint8 [B, T, H, W, 3], audio float32 [B, A], has_audio bool [B] (the batch contract,
        trainer/data.py); noise [B, *noise_shape]; t [B] in [0, 1]. Called through the DDP/FSDP
        wrapper, so gradients synchronize.
    predict_velocity(x_t, t, audio, has_audio) -> Tensor
        The velocity at noisy samples x_t [B, *noise_shape] and times t [B], conditioned on the
        clips' audio: what the sampler integrates (trainer/heldout.py).
    to_video(x) -> Tensor uint8 [B, T', H', W', 3]
        Generated samples (noise space, about [-1, 1]) as frames to watch; an image is one frame.
    flops_per_sample(clip_shape: (T, H, W)) -> int
        Training FLOPs (forward + backward) of one sample of that clip shape, for throughput and MFU.

Evaluation (trainer/heldout.py) runs the model in eval mode under no_grad and restores its train
mode and every buffer afterwards, so running statistics a norm keeps are not moved by held-out data.

The platform owns the noise and the timesteps (functions of the seed, the step and the sample key),
the batching, the parallelism and the precision; the model owns its data space and its network.
``check_model`` names what an object lacks; ``preflight`` runs it on a meta-device build before
anything launches, so a factory that does not import or a module that does not fit is refused there.
"""

from __future__ import annotations

import importlib
import inspect
from typing import TYPE_CHECKING, Any

from trainer.launch.refusal import Refusal

if TYPE_CHECKING:
    from torch import nn

    from trainer.launch.config import ExperimentConfig

BUILTIN_FACTORY = "trainer.models.video:build"
# Methods of the protocol, with their required parameter names (beyond self).
PROTOCOL_METHODS = {
    "init_weights": ("seed",),
    "noise_shape": ("clip_shape",),
    "forward": None,  # five positional tensors; names are the model's business
    "predict_velocity": None,
    "to_video": None,
    "flops_per_sample": ("clip_shape",),
}


class ModelProtocolError(Refusal):
    """model.factory does not import, or builds something the platform cannot train; names what."""

    def __init__(self, found: str, fix: str = "") -> None:
        super().__init__("config", found, fix or "correct model.factory ('package.module:function' building a model "
                                                 "that follows trainer/models/protocol.py), or set model.factory='' "
                                                 "for the built-in model", key="model.factory")


def factory_path(config: ExperimentConfig) -> str:
    return config.model.factory or BUILTIN_FACTORY


def load_factory(path: str) -> Any:
    """The callable at "package.module:attribute", or ModelProtocolError naming why not."""
    module_name, sep, attribute = path.partition(":")
    if not sep or not module_name or not attribute:
        raise ModelProtocolError(f"model.factory {path!r} must look like 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except Exception as error:  # an ImportError, or whatever the module raises while it imports
        raise ModelProtocolError(f"model.factory {path!r}: module {module_name!r} does not import: "
                                 f"{type(error).__name__}: {error}") from error
    factory = module
    for part in attribute.split("."):
        factory = getattr(factory, part, None)
        if factory is None:
            raise ModelProtocolError(f"model.factory {path!r}: module {module_name!r} has no {attribute!r}")
    if not callable(factory):
        raise ModelProtocolError(f"model.factory {path!r} is a {type(factory).__name__}, not a callable")
    return factory


def build_model(config: ExperimentConfig) -> nn.Module:
    """The configured model, built (on the current default device) and checked against the protocol."""
    path = factory_path(config)
    factory = load_factory(path)
    try:
        model = factory(config)
    except ModelProtocolError:
        raise
    except Exception as error:
        raise ModelProtocolError(f"model.factory {path!r} raised while building the model: "
                                 f"{type(error).__name__}: {error}") from error
    problems = check_model(model)
    if problems:
        raise ModelProtocolError(f"model.factory {path!r} returned a {type(model).__name__} that does not meet the "
                                 f"model protocol (trainer/models/protocol.py): {'; '.join(problems)}")
    return model


def check_model(model: Any) -> list[str]:
    """What ``model`` lacks of the protocol ([] when it has everything)."""
    from torch import nn

    if not isinstance(model, nn.Module):
        return [f"it is a {type(model).__name__}, not a torch.nn.Module"]
    problems = []
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, nn.ModuleList):
        problems.append("no `blocks` nn.ModuleList (the layers parallelize() wraps)")
    elif len(blocks) == 0:
        problems.append("`blocks` is empty: FSDP and activation checkpointing need at least one block")
    for name, parameters in PROTOCOL_METHODS.items():
        method = getattr(model, name, None)
        if not callable(method):
            problems.append(f"no `{name}` method")
            continue
        if name == "forward" and type(model).forward is nn.Module.forward:
            problems.append("no `forward` (the per-sample loss)")
            continue
        if parameters:
            accepted = inspect.signature(method).parameters
            missing = [p for p in parameters if p not in accepted
                       and not any(a.kind is inspect.Parameter.VAR_KEYWORD for a in accepted.values())]
            if missing:
                problems.append(f"`{name}` takes no {', '.join(missing)!s} argument")
    return problems


def check_factory(config: ExperimentConfig) -> int:
    """Build the configured model on the meta device (no memory) and check it: its parameter count.

    Also checks it answers ``noise_shape`` and ``flops_per_sample`` for every clip shape of the data,
    so a model that cannot take a bucket is refused before launch, not at its first batch of it.
    """
    import torch

    with torch.device("meta"):
        model = build_model(config)
    path = factory_path(config)
    for shape in config.data.video_shapes:
        try:
            noise_shape = tuple(model.noise_shape(tuple(shape)))
            flops = int(model.flops_per_sample(tuple(shape)))
        except Exception as error:
            raise ModelProtocolError(f"model.factory {path!r}: the model refuses clip shape {list(shape)}: "
                                     f"{type(error).__name__}: {error}") from error
        if not noise_shape or any(not isinstance(size, int) or size < 1 for size in noise_shape):
            raise ModelProtocolError(f"model.factory {path!r}: noise_shape({list(shape)}) is {noise_shape}, "
                                     f"not a shape of positive ints")
        if flops < 1:
            raise ModelProtocolError(f"model.factory {path!r}: flops_per_sample({list(shape)}) is {flops}; "
                                     f"it must be positive (throughput and MFU divide by it)")
    return sum(p.numel() for p in model.parameters())


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside a DDP wrapper (FSDP2 shards in place: the module is the model)."""
    return getattr(model, "module", model)
