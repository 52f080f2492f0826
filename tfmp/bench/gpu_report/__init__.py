"""`python -m tfmp.bench.gpu_report`, one command for tfmp's GPU claims (its usage: `__main__`).

Its flags and parts are `tfmp.bench.gpu_flags` (no TensorFlow: a wrong flag or --help is
answered before TensorFlow and CUDA start); what each part runs, `tfmp.bench.gpu_parts`;
the report it writes, `tfmp.bench.gpu_tables`.
"""
