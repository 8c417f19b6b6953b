"""Helpers shared by the tests of the activation-linear ops (gelu_linear, gated_linear)."""
import contextlib


def compile_recording_ops(fn):
    """``torch.compile(fn, fullgraph=True)`` through AOTAutograd, recording the call targets of the
    forward and backward graphs it produces: returns (compiled, {"forward": [...], "backward": [...]})."""
    import torch
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    torch._dynamo.reset()
    graph_ops = {"forward": [], "backward": []}

    def recorder(which):
        def compile_graph(gm, example_inputs):
            graph_ops[which].extend(str(node.target) for node in gm.graph.nodes if node.op == "call_function")
            return make_boxed_func(gm.forward)
        return compile_graph

    compiled = torch.compile(fn, fullgraph=True,
                             backend=aot_autograd(fw_compiler=recorder("forward"), bw_compiler=recorder("backward")))
    return compiled, graph_ops



@contextlib.contextmanager
def step_log(monkeypatch, spec, matmuls=False):
    """Yields a list that records, in order, each run of the OpSpec ``spec``'s steps inside the block as
    ``(step name, backend)``, and with ``matmuls`` every aten matmul as its name, inside the steps or not
    (the GEMMs are PyTorch's on both backends). In eager mode the ops call their steps' implementations
    directly (memkernels/fusions/op_spec.py), so the record is taken there."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    calls = []

    class MatmulLog(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.__name__.split(".")[0] in ("mm", "addmm", "addmm_"):
                calls.append(func.__name__.split(".")[0])
            return func(*args, **(kwargs or {}))

    for step in spec.all_steps.values():
        def recorded(*args, _run=step.run, _name=step.name.split("::")[1]):
            calls.append((_name, args[-1]))
            return _run(*args)
        monkeypatch.setattr(step, "run", recorded)
    with MatmulLog() if matmuls else contextlib.nullcontext():
        yield calls


def gemm_sum_lengths(inputs):
    """check_against_reference's ``sum_length`` for ``act(*inputs[:-2]) @ weight.T + bias``, with
    ``inputs`` ending in (weight [N, K], bias [N] or None): the output sums K products (and the
    bias), each activation input's gradient N, the weight's and the bias's gradients one term per
    token (M). Declared so that the floor admits any order of those sums: the GEMMs are the BLAS's
    (cuBLAS, the CPU's), which may add in blocks of any length."""
    *activation_inputs, weight, bias = inputs
    out_features, in_features = weight.shape
    tokens = activation_inputs[0].numel() // activation_inputs[0].shape[-1]
    lengths = {"output[0]": in_features + (bias is not None)}
    lengths.update({f"grad inputs[{index}]": out_features
                    for index, tensor in enumerate(activation_inputs) if tensor.requires_grad})
    for index, tensor in enumerate((weight, bias), start=len(activation_inputs)):
        if tensor is not None and tensor.requires_grad:
            lengths[f"grad inputs[{index}]"] = tokens
    return lengths
