"""The fused ops as apply() puts them into a model: one folder per fusion (``norm/``, ``gelu_mlp/``, ``gated_mlp/``,
``rope/``, ``loss/``), each with the :class:`~memkernels.fusions.rule.Rule` that recognizes its modules by
structure; ``apply.py`` asks the rules in order (``memkernels.apply(model)``)."""
