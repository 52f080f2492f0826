"""The numerics doctor for the bundled models: which layers overflow float16, where
gradients underflow, which loss scale to start from; or accuracy parity over seeds.

python -m tfmp.doctor --model=transformer --policy=mixed_float16   # per-layer float16 report
python -m tfmp.doctor --parity --model=lstm --seeds=3               # float32 vs mixed accuracy
"""

# An entry point, at the top of the import graph (nothing imports it), so it may start the
# training application's doctor command; the package above it imports no TensorFlow.
import sys

from absl import flags

from tfmp import cli
from tfmp.app import doctor_flags  # Loads no TensorFlow.

doctor_flags.define()
flags.adopt_module_key_flags(doctor_flags)  # --helpshort lists them: this module is the program.
ARGV = cli.read_flags(sys.argv, "tfmp.doctor")  # A wrong flag or --help is answered here, before TensorFlow loads.
cli.quiet_start(sys.argv, "tfmp.doctor")  # TensorFlow loads here, its C++ start-up lines off stderr.

from tfmp.app import doctor_cli  # noqa: E402

cli.run_read(doctor_cli.main, ARGV)
