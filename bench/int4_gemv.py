"""A measured prototype (issue #15): an int4 x int8 (VNNI) GEMV against torch's `_weight_int4pack_mm_for_cpu`.

    .venv/bin/python -m bench.int4_gemv                    # everything: ~1.5 minutes (plus 7-17 s to compile once)
    .venv/bin/python -m bench.int4_gemv --rows 1 --threads 1 --rounds 5

The kernel (bench/int4_gemv_kernel.cpp) quantizes x to int8 (one scale per 4 values, where llama.cpp's Q8_1
has one per 32) and takes u8 x s8 dot products with vpdpbusd, as llama.cpp's Q4_1 x Q8_1 does; it is not
wired into the engine. It is compiled here with
g++ straight into a torch op library (no ninja, which torch's cpp_extension.load needs and this venv lacks),
cached by the hash of source and flags under the temp folder.

The weights are the default model's own (SmolLM2-135M, GGUF Q4_1), fused as worker/model/build.py fuses
them (q/k/v, gate/up). The inputs are layer-0 activations of real tokens: the RMS-normed embeddings for
q/k/v and gate/up, the token's own V spread over the heads for o (an attention output's stand-in), and
SiLU(gate) * up for down. The two kernels alternate in every round (the host is shared); figures are
medians over rounds. Errors are against the float32 product of the same bfloat16 x with the dequantized
int4 weights.

Then the same comparison inside the engine, by swapping each Int4Linear for the new kernel in a loaded model
(this script only; nothing in worker/ changes): the median decode step (bench/threads.py's measure), and
bench/quality.py's KL against float32/none over the reference chats, torch's int4 kernel and the new one.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the worker runs (worker/config.py)

import torch
import torch.nn.functional as F
import torch.utils.cpp_extension as cpp_extension

from bench.quality import chat_logits, compare, find_reference, load_mode
from bench.threads import decode_step_ms
from worker.model.gguf_loader import read_gguf_checkpoint
from worker.model.loader import LoadedModel, default_model_path, load_model
from worker.model.quant_linear import Int4Linear, TieredLinear
from worker.model.weights import INT4_GROUP, Int4Blocks

SOURCE = pathlib.Path(__file__).with_name("int4_gemv_kernel.cpp")
FLAGS = ["-O3", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mavx512bf16", "-mfma", "-mf16c"]
SHAPES = ("qkv", "o", "gate_up", "down")
BLOCK_N = 16


def build() -> tuple[float, bool]:
    """Compile (or reuse) the op library and load it: (seconds spent compiling, whether it was cached)."""
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(["-std=c++20", *FLAGS, abi, torch.__version__]).encode()).hexdigest()[:16]
    library = pathlib.Path(tempfile.gettempdir()) / f"lmq_int4_gemv_{key}.so"
    started, cached = time.perf_counter(), library.exists()
    if not cached:
        includes = [f"-I{path}" for path in cpp_extension.include_paths()]
        (lib_dir,) = cpp_extension.library_paths()
        partial = library.with_suffix(f".{os.getpid()}.tmp")
        command = ["g++", "-std=c++20", "-shared", "-fPIC", abi, *FLAGS, *includes, str(SOURCE), "-o", str(partial),
                   f"-L{lib_dir}", f"-Wl,-rpath,{lib_dir}", "-ltorch", "-ltorch_cpu", "-lc10"]
        subprocess.run(command, check=True)
        partial.rename(library)
    torch.ops.load_library(str(library))
    return time.perf_counter() - started, cached


def pack(blocks: Int4Blocks) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Int4Blocks -> the kernel's (nibbles [N, K/2] u8, scales [N, G] fp16, mins [N/16, G, 16] fp16); see the .cpp."""
    q = blocks.q.to(torch.uint8)
    n, k = q.shape
    main = k - k % 128
    chunks = q[:, :main].reshape(n, main // 128, 2, 64)
    parts = [(chunks[:, :, 0] | (chunks[:, :, 1] << 4)).reshape(n, -1)]
    if k % 128:
        tail = q[:, main:].reshape(n, 2, 32)
        parts.append(tail[:, 0] | (tail[:, 1] << 4))
    nibbles = torch.cat(parts, dim=1).contiguous()
    scales = blocks.scale.to(torch.float16).contiguous()
    mins = (blocks.zero - 8 * blocks.scale).to(torch.float16)  # value = scale * q + min
    mins = mins.view(n // BLOCK_N, BLOCK_N, -1).transpose(1, 2).contiguous()
    return nibbles, scales, mins


class Layer:
    """One layer's four linears: the blocks, torch's Int4Linear and the packed copy for the new kernel."""

    def __init__(self, weights: dict, index: int) -> None:
        prefix = f"model.layers.{index}."
        names = {
            "qkv": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
            "o": ["self_attn.o_proj"],
            "gate_up": ["mlp.gate_proj", "mlp.up_proj"],
            "down": ["mlp.down_proj"],
        }
        self.blocks = {shape: Int4Blocks.cat([weights[f"{prefix}{name}.weight"].int4() for name in parts]) for shape, parts in names.items()}
        self.torch = {shape: Int4Linear(blocks, None, torch.bfloat16) for shape, blocks in self.blocks.items()}
        self.packed = {shape: pack(blocks) for shape, blocks in self.blocks.items()}

    def run_torch(self, shape: str, x: torch.Tensor) -> torch.Tensor:
        linear = self.torch[shape]
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, linear.packed, INT4_GROUP, linear.scale_and_zero)

    def run_new(self, shape: str, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.lmq_int4.int4_q8_mm(x, *self.packed[shape])


def layer0_inputs(weights: dict, layer: Layer, rows: int, eps: float) -> dict[str, torch.Tensor]:
    """Real-token layer-0 activations [rows, K] in bfloat16 for each of the four shapes (see the module doc)."""
    generator = torch.Generator().manual_seed(0)
    embeddings = weights["model.embed_tokens.weight"].load()
    tokens = torch.randint(0, embeddings.shape[0], (rows,), generator=generator)
    hidden = embeddings[tokens].float()

    def norm(x: torch.Tensor, name: str) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), weights[f"model.layers.0.{name}.weight"].load().float(), eps)

    dense = {shape: blocks.dequantize() for shape, blocks in layer.blocks.items()}
    x_attn, x_mlp = norm(hidden, "input_layernorm"), norm(hidden, "post_attention_layernorm")
    v = (x_attn @ dense["qkv"].T)[:, -192:]  # 3 KV heads of 64; o sees 9 heads, each its group's V
    x_o = v.view(rows, 3, 1, 64).expand(rows, 3, 3, 64).reshape(rows, 576)
    gate, up = (x_mlp @ dense["gate_up"].T).chunk(2, dim=-1)
    inputs = {"qkv": x_attn, "o": x_o, "gate_up": x_mlp, "down": F.silu(gate) * up}
    return {shape: x.to(torch.bfloat16).contiguous() for shape, x in inputs.items()}


def errors(y: torch.Tensor, reference: torch.Tensor) -> tuple[float, float]:
    """(max abs error, relative error ||y - ref|| / ||ref||)."""
    difference = y.float() - reference
    return difference.abs().max().item(), (difference.norm() / reference.norm()).item()


def timed(function, calls: int) -> float:
    started = time.perf_counter()
    for _ in range(calls):
        function()
    return (time.perf_counter() - started) / calls


def alternate(functions: dict[str, callable], rounds: int, budget_s: float) -> dict[str, list[float]]:
    """Per-call seconds of each function, `rounds` times, the order flipping every round."""
    for function in functions.values():
        function()
    calls = max(1, int(budget_s / max(timed(function, 3) for function in functions.values())))
    samples: dict[str, list[float]] = {name: [] for name in functions}
    names = list(functions)
    for round_index in range(rounds):
        for name in names if round_index % 2 == 0 else names[::-1]:
            samples[name].append(timed(functions[name], calls))
    return samples


def accuracy_table(layer: Layer, inputs: dict[str, torch.Tensor]) -> None:
    print("\naccuracy vs float32 x_bf16 @ dequantized(W)^T, layer 0, 8 rows of real-token activations")
    print("| shape | torch bf16 out: max abs / rel | new, bf16 out: max abs / rel | new, f32 x and out (Q8 only): max abs / rel |")
    print("|---|---|---|---|")
    for shape in SHAPES:
        x = inputs[shape]
        reference = x.float() @ layer.blocks[shape].dequantize().T
        cells = [errors(layer.run_torch(shape, x), reference), errors(layer.run_new(shape, x), reference),
                 errors(layer.run_new(shape, x.float()), reference)]
        print(f"| {shape} | " + " | ".join(f"{abs_error:.2e} / {relative:.2e}" for abs_error, relative in cells) + " |")


def shape_table(layer: Layer, inputs: dict[str, torch.Tensor], rows_list: list[int], threads_list: list[int], rounds: int) -> None:
    print(f"\nper call, one matrix in a loop (weights hot in L2), median of {rounds} alternated rounds; µs")
    print("| shape (N x K) | rows | threads | torch µs | new µs | speedup |")
    print("|---|---:|---:|---:|---:|---:|")
    for shape in SHAPES:
        n, k = layer.blocks[shape].q.shape
        for rows in rows_list:
            x = inputs[shape][:rows].contiguous()
            for threads in threads_list:
                torch.set_num_threads(threads)
                samples = alternate({"torch": lambda: layer.run_torch(shape, x), "new": lambda: layer.run_new(shape, x)}, rounds, 0.004)
                old, new = (statistics.median(samples[name]) * 1e6 for name in ("torch", "new"))
                print(f"| {shape} ({n} x {k}) | {rows} | {threads} | {old:.1f} | {new:.1f} | {old / new:.2f}x |")


def step_table(layers: list[Layer], inputs: dict[str, torch.Tensor], rows_list: list[int], threads_list: list[int], rounds: int) -> None:
    print(f"\nall {len(layers)} layers x 4 linears, each matrix once per step (weights streamed as in a decode step); ms per step, median (min) of {rounds} alternated rounds")
    print("| rows | threads | torch ms | new ms | speedup | new: weight GB/s |")
    print("|---:|---:|---:|---:|---:|---:|")
    weight_bytes = sum(sum(t.numel() * t.element_size() for t in layer.packed[shape]) for layer in layers for shape in SHAPES)
    for rows in rows_list:
        x = {shape: inputs[shape][:rows].contiguous() for shape in SHAPES}
        for threads in threads_list:
            torch.set_num_threads(threads)

            def step(run) -> None:
                for layer in layers:
                    for shape in SHAPES:
                        run(layer, shape, x[shape])

            samples = alternate({"torch": lambda: step(Layer.run_torch), "new": lambda: step(Layer.run_new)}, rounds, 0.03)
            old, new = (statistics.median(samples[name]) * 1e3 for name in ("torch", "new"))
            best_old, best_new = (min(samples[name]) * 1e3 for name in ("torch", "new"))
            print(f"| {rows} | {threads} | {old:.2f} ({best_old:.2f}) | {new:.2f} ({best_new:.2f}) | {old / new:.2f}x | {weight_bytes / new / 1e6:.1f} |")


class Q8Linear(torch.nn.Module):
    """The new kernel as a module, a drop-in for Int4Linear (bias-free linears only, as the default model's)."""

    def __init__(self, packed: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
        super().__init__()
        self.packed = packed
        self.in_features, self.out_features = packed[0].shape[1] * 2, packed[0].shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).contiguous()
        return torch.ops.lmq_int4.int4_q8_mm(flat, *self.packed).view(*x.shape[:-1], self.out_features)


ENGINE_ATTRIBUTES = {"qkv": "qkv", "o": "o_proj", "gate_up": "gate_up", "down": "down"}


def use_new_kernel(loaded: LoadedModel, layers: list[Layer], new: bool) -> None:
    """Put Q8Linear (new) or the model's own Int4Linear (not new) in every int4 place of `loaded`'s layers."""
    for block, layer in zip(loaded.model.layers, layers, strict=True):
        originals = block.__dict__.setdefault("int4_originals", {})
        for shape, attribute in ENGINE_ATTRIBUTES.items():
            tiered = getattr(block, attribute)  # quant auto: TieredLinear(small=Int4Linear, dense=...)
            holder, name = (tiered, "small") if isinstance(tiered, TieredLinear) else (block, attribute)
            original = originals.setdefault(attribute, getattr(holder, name))
            if not isinstance(original, Int4Linear):
                raise TypeError(f"{attribute} is {type(original).__name__}, not Int4Linear")
            setattr(holder, name, Q8Linear(layer.packed[shape]) if new else original)
    if new:
        check_swap(loaded, layers[0])


def check_swap(loaded: LoadedModel, layer: Layer) -> None:
    """The swapped layer-0 linears agree with torch's on random rows (catches a fused order that differs)."""
    block = loaded.model.layers[0]
    for shape, attribute in ENGINE_ATTRIBUTES.items():
        x = torch.randn(3, layer.blocks[shape].q.shape[1]).to(torch.bfloat16)
        old, new = block.int4_originals[attribute](x).float(), layer.run_new(shape, x).float()
        relative = ((old - new).norm() / old.norm()).item()
        if relative > 0.05:
            raise AssertionError(f"{shape}: the new kernel disagrees with the model's Int4Linear ({relative:.3f})")


def engine_table(layers: list[Layer], rows_list: list[int], threads_list: list[int], rounds: int, tokens: int) -> None:
    loaded = load_model(dtype="auto", quant="auto", device="cpu")
    print(f"\nengine decode step, {loaded.dtype}/{loaded.quant} (int4 linears swapped), median step of the last 30 (bench/threads.py); "
          f"ms, per round, the two alternated")
    print("| rows | threads | torch int4 ms | new ms | speedup |")
    print("|---:|---:|---:|---:|---:|")
    for rows in rows_list:
        for threads in threads_list:
            figures: dict[bool, list[float]] = {False: [], True: []}
            for round_index in range(rounds):
                for new in (False, True) if round_index % 2 == 0 else (True, False):
                    use_new_kernel(loaded, layers, new)
                    figures[new].append(decode_step_ms(loaded, rows, threads, tokens))
            old, new = statistics.median(figures[False]), statistics.median(figures[True])
            listed = lambda values: " / ".join(f"{value:.1f}" for value in values)  # noqa: E731
            print(f"| {rows} | {threads} | {listed(figures[False])} | {listed(figures[True])} | {old / new:.2f}x |")
    use_new_kernel(loaded, layers, False)


def quality_table(layers: list[Layer]) -> None:
    path = find_reference()
    if path is None:
        print("\nquality: the reference chats (smollm2-greedy.json) are not here; skipped")
        return
    chats = json.loads(path.read_text())["chat"]
    base = chat_logits(load_mode("float32/none"), chats)
    loaded = load_mode("bfloat16/int4")
    print(f"\nquality against float32/none, teacher-forced over {len(chats)} reference chats (bench/quality.py)")
    print("| kernel | mean KL (nats) | max KL | top-1 agreement, all | top-1 agreement, margin ≥ 0.5 |")
    print("|---|---:|---:|---:|---:|")
    for new, label in ((False, "bfloat16/int4, torch's kernel"), (True, "bfloat16/int4, new kernel (x in int8 per 4)")):
        use_new_kernel(loaded, layers, new)
        print(compare(base, chat_logits(loaded, chats)).row(label))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,2,4,8")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--step-rounds", type=int, default=15)
    parser.add_argument("--engine-rows", default="1,4", help="empty: skip the engine's decode step")
    parser.add_argument("--engine-rounds", type=int, default=3)
    parser.add_argument("--engine-tokens", type=int, default=48)
    parser.add_argument("--no-quality", action="store_true")
    args = parser.parse_args()
    rows_list = [int(value) for value in args.rows.split(",")]
    threads_list = [int(value) for value in args.threads.split(",")]

    seconds, cached = build()
    print(f"kernel library: {'loaded from cache' if cached else 'compiled'} in {seconds:.1f} s (g++ {' '.join(FLAGS)})")
    started = time.perf_counter()
    checkpoint = read_gguf_checkpoint(default_model_path())
    layers = [Layer(checkpoint.weights, index) for index in range(checkpoint.config.num_layers)]
    inputs = layer0_inputs(checkpoint.weights, layers[0], max(8, *rows_list), checkpoint.config.rms_norm_eps)
    print(f"weights: {len(layers)} layers read and packed in {time.perf_counter() - started:.1f} s; torch {torch.__version__}")

    accuracy_table(layers[0], inputs)
    shape_table(layers[0], inputs, rows_list, threads_list, args.rounds)
    step_table(layers, inputs, rows_list, threads_list, args.step_rounds)
    if not args.no_quality:
        quality_table(layers)
    if args.engine_rows:
        engine_rows = [int(value) for value in args.engine_rows.split(",")]
        engine_table(layers, engine_rows, threads_list, args.engine_rounds, args.engine_tokens)


if __name__ == "__main__":
    sys.exit(main())
