"""apply()'s rules for GELU MLPs (the activated tensor is never stored: ``gelu_linear`` recomputes it in backward):
memkernels' own ``MLP`` → ``FusedMLP``; Hugging Face GPT-2's Conv1D MLP, BERT's intermediate/output pair and
the vision towers' fc1/fc2 MLPs (:data:`FC_MLPS`) → their own class with ``gelu_linear`` for the second
projection."""
from torch import nn

from memkernels.fusions.gated_mlp.module import gated_activation
from memkernels.fusions.rule import Rule, missing_op, plain_reason, set_child, switch_class
from memkernels.models import MLP


def _conv1d():
    from transformers.pytorch_utils import Conv1D
    return Conv1D


def gelu_approximation(act):
    """'none' / 'tanh' (nn.GELU's ``approximate``) for a GELU activation module, None for anything else; read
    from the one table of activation modules (:func:`memkernels.fusions.gated_mlp.module.gated_activation`)."""
    return {"gelu": "none", "gelu_tanh": "tanh"}.get(gated_activation(act))


class _FusedGPT2MLP:
    """GPT-2's MLP (Conv1D c_fc → GELU → Conv1D c_proj → dropout) with gelu_linear.

    Conv1D stores its weight as (in, out); ``gelu_linear`` takes (out, in), so it
    gets the transposed view: same parameter, same state_dict.
    """

    def forward(self, hidden_states):
        from memkernels.fusions.gelu_mlp.op import gelu_linear
        h = self.c_fc(hidden_states)
        out = gelu_linear(h, self.c_proj.weight.t(), self.c_proj.bias, approximate=self._memkernels_gelu)
        return self.dropout(out)


class _FusedFcMLP:
    """A vision tower's MLP (fc1 → GELU activation_fn → fc2: SigLIP's, CLIP's) with gelu_linear for fc2."""

    def forward(self, hidden_states):
        from memkernels.fusions.gelu_mlp.op import gelu_linear
        h = self.fc1(hidden_states)
        return gelu_linear(h, self.fc2.weight, self.fc2.bias, approximate=self._memkernels_gelu)


# Hugging Face MLP classes whose forward is exactly fc2(activation_fn(fc1(x))) (read in transformers 5's modeling
# files); fused when the activation is a GELU.
FC_MLPS = ("SiglipMLP", "CLIPMLP")


class _FusedBertLayer:
    """BERT's feed-forward (intermediate.dense → GELU → output.dense → dropout → LayerNorm(+x)) fused."""

    def feed_forward_chunk(self, attention_output):
        from memkernels.fusions.gelu_mlp.op import gelu_linear
        h = self.intermediate.dense(attention_output)
        out = gelu_linear(h, self.output.dense.weight, self.output.dense.bias, approximate=self._memkernels_gelu)
        return self.output.LayerNorm(self.output.dropout(out) + attention_output)


def _not_gelu(act):
    return None if gelu_approximation(act) is not None else f"activation {type(act).__name__} is not GELU"


class _GeluMLPRule(Rule):
    """What the GELU MLP rules share: the op they need, and the swap of a Hugging Face MLP: its class switched to
    ``mixin`` (whose forward calls gelu_linear) with the approximation of its activation module (:meth:`act`)."""

    option = "mlp"
    mixin = None

    def act(self, module):
        """The module's GELU activation module."""
        raise NotImplementedError

    def require(self):
        try:
            import memkernels.fusions.gelu_mlp.module  # noqa: F401 (FusedMLP)
            import memkernels.fusions.gelu_mlp.op  # noqa: F401 (the subclasses' forwards call it)
        except ImportError as error:
            raise missing_op(self.option, error) from error

    def swap(self, model, name, module, settings):
        approximate = gelu_approximation(self.act(module))
        switch_class(module, self.mixin)
        module._memkernels_gelu = approximate


class MLPRule(_GeluMLPRule):
    """memkernels' own ``MLP`` (fc1 → GELU → fc2) → ``FusedMLP`` sharing its parameters."""

    kind = "mlp"

    def matches(self, module):
        return isinstance(module, MLP)

    def act(self, module):
        return module.act

    def blocker(self, module):
        if gelu_approximation(self.act(module)) is None:
            return "activation is not GELU"
        return plain_reason(module.fc1, (nn.Linear,), "fc1") or plain_reason(module.fc2, (nn.Linear,), "fc2")

    def swap(self, model, name, module, settings):
        from memkernels.fusions.gelu_mlp.module import FusedMLP

        approximate = gelu_approximation(self.act(module))
        set_child(model, name, FusedMLP.from_modules(module.fc1, nn.GELU(approximate=approximate), module.fc2))


class GPT2MLPRule(_GeluMLPRule):
    """GPT-2's MLP: c_proj (a plain Conv1D) becomes gelu_linear's weight, transposed."""

    kind, mixin = "gpt2_mlp", _FusedGPT2MLP

    def matches(self, module):
        return type(module).__name__ == "GPT2MLP"

    def act(self, module):
        return module.act

    def blocker(self, module):
        return plain_reason(module.c_proj, (_conv1d(),), "c_proj") or _not_gelu(self.act(module))


class FcMLPRule(_GeluMLPRule):
    """A vision tower's fc1 → GELU → fc2 MLP (:data:`FC_MLPS`)."""

    kind, mixin = "fc_mlp", _FusedFcMLP

    def matches(self, module):
        return type(module).__name__ in FC_MLPS and not isinstance(module, _FusedFcMLP)

    def act(self, module):
        return getattr(module, "activation_fn", None)

    def blocker(self, module):
        return _not_gelu(self.act(module)) or plain_reason(module.fc2, (nn.Linear,), "fc2")


class BertFeedForwardRule(_GeluMLPRule):
    """BERT's (and RoBERTa's) layer: its feed-forward chunk with gelu_linear for output.dense."""

    kind, mixin = "bert_ffn", _FusedBertLayer

    def matches(self, module):
        return type(module).__name__ in ("BertLayer", "RobertaLayer") and hasattr(module, "intermediate")

    def act(self, module):
        return module.intermediate.intermediate_act_fn

    def blocker(self, module):
        return plain_reason(module.output.dense, (nn.Linear,), "output.dense") or _not_gelu(self.act(module))
