"""tfmp's GPU claims in parts of at most 9 minutes each: ResNet-50 and BERT-base trained by
tfmp.fit and Keras fit under each precision, float8's GEMMs and speed, PyTorch AMP beside them.

    python -m tfmp.bench.gpu_report --part=1 --output_dir=gpu_report   # then --part=2 ... 8
    python -m tfmp.bench.gpu_report --part=4 --precisions=mixed_bfloat16   # one row of a part
    python -m tfmp.bench.gpu_report --part=all --smoke                  # the same code path on a CPU, tiny
"""

import sys

from absl import flags

from tfmp import cli
from tfmp.bench import gpu_flags  # Loads no TensorFlow.

gpu_flags.define()
flags.adopt_module_key_flags(gpu_flags)  # --helpshort lists them: this module is the program.
ARGV = cli.read_flags(sys.argv, "gpu_report")  # A wrong flag or --help is answered here, before TensorFlow loads.
gpu_flags.check()

from tfmp.bench import gpu_parts  # noqa: E402 - TensorFlow loads here.

cli.run_read(gpu_parts.main, ARGV)
