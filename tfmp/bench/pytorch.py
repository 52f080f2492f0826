"""The bench's optional PyTorch column: torchvision's ResNet-50, or a BERT-base-sized encoder
built like the bench's Keras one, trained with PyTorch's own mixed precision (autocast, and a
GradScaler for float16) on the same device, in the same bench run, as a user who picked
PyTorch instead would train it.

It runs in a subprocess, by this file's path (`python pytorch.py --policies=...`): the two
frameworks never share a process or a GPU allocator, and the interpreter may be another
one than the bench's. This module imports nothing of tfmp, TensorFlow or torch at its top,
so that any Python with torch (and torchvision for ResNet-50) can run it. The subprocess prints its
progress to stderr as it goes and one JSON object to stdout at the end.

Like the bench's Keras rows: Adam or SGD with momentum 0.9 (1e-3), one random batch kept on the device (made there
once, outside the timed steps), NHWC (`channels_last`), float32 meaning TF32 matmuls and
convolutions on GPUs that have them (TensorFlow's default there), cuDNN's autotuner on.
torchvision's ResNet-50 is v1.5 (stride 2 in the 3x3 convolutions, about 4.1 GFLOPs a
forward pass), Keras' is v1 (stride 2 in the 1x1, about 3.9). The encoder: `torch.nn`'s
post-norm TransformerEncoder (12 x 768, 12 heads, GELU feed-forward 3072, sequence 128,
vocabulary 30,522), learned positions, mean pooling, as `realsize.bert_base`.
"""

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time

# The policies PyTorch has a counterpart for: autocast's dtype (None: no autocast).
AUTOCAST = {"float32": None, "mixed_float16": "float16", "mixed_bfloat16": "bfloat16"}
MODEL = "resnet50"  # The main bench's column.
NEEDS = {"resnet50": ("torch", "torchvision"), "bert_base": ("torch",)}
OPTIMIZERS = ("adam", "sgd")  # sgd: with momentum 0.9.


def find_python(choice, model=MODEL):
    """The interpreter for the column, or None: `choice` is "off", "auto" (this Python, where
    what `model` needs, torch and for resnet50 torchvision, is importable) or the path of a
    Python that has it."""
    if choice == "off":
        return None
    if choice == "auto":
        found = all(importlib.util.find_spec(name) for name in NEEDS[model])
        return sys.executable if found else None
    return choice


def rates(
    python,
    policies,
    batch_size,
    rounds,
    round_seconds,
    max_steps,
    timeout=1800,
    model=MODEL,
    optimizer="adam",
    smoke=False,
    say=None,
):
    """Runs the column in `python`: ({policy: {"examples_per_second", "rounds", ...}}, facts)
    for the policies PyTorch has, or (None, why) where it could not run. Progress lines go
    straight to this process's stderr, or to `say(line)` as they come."""
    policies = [p for p in policies if p in AUTOCAST]
    if not policies:
        return None, "no policy with a PyTorch counterpart"
    command = [
        python,
        os.path.abspath(__file__),
        f"--model={model}",
        f"--optimizer={optimizer}",
        f"--policies={','.join(policies)}",
        f"--batch_size={batch_size}",
        f"--rounds={rounds}",
        f"--round_seconds={round_seconds}",
        f"--max_steps={max_steps}",
        *(["--smoke"] if smoke else []),
    ]
    try:
        if say is None:
            done = subprocess.run(command, stdout=subprocess.PIPE, text=True, timeout=timeout)
            returncode, stdout, last = done.returncode, done.stdout, "its error is above"
        else:
            returncode, stdout, last = _run_saying(command, timeout, say)
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"{type(e).__name__}: {e}"
    if returncode != 0:
        return None, f"{python} exited with {returncode} ({last})"
    try:
        result = json.loads(stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return None, f"{python} printed no result: {stdout[-300:]!r}"
    return result.pop("rows"), result


def _run_saying(command, timeout, say):
    """Runs `command`, handing each line of its stderr to `say` as it comes: (returncode,
    stdout, its last stderr line)."""
    deadline = time.monotonic() + timeout
    last = ""
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as child:
        for line in child.stderr:  # The result is one short line on stdout: its pipe never fills.
            last = line.strip() or last
            say(last)
            if time.monotonic() > deadline:
                child.kill()
                raise subprocess.TimeoutExpired(command, timeout)
        stdout = child.stdout.read()
        return child.wait(), stdout, last[-300:]


def _progress(model, line):
    print(f"bench: pytorch {model} {line}", file=sys.stderr, flush=True)


def _encoder(torch, vocab_size=30522, sequence_length=128, width=768, heads=12, layers=12, classes=2):
    """BERT-base's shape, built as `realsize.bert_base` is: post-norm blocks, mean pooling."""

    class Encoder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.tokens = torch.nn.Embedding(vocab_size, width)
            self.positions = torch.nn.Embedding(sequence_length, width)
            block = torch.nn.TransformerEncoderLayer(
                width, heads, 4 * width, dropout=0.1, activation="gelu", batch_first=True
            )
            self.blocks = torch.nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
            self.head = torch.nn.Linear(width, classes)

        def forward(self, ids):
            x = self.tokens(ids) + self.positions(torch.arange(ids.shape[1], device=ids.device))
            return self.head(self.blocks(x).mean(dim=1))

    return Encoder()


def _model_and_batch(torch, name, batch_size, device, smoke=False):
    """(model, x, y) on `device`: one random batch kept there. `smoke`: 32x32 images, a
    one-layer encoder of width 32 on sequences of 16 (the tfmp side's smoke sizes)."""
    if name == "resnet50":
        import torchvision

        size = 32 if smoke else 224
        model = torchvision.models.resnet50(num_classes=1000).to(device, memory_format=torch.channels_last)
        x = torch.rand(batch_size, 3, size, size, device=device).to(memory_format=torch.channels_last)
        return model, x, torch.randint(0, 1000, (batch_size,), device=device)
    sizes = {"sequence_length": 16, "width": 32, "heads": 2, "layers": 1} if smoke else {}
    model = _encoder(torch, **sizes).to(device)
    x = torch.randint(0, 30522, (batch_size, sizes.get("sequence_length", 128)), device=device)
    return model, x, torch.randint(0, 2, (batch_size,), device=device)


def _train(name, optimizer_name, policy, batch_size, rounds, round_seconds, max_steps, smoke=False):
    """One policy: warm-up, then `rounds` rounds of timed steps; its row."""
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()  # The previous policy's model is gone.
    torch.manual_seed(0)
    model, x, y = _model_and_batch(torch, name, batch_size, device, smoke)
    if optimizer_name == "sgd":
        optimizer = torch.optim.SGD(model.parameters(), 1e-3, momentum=0.9)
    else:
        optimizer = torch.optim.Adam(model.parameters(), 1e-3)
    dtype = AUTOCAST[policy] and getattr(torch, AUTOCAST[policy])
    scaler = torch.amp.GradScaler(device, enabled=dtype is torch.float16)

    def step():
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device, dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        return loss.detach()

    def timed(steps):
        start = time.perf_counter()
        for _ in range(steps):
            loss = step()
        loss.item()  # Waits for the device.
        return time.perf_counter() - start, loss

    _progress(name, f"{policy}: warming up (3 steps; cuDNN tunes its kernels on a GPU)")
    start = time.perf_counter()
    timed(2)
    per_step, _ = timed(1)
    steps = max(1, min(max_steps, round(round_seconds / per_step)))
    _progress(name, f"{policy}: warm in {time.perf_counter() - start:.1f} s, {1e3 * per_step:.1f} ms a step")
    round_rates, loss = [], None
    for index in range(rounds):
        seconds, loss = timed(steps)
        round_rates.append(steps * batch_size / seconds)
        _progress(name, f"{policy}: round {index + 1}/{rounds} done, {round_rates[-1]:,.1f} examples/s")
    memory = torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" else None
    return {
        "examples_per_second": statistics.median(round_rates),
        "rounds": round_rates,
        "steps_per_round": steps,
        "final_loss": float(loss),
        "peak_memory_mb": memory,
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=MODEL, choices=sorted(NEEDS))
    parser.add_argument("--optimizer", default="adam", choices=OPTIMIZERS)
    parser.add_argument("--policies", default="float32,mixed_float16,mixed_bfloat16")
    parser.add_argument("--batch_size", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--round_seconds", type=float, default=4.0, help="About how long one round of a policy takes.")
    parser.add_argument("--max_steps", type=int, default=100)
    parser.add_argument("--smoke", action="store_true", help="Tiny sizes: the code path on a CPU in seconds.")
    args = parser.parse_args(argv)
    policies = args.policies.split(",")
    unknown = [p for p in policies if p not in AUTOCAST]
    if unknown:
        parser.error(f"no PyTorch counterpart for {unknown[0]!r}; choose from {', '.join(AUTOCAST)}")

    import torch

    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = True  # TensorFlow's float32 on such GPUs: TF32.
        torch.backends.cudnn.allow_tf32 = True
        torch.backends.cudnn.benchmark = True
        device = torch.cuda.get_device_name()
    else:
        device = "CPU"
    rows = {
        p: _train(
            args.model, args.optimizer, p, args.batch_size, args.rounds, args.round_seconds, args.max_steps, args.smoke
        )
        for p in policies
    }
    facts = {"torch": torch.__version__, "device": device}
    if args.model == "resnet50":
        import torchvision

        facts["torchvision"] = torchvision.__version__
    facts["python"] = sys.executable
    print(json.dumps({"rows": rows, **facts}), flush=True)


if __name__ == "__main__":
    main()
