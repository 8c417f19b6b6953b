"""RL log-probs at the LM head: memory of memkernels.linear_logprobs vs eager and TRL's own functions.

Run: python benchmarks/bench_logprobs.py            (CPU: about a minute on 2 cores; --small for a smoke run)
On a machine with a GPU it also times forward+backward (ms).

What each method computes, from the final hidden states (B, T, H) of a policy and the sampled tokens: per-token
log-probs at temperature 0.7 and the per-token entropy, with the loss ``sum(logp * advantage) + 0.01 * sum(H)``
(a policy-gradient term and an entropy bonus), then backward:
- eager: logits = hidden @ W.T, log_softmax, gather, -sum p log p (memkernels.fusions.loss.logprobs_reference);
- TRL selective_log_softmax: the model's logits, then trl's selective_log_softmax and entropy_from_logits (what
  trainers that get logits call; on CUDA trl runs its own Triton kernel over the logits, elsewhere chunked PyTorch);
- TRL chunked kernel: trl.kernels.ChunkedLogProbFunction from the hidden states, no logits (what TRL 1.16's
  GRPO/SFT/DPO trainers run through add_fused_lm_head; memkernels.integrations.trl.patch_trainer swaps it for
  linear_logprobs), at the vocabulary tile TRL passes. Off CUDA it runs its PyTorch fallback (whole float32 tiles
  of 4096 tokens), so its CPU rows say little about its GPU memory; on meta it does not run (it asks autocast
  about the device);
- memkernels: linear_logprobs(hidden, W, tokens, temperature=0.7, return_entropy=True): no logits.

Columns (bytes, measured by memkernels.meters, never from formulas):
- extra peak: peak live bytes over forward+backward minus the gradients every method returns (d hidden, d W);
- held: bytes saved for backward that saved-tensor hooks see (SavedBytesMeter.new_bytes), per token too.
The Llama-3-8B head rows (H 4096, V 128256, bf16, 8k and 64k tokens) run on the meta device: every allocation
is made and counted, no arithmetic is done (a CPU could not run the 64k row's GEMMs in a benchmark's time).
"""
import argparse
import time

import torch
import torch.nn.functional as F

from memkernels.functional import linear_logprobs
from memkernels.fusions.loss.logprobs_reference import eager_linear_logprobs
from memkernels.meters import PeakBytesMeter, SavedBytesMeter

TEMPERATURE = 0.7
ENTROPY_BONUS = 0.01
# (sequences, tokens each, H, V, dtype, device): measured on the CPU, and Llama-3-8B's head on meta.
CPU_CONFIGS = [(2, 1024, 512, 32000, torch.float32, "cpu"), (2, 1024, 512, 32000, torch.bfloat16, "cpu")]
LLAMA_CONFIGS = [(1, 8192, 4096, 128256, torch.bfloat16, "meta"), (8, 8192, 4096, 128256, torch.bfloat16, "meta")]


def _eager(hidden, weight, tokens):
    logp, entropy = eager_linear_logprobs(hidden.flatten(0, -2), weight, tokens.flatten(), temperature=TEMPERATURE)
    return logp.view(tokens.shape), entropy.view(tokens.shape)


def _trl(hidden, weight, tokens):
    from trl.trainer.utils import entropy_from_logits, selective_log_softmax
    logits = F.linear(hidden, weight) / TEMPERATURE  # GRPOTrainer divides the model's logits by its temperature
    return selective_log_softmax(logits, tokens), entropy_from_logits(logits)


def _trl_chunked(hidden, weight, tokens):
    from trl.kernels import ChunkedLogProbFunction
    from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE

    logp, entropy, *_ = ChunkedLogProbFunction.apply(hidden.flatten(0, -2), weight, None, tokens.flatten(),
                                                     TEMPERATURE, _CHUNKED_LOGPROB_CHUNK_SIZE, None, 1.0, ("entropy",))
    return logp.view(tokens.shape), entropy.view(tokens.shape)


def _memkernels(hidden, weight, tokens):
    return linear_logprobs(hidden, weight, tokens, temperature=TEMPERATURE, return_entropy=True)


def methods():
    found = {"eager": _eager, "memkernels linear_logprobs": _memkernels}
    try:
        import trl.trainer.utils  # noqa: F401
        found["TRL selective_log_softmax"] = _trl
        try:
            from trl.kernels import ChunkedLogProbFunction  # noqa: F401
            from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE  # noqa: F401
            found["TRL chunked kernel"] = _trl_chunked
        except ImportError:
            print("this trl has no chunked log-prob kernel (TRL >= 1.16): its row is left out")
    except ImportError:
        print("trl is not installed: its row is left out (pip install trl)")
    return found


def make_inputs(n_sequences, n_tokens, hidden_size, n_classes, dtype, device):
    generator = torch.Generator(device="cpu").manual_seed(0)
    if device == "meta":
        hidden = torch.empty(n_sequences, n_tokens, hidden_size, dtype=dtype, device=device)
        weight = torch.empty(n_classes, hidden_size, dtype=dtype, device=device)
        tokens = torch.empty(n_sequences, n_tokens, dtype=torch.long, device=device)
        advantage = torch.empty(n_sequences, 1, device=device)
    else:
        hidden = torch.randn(n_sequences, n_tokens, hidden_size, generator=generator).to(device, dtype)
        weight = (torch.randn(n_classes, hidden_size, generator=generator) / hidden_size**0.5).to(device, dtype)
        tokens = torch.randint(0, n_classes, (n_sequences, n_tokens), generator=generator).to(device)
        advantage = torch.randn(n_sequences, 1, generator=generator).to(device)
    return hidden.requires_grad_(), weight.requires_grad_(), tokens, advantage


def _loss(method, hidden, weight, tokens, advantage):
    logp, entropy = method(hidden, weight, tokens)
    return (logp * advantage).sum() + ENTROPY_BONUS * entropy.sum()


def measure_memory(method, hidden, weight, tokens, advantage):
    hidden.grad = weight.grad = None
    with PeakBytesMeter() as whole:
        with SavedBytesMeter() as saved:
            loss = _loss(method, hidden, weight, tokens, advantage)
        loss.backward()
        del loss
    grads = hidden.grad.untyped_storage().nbytes() + weight.grad.untyped_storage().nbytes()
    return {"extra_peak": whole.peak_bytes - grads, "held": saved.new_bytes}


def mib(nbytes):
    return f"{nbytes / 2**20:12.1f}"


def memory_section(configs):
    verdicts = []
    for n_sequences, n_tokens, hidden_size, n_classes, dtype, device in configs:
        hidden, weight, tokens, advantage = make_inputs(n_sequences, n_tokens, hidden_size, n_classes, dtype, device)
        total = n_sequences * n_tokens
        name = str(dtype).replace("torch.", "")
        print(f"\n{n_sequences} x {n_tokens} = {total} tokens, H={hidden_size} V={n_classes} {name}, on {device}: "
              f"the logits alone are {mib(total * n_classes * hidden.element_size()).strip()} MiB")
        print(f"{'method':<28}{'extra peak MiB':>16}{'held MiB':>12}{'held B/token':>14}{'seconds':>9}")
        results = {}
        for label, method in methods().items():
            start = time.perf_counter()
            try:
                results[label] = r = measure_memory(method, hidden, weight, tokens, advantage)
            except RuntimeError as error:  # TRL's kernel asks autocast about the device, which meta has none of
                if device != "meta":
                    raise
                print(f"{label:<28}  not measurable on meta ({str(error).splitlines()[0][:60]})")
                continue
            print(f"{label:<28}{mib(r['extra_peak']):>16}{mib(r['held']):>12}{r['held'] / total:14.1f}"
                  f"{time.perf_counter() - start:9.1f}")
        ours, eager = results["memkernels linear_logprobs"], results["eager"]
        checks = [("memkernels holds <= 12 bytes a token", ours["held"] <= 12 * total),
                  ("memkernels extra peak <= eager's / 8", ours["extra_peak"] <= eager["extra_peak"] / 8)]
        if "TRL selective_log_softmax" in results:
            checks.append(("memkernels extra peak <= TRL selective_log_softmax's / 4",
                           ours["extra_peak"] <= results["TRL selective_log_softmax"]["extra_peak"] / 4))
        for text, ok in checks:
            print(f"  target: {text}: {'met' if ok else 'MISSED'}")
            verdicts.append(ok)
        del hidden, weight, tokens
    return all(verdicts)


def timing_section(configs, repeats=10):
    print(f"\nGPU forward+backward, ms (median of {repeats} after warm-up), same inputs for every method")
    for n_sequences, n_tokens, hidden_size, n_classes, dtype, _ in configs:
        hidden, weight, tokens, advantage = make_inputs(n_sequences, n_tokens, hidden_size, n_classes, dtype, "cuda")
        row = []
        for label, method in methods().items():
            times = []
            try:
                for step in range(repeats + 2):
                    hidden.grad = weight.grad = None
                    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    begin.record()
                    _loss(method, hidden, weight, tokens, advantage).backward()
                    end.record()
                    torch.cuda.synchronize()
                    if step >= 2:
                        times.append(begin.elapsed_time(end))
                row.append(f"{label} {sorted(times)[len(times) // 2]:.2f}")
            except torch.cuda.OutOfMemoryError:
                row.append(f"{label} out of memory")
            torch.cuda.empty_cache()
        print(f"{n_sequences} x {n_tokens} tokens H={hidden_size} V={n_classes} {dtype}: " + " | ".join(row))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="small configs only (a smoke run; no Llama rows)")
    args = parser.parse_args()
    configs = [(2, 64, 32, 1000, torch.float32, "cpu")] if args.small else CPU_CONFIGS + LLAMA_CONFIGS
    print(f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads")
    all_met = memory_section(configs)
    print("\nall memory targets met" if all_met else "\nsome memory targets MISSED")
    if torch.cuda.is_available():
        # Llama-3-8B's head at 8k tokens: eager's logits and log-softmax fit an 80 GB GPU; its 64k row may not.
        timing_section([(1, 8192, 4096, 128256, torch.bfloat16, "cuda"), (8, 8192, 4096, 128256, torch.bfloat16,
                                                                           "cuda")])
    else:
        print("no GPU: timing section skipped")


if __name__ == "__main__":
    main()
