"""TRL's trainers scoring tokens with :func:`memkernels.functional.linear_logprobs`.

``trl`` is imported when this module is, not by ``import memkernels``.

    model = AutoModelForCausalLM.from_pretrained(...)
    memkernels.apply(model)                        # norms, MLPs, RoPE (before the trainer is built)
    trainer = GRPOTrainer(model=model, reward_funcs=..., args=..., train_dataset=...)
    memkernels.integrations.trl.patch_trainer(trainer)
    trainer.train()

How TRL computes per-token log-probabilities (TRL 1.16): each trainer's ``__init__`` calls the public
``trl.trainer.utils.add_fused_lm_head(model, temperature, cast_lm_head_to_fp32, outputs)``, which replaces
the model's ``forward`` (an instance attribute) with one that, when called with ``fused_lm_head=True``,
runs the backbone, shifts the labels, takes the head from ``model.get_output_embeddings()``, reads the
softcap and logit scale from the config, and hands hidden states, head weight and bias, labels,
temperature, softcap and scale to its chunked kernel ``trl.kernels.ChunkedLogProbFunction`` (looked up
as ``trl.trainer.utils._ChunkedLogProbFunction`` at each call). It returns a ``FusedCausalLMOutput``:
``log_probs`` and ``entropy`` per token (and, when the trainer asked for them, ``is_top1``,
``mean_logits``, ``log_sum_sq_probs``), zero where the label is -100. Every trainer goes through it:

- ``GRPOTrainer`` / ``RLOOTrainer``: ``_get_per_token_logps_and_entropies`` calls
  ``model(..., labels=..., fused_lm_head=True)`` for the policy's log-probs and entropies (loss,
  ``entropy`` metric, entropy mask and bonus), the old policy's and the reference's log-probs;
- ``SFTTrainer.compute_loss``: the loss from ``log_probs``, the ``entropy`` and
  ``mean_token_accuracy`` metrics from ``entropy`` and ``is_top1``;
- ``DPOTrainer._compute_loss`` / ``compute_ref_log_probs``: chosen and rejected log-probs (summed
  ``log_probs``), the ``logits/*`` and accuracy metrics from ``mean_logits`` and ``is_top1``;
- ``KTOTrainer`` likewise.

:func:`patch_trainer` keeps TRL's forward (its shift, masking, loss normalization, MoE auxiliary loss,
device handling) and changes only which kernel scores the tokens inside it: it registers the head
weights of the trainer's model and reference model (``get_output_embeddings()``, which must be an
``nn.Linear``), and puts a dispatcher in the one place TRL's forward looks its kernel up, the module
global ``trl.trainer.utils._ChunkedLogProbFunction`` (once per process;
``trl.kernels.ChunkedLogProbFunction`` itself is not touched). A kernel call with a registered head
weight is scored by ``linear_logprobs`` (logits ``(hidden * scale) @ W.T + bias * scale``, softcapped,
divided by the temperature: TRL's formula, with TRL's arguments), which gives ``log_probs`` and
``entropy`` with their gradients, and the per-token metrics TRL asks for (``is_top1``, ``mean_logits``,
``log_sum_sq_probs``: SFT's token accuracy, DPO's ``logits/*``) from the same pass over each row
(``return_metrics``); any other call is TRL's kernel, untouched (other models in the
process, a head replaced after patching, e.g. by FSDP). A DeepSpeed ZeRO-3 partitioned head stays on TRL's
kernel: TRL gathers it only for the duration of its kernel's forward and again in its backward, while
``linear_logprobs`` reads the weight in its backward too.

Inside an autocast region the tokens are scored in the region's dtype, as TRL's kernel does (with
``cast_lm_head_to_fp32`` TRL turns autocast off and hands float32 hidden states: float32 then).

:data:`counts` tells which path ran: ``"linear_logprobs"`` (calls scored by ``linear_logprobs``),
``"trl_kernel"`` (a registered head TRL's kernel scored: ZeRO-3).

What :func:`patch_trainer` relies on is checked when it runs, on the installed TRL's code: the model's
``forward`` is ``add_fused_lm_head``'s (found under wrappers such as accelerate's autocast; a function
taking ``fused_lm_head`` whose code looks up ``_ChunkedLogProbFunction``), and
``ChunkedLogProbFunction.forward`` takes ``(hidden, weight, bias, targets, temperature, chunk_size,
final_logit_softcapping, logit_scale, outputs)`` and returns the outputs in ``OPTIONAL_OUTPUTS``' order;
otherwise :class:`UnsupportedTRL` says what differs, with the installed and the supported TRL versions.
"""
import collections
import functools
import inspect
import weakref

import torch
import trl
from torch import nn

from memkernels.fusions.common.autocast import compute_dtype

__all__ = ["patch_trainer", "unpatch_trainer", "counts", "UnsupportedTRL", "SUPPORTED_TRL"]

SUPPORTED_TRL = "1.16"  # the TRL whose add_fused_lm_head / ChunkedLogProbFunction this was written and tested against

counts = collections.Counter()
"""Kernel calls by path since import: ``"linear_logprobs"``, ``"trl_kernel"`` (see above)."""

# What TRL's kernel takes (after ctx) and the per-token outputs it returns after log_probs, in order.
_KERNEL_PARAMETERS = ("hidden", "weight", "bias", "targets", "temperature", "chunk_size", "final_logit_softcapping",
                      "logit_scale", "outputs")
_OPTIONAL_OUTPUTS = ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
_METRIC_OUTPUTS = ("log_sum_sq_probs", "mean_logits", "is_top1")  # no gradient: linear_logprobs' return_metrics

# id(head weight) -> weakref to it, for the models patch_trainer patched: TRL's kernel called with one of these
# weights is scored by linear_logprobs.
_HEADS = {}


class UnsupportedTRL(RuntimeError):
    """The installed TRL does not compute log-probabilities the way :func:`patch_trainer` relies on."""


def _unsupported(what):
    return UnsupportedTRL(
        f"memkernels.integrations.trl cannot patch this trainer: {what}. It supports TRL {SUPPORTED_TRL}.x, whose "
        "trainers score tokens through trl.trainer.utils.add_fused_lm_head's model forward and its kernel "
        f"trl.kernels.ChunkedLogProbFunction; the installed TRL is {trl.__version__}. Train without "
        "patch_trainer (TRL's own kernel), or install TRL " + SUPPORTED_TRL + ".x.")


def _require_linear_logprobs():
    try:
        from memkernels.functional import linear_logprobs  # noqa: F401
    except ImportError as error:
        raise RuntimeError("memkernels.integrations.trl.patch_trainer: memkernels.functional.linear_logprobs is not "
                           f"available in this memkernels installation ({error})") from error


def _trl_utils():
    import trl.trainer.utils as utils

    return utils


def _kernel_parameters(kernel):
    forward = getattr(kernel, "forward", None)
    if forward is None:
        return None
    return tuple(inspect.signature(forward).parameters)[1:]  # after ctx


class _Kernel:
    """What ``trl.trainer.utils._ChunkedLogProbFunction`` names once :func:`patch_trainer` ran: ``apply`` with a
    registered head weight scores with ``linear_logprobs``; with any other weight it is TRL's kernel."""

    def __init__(self, trl_kernel):
        self.trl_kernel = trl_kernel
        self._signature = inspect.signature(trl_kernel.forward)

    def __getattr__(self, name):
        return getattr(self.trl_kernel, name)

    def apply(self, *args, **kwargs):
        bound = self._signature.bind(None, *args, **kwargs)  # TRL's argument names and defaults
        bound.apply_defaults()
        arguments = dict(bound.arguments)
        arguments.pop(next(iter(self._signature.parameters)))  # ctx
        if not _is_patched_head(arguments["weight"]):
            return self.trl_kernel.apply(*args, **kwargs)
        if _is_partitioned(arguments["weight"]) or _is_partitioned(arguments["bias"]):
            counts["trl_kernel"] += 1
            return self.trl_kernel.apply(*args, **kwargs)
        return _score(**arguments)


def _is_patched_head(weight):
    ref = _HEADS.get(id(weight))
    return ref is not None and ref() is weight


def _is_partitioned(parameter):
    """A DeepSpeed ZeRO-3 parameter: gathered only inside TRL's kernel, so only that kernel may read it."""
    return parameter is not None and hasattr(parameter, "ds_id")


def _score(hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping, logit_scale, outputs):
    """TRL's kernel's five outputs, by ``linear_logprobs`` (which sizes its own chunks: TRL's chunk_size is not used)."""
    from memkernels.functional import linear_logprobs

    # TRL's kernel computes in the autocast dtype inside an autocast region, else in the hidden states' dtype
    # (float32 under cast_lm_head_to_fp32, where TRL turns autocast off and casts the hidden states).
    dtype = compute_dtype(hidden)
    scaled_hidden, scaled_weight = hidden.to(dtype), weight.to(dtype)
    scaled_bias = None if bias is None else bias.to(dtype)
    if logit_scale != 1.0:  # (h @ W.T + b) * s == (h * s) @ W.T + b * s
        scaled_hidden = scaled_hidden * logit_scale
        scaled_bias = None if scaled_bias is None else scaled_bias * logit_scale
    with_entropy = "entropy" in outputs
    wanted = tuple(name for name in _METRIC_OUTPUTS if name in outputs)
    scored = linear_logprobs(scaled_hidden, scaled_weight, targets, bias=scaled_bias, temperature=temperature,
                             softcap=final_logit_softcapping, return_entropy=with_entropy, return_metrics=bool(wanted))
    scored = scored if isinstance(scored, tuple) else (scored,)
    log_probs, entropy = scored[0], (scored[1] if with_entropy else None)
    counts["linear_logprobs"] += 1
    metrics = {}
    if wanted:  # from the same pass over each row (linear_logprobs' return_metrics), no second projection
        computed = scored[-1]
        values = {"log_sum_sq_probs": computed.log_sum_sq_probs, "mean_logits": computed.mean_logit,
                  "is_top1": computed.is_top1}
        metrics = {name: values[name] for name in wanted}
    return (log_probs, entropy, *(metrics.get(name) for name in _METRIC_OUTPUTS))


def _checked_kernel():
    """TRL's kernel where its fused forward looks it up (ours if already installed); UnsupportedTRL when the
    installed TRL has none of the expected shape."""
    utils = _trl_utils()
    if not callable(getattr(utils, "add_fused_lm_head", None)):
        raise _unsupported("trl.trainer.utils has no add_fused_lm_head")
    kernel = getattr(utils, "_ChunkedLogProbFunction", None)
    if isinstance(kernel, _Kernel):
        return kernel
    if kernel is None or not callable(getattr(kernel, "apply", None)):
        raise _unsupported("trl.trainer.utils has no _ChunkedLogProbFunction kernel")
    parameters = _kernel_parameters(kernel)
    if parameters != _KERNEL_PARAMETERS:
        raise _unsupported(f"its ChunkedLogProbFunction.forward takes {parameters}, not {_KERNEL_PARAMETERS}")
    from trl.kernels import chunked_logprob

    if tuple(getattr(chunked_logprob, "OPTIONAL_OUTPUTS", ())) != _OPTIONAL_OUTPUTS:
        raise _unsupported(f"its kernel's per-token outputs are {getattr(chunked_logprob, 'OPTIONAL_OUTPUTS', None)}, "
                           f"not {_OPTIONAL_OUTPUTS}")
    return kernel


def _install_kernel(kernel):
    """Put :class:`_Kernel` where TRL's fused forward looks its kernel up (once)."""
    if not isinstance(kernel, _Kernel):
        _trl_utils()._ChunkedLogProbFunction = _Kernel(kernel)


def _is_trl_fused_forward(function):
    code = getattr(function, "__code__", None)
    return (code is not None and code.co_name == "_fused_forward"
            and getattr(function, "__globals__", {}).get("__name__") == "trl.trainer.utils")


def _trl_fused_forward(model, role):
    """The function add_fused_lm_head made ``model``'s forward, found under the wrappers put around it since
    (accelerate's autocast around a reference model's forward keeps the one it wrapped as ``_original_forward``);
    UnsupportedTRL when there is none, or it does not call the kernel as TRL 1.16's does."""
    seen, todo = set(), [model.__dict__.get("forward"), model.__dict__.get("_original_forward")]
    while todo:
        candidate = todo.pop()
        if candidate is None or id(candidate) in seen:
            continue
        seen.add(id(candidate))
        function = getattr(candidate, "__func__", candidate)
        if _is_trl_fused_forward(function):
            code = function.__code__
            if "fused_lm_head" not in code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]:
                raise _unsupported(f"the fused forward of the trainer's {role} takes no fused_lm_head argument")
            if "_ChunkedLogProbFunction" not in code.co_names:
                raise _unsupported(f"the fused forward of the trainer's {role} does not call _ChunkedLogProbFunction")
            return function
        todo.extend(getattr(x, "__wrapped__", None) for x in (candidate, function))
    raise _unsupported(f"the trainer's {role} ({type(model).__name__}) has no forward from "
                       "trl.trainer.utils.add_fused_lm_head (was the trainer built by this TRL?)")


def _head_weight(model, role):
    """The weight of ``model``'s output embedding, an ``nn.Linear``'s (ValueError for any other head)."""
    head = model.get_output_embeddings() if callable(getattr(model, "get_output_embeddings", None)) else None
    if not isinstance(head, nn.Linear):
        raise ValueError(f"memkernels.integrations.trl: the trainer's {role} ({type(model).__name__}) has an output "
                         f"embedding of type {type(head).__name__}, not an nn.Linear: linear_logprobs scores with "
                         "a plain (vocab, hidden) head weight")
    return head.weight


def _unwrapped(model):
    get_base_model = getattr(model, "get_base_model", None)  # peft: TRL patched the base model
    return get_base_model() if callable(get_base_model) else model


def _models(trainer):
    models = [("model", _unwrapped(trainer.model))]
    ref_model = getattr(trainer, "ref_model", None)
    if ref_model is not None and _unwrapped(ref_model) is not models[0][1]:
        models.append(("ref_model", _unwrapped(ref_model)))
    return models


def patch_trainer(trainer):
    """Score ``trainer``'s tokens with ``linear_logprobs``: its model's (and reference model's) log-probs and
    entropies, with their gradients, in every ``fused_lm_head=True`` call TRL makes (module docstring).

    Call it after the trainer is built (TRL installs its fused forward in ``__init__``) and before
    ``train()``. Calling it again does nothing. Returns the trainer.

    Raises :class:`UnsupportedTRL` when the installed TRL does not compute log-probabilities through
    ``add_fused_lm_head`` as TRL 1.16 does, ``ValueError`` when a model's output embedding is not an
    ``nn.Linear``, ``RuntimeError`` when this memkernels has no ``linear_logprobs``. Nothing is changed
    when any is raised.
    """
    _require_linear_logprobs()
    kernel = _checked_kernel()
    heads = []
    for role, model in _models(trainer):  # check every model before changing anything
        _trl_fused_forward(model, role)
        heads.append(_head_weight(model, role))
    if not isinstance(kernel, _Kernel):
        _trl_utils()._ChunkedLogProbFunction = _Kernel(kernel)
    for weight in heads:
        _HEADS[id(weight)] = weakref.ref(weight, functools.partial(_forget, id(weight)))
    return trainer


def unpatch_trainer(trainer):
    """Give ``trainer``'s models back to TRL's kernel (the models' current heads). Returns the trainer."""
    for role, model in _models(trainer):
        head = model.get_output_embeddings() if callable(getattr(model, "get_output_embeddings", None)) else None
        weight = getattr(head, "weight", None)
        if _is_patched_head(weight):
            del _HEADS[id(weight)]
    return trainer


def _forget(key, ref):
    if _HEADS.get(key) is ref:
        del _HEADS[key]
