"""The numerics doctor: what breaks in float16 before it breaks, where a NaN came from, and
whether a mixed policy costs accuracy.

- `diagnose(model, data, steps)` trains the model in float32 for a few steps (and puts it
  back as it was) and records, per layer, the range of its inputs, outputs and weight
  gradients: which outputs exceed float16's maximum (65504: no loss scale helps those, keep
  them in float32) and which layers would cast such a value back to 16 bits, what
  fraction of the gradients underflow float16 at loss scale 1 and at a recommended scale,
  and how far each output moves when the model runs in bfloat16.
- `localize_non_finite(model, batch)` replays a batch in the model's own precision and
  names the first layer whose output, or whose gradient, is not finite.
- `parity(run, seeds)` compares test accuracy of float32 and a mixed policy over seeds.

`measure` runs the model; `diagnosis` holds what it found (table, JSON, histogram). The
command line (`python -m tfmp.doctor --help`, for the bundled models) is the training
application's: `tfmp/app/doctor_cli.py`.
"""

from tfmp import lazy as _lazy

# Loaded on first use, as tfmp's own names: `python -m tfmp.doctor` imports this package before its
# `__main__` can keep TensorFlow's start-up lines off stderr, so nothing here may import TensorFlow.
_EXPORTS = {
    "FLOAT16_MAX": "tfmp.doctor.diagnosis",
    "Diagnosis": "tfmp.doctor.diagnosis",
    "diagnose": "tfmp.doctor.measure",
    "localize_non_finite": "tfmp.doctor.measure",
    "nearest_drops": "tfmp.doctor.measure",
    "parity": "tfmp.doctor.measure",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = _lazy.names(globals(), _EXPORTS)
