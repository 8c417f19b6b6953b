"""Helpers shared by the tests of the activation GEMM kernel's ops (gelu_linear, gated_linear)."""


class KernelChoiceLog:
    """Stands in for one of the GEMM kernel's autotuned entries (memkernels.ops.gelu_linear._AUTOTUNED,
    which gated_linear launches too) and records which one ran."""

    def __init__(self, aligned, kernel, log):
        self.aligned, self.kernel, self.log = aligned, kernel, log

    def __getitem__(self, grid):
        self.log.append(self.aligned)
        return self.kernel[grid]


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
