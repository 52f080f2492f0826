"""`python -m tfmp.doctor`: an entry point, at the top of the import graph (nothing imports
it), so it may start the training application's doctor command for the bundled models."""

import sys

from tfmp import cli

cli.quiet_start(sys.argv, "tfmp.doctor")  # Before TensorFlow loads.

from tfmp.app import doctor_cli  # noqa: E402

doctor_cli.run()
