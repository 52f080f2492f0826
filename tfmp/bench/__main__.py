"""Benchmark precision policies per model, in one process: tfmp.fit against plain Keras
`model.fit`, every policy in alternating rounds, with this machine's matmul and conv peaks.

    python -m tfmp.bench                      # bundled models, shipped data (GPU: resnet50, bert_base)
    python -m tfmp.bench --models=resnet50,bert_base --policies=float32,mixed_bfloat16 \\
        --batch_size=16 --rounds=3 --autotune_runs=0 --sparse_vocab=

Prints the table and comparisons; writes bench.json, bench.md (the same as README tables) and
bench.png into --output_dir.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import flags  # noqa: E402

from tfmp import cli  # noqa: E402
from tfmp.bench import bench_flags  # noqa: E402 - loads no TensorFlow.

bench_flags.define()
flags.adopt_module_key_flags(bench_flags)  # --helpshort lists them: this module is the program.
ARGV = cli.read_flags(sys.argv, "bench")  # A wrong flag or --help is answered here, before TensorFlow loads.
bench_flags.check()

from tfmp.bench import bench_cli  # noqa: E402 - TensorFlow loads here.

cli.run_read(bench_cli.main, ARGV)
