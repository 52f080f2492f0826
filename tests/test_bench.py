"""python -m tfmp.bench end to end, tiny: figures for every row, tfmp against Keras fit,
the peaks, autotune's picks, the sparse-gradient timing and the files. Nothing here
depends on how fast this CPU is."""

import json
import os
import subprocess
import sys

import pytest
from conftest import REPO, entry_point_process

from tfmp import gradients, precision
from tfmp.bench import bench_flags, micro, pool, pytorch, realsize, runs, tables


@pytest.mark.slow  # The whole bench in a process of its own, every part tiny: 2-3 minutes on 2 cores.
def test_bench_writes_figures(tmp_path):
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "tfmp.bench",
            "--models=cnn",
            "--policies=float32,mixed_bfloat16,bfloat16",
            "--batch_size=32",
            "--rounds=2",
            "--round_seconds=2",
            "--max_steps=3",
            "--matmul_size=256",
            "--autotune_runs=1",
            "--trial_seconds=2",
            "--sparse_vocab=500",  # One replica: the check says it is skipped (in-process below).
            "--overhead_rounds=1",
            "--overhead_layers=2",
            "--update_models=",
            f"--output_dir={tmp_path}",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    bench = json.loads((tmp_path / "bench.json").read_text())
    rows = {r["policy"]: r for r in bench["rows"]}
    for policy in ("float32", "mixed_bfloat16"):
        row = rows[policy]
        assert len(row["rounds"]) == len(row["keras_fit_rounds"]) == 2 and min(row["rounds"]) > 0
        assert row["keras_fit_examples_per_second"] > 0 and row["tfmp_vs_keras_fit"] > 0
        assert row["mfu"] > 0 and row["train_flops_per_example"] > 1e6
        assert row["input_examples_per_second"] > 0 and row["peak_memory_mb"] > 0
        assert set(row["possible_speedup"]) == {"matmul", "conv"} and "share_of_possible_gain" in row
        assert isinstance(row["jit_compile"]["tfmp"], bool) and isinstance(row["jit_compile"]["keras"], bool)
    assert rows["float32"]["speedup_vs_float32"] == 1.0
    assert rows["bfloat16"]["state_mb"] < 0.7 * rows["mixed_bfloat16"]["state_mb"]  # Kahan's 8 bytes against 12.
    assert rows["bfloat16"]["examples_per_second"] > 0
    for op in ("matmul", "conv"):
        assert set(bench["peaks"][op]) == set(rows) and min(p["flops"] for p in bench["peaks"][op].values()) > 0
    (choice,) = bench["choices"]
    assert choice["picks"][0]["policy"] in rows and 0 < choice["picks"][0]["vs_fastest"] <= 1
    assert bench["sparse"] == []
    costs = bench["overhead"]
    assert costs["rounds"] == 1 and costs["variables"] == 4 and len(costs["cells"]) == 12 and costs["geomean"] > 0
    assert {(c["policy"], c["xla"], c["optimizer"]) for c in costs["cells"]} == {
        (p, x, o)
        for p in ("float32", "mixed_bfloat16", "mixed_float16")
        for x in (False, True)
        for o in ("SGD", "Adam")
    }
    assert all(c["tfmp_ms"] > 0 and c["keras_ms"] > 0 and len(c["speedup_rounds"]) == 1 for c in costs["cells"])
    assert costs["device"] == precision.device_name() and costs["versions"].startswith("TensorFlow ")
    assert "| mixed_float16 | on | Adam |" in (tmp_path / "bench.md").read_text()
    assert f"{costs['device']}, {costs['versions']}:" in (tmp_path / "bench.md").read_text()
    assert (tmp_path / "bench.png").stat().st_size > 5000
    assert "| cnn | float32 |" in (tmp_path / "bench.md").read_text()
    assert "tfmp/Keras" in result.stdout and "autotune picked" in result.stdout
    assert "sparse check skipped" in result.stdout
    assert "training loop's cost: tfmp.fit / Keras fit speed, geometric mean" in result.stdout
    assert "loop cost, mixed_float16, XLA on, Adam: tfmp.fit " in result.stdout  # A line per cell as it ends.
    # Progress: a line as each fit warms up and after each round, with the time left.
    for policy in ("float32", "mixed_bfloat16"):
        for loop_name in ("tfmp.fit", "Keras fit"):
            assert f"bench: cnn {policy} {loop_name}: warm in " in result.stdout
    assert "bench: cnn: round 1/2 done" in result.stdout and "bench: cnn: round 2/2 done" in result.stdout
    assert "ETA 0 s" in result.stdout


def test_every_policy_gets_every_round_even_past_its_share_of_time():
    peaks = {op: {"float32": {"flops": 1e9, "cut_off": False}} for op in ("matmul", "conv")}
    # No time at all for the round: every turn still trains one timed step.
    (row,) = runs.bench_model("cnn", ["float32"], 16, rounds=2, round_seconds=0.0, max_steps=3, peaks=peaks)
    assert len(row["rounds"]) == len(row["keras_fit_rounds"]) == 2
    assert row["steps_timed"] == 2 and min(row["rounds"] + row["keras_fit_rounds"]) > 0
    assert "cnn" in tables.table([row]) and "PyTorch" not in tables.table([row])
    row["pytorch_examples_per_second"] = 12.5  # PyTorch's column, where a row has it.
    assert tables.table([row]).splitlines()[0].endswith("PyTorch AMP ex/s") and "12.5" in tables.table([row])
    assert tables.markdown({"rows": [row]}).splitlines()[2].endswith("| 12.5 |")


def test_sparse_steps_time_dense_against_sparse_on_two_replicas(mirrored):
    (sparse,) = micro.sparse_steps([500], mirrored, batch_size=16, sequence_length=8, rounds=2, steps_per_turn=2)
    assert sparse["vocab_size"] == 500 and sparse["replicas"] == 2
    assert sparse["dense_ms"] > 0 and sparse["sparse_ms"] > 0 and sparse["speedup"] > 0


def test_norm_costs_time_per_gradient_against_grouped_and_keras():
    (sgd, adam) = micro.norm_costs(rounds=2, layers=3, steps_per_turn=2, policies=["mixed_float16"], say=print)
    assert (sgd["optimizer"], adam["optimizer"]) == ("SGD", "Adam")
    for cell in (sgd, adam):
        assert cell["policy"] == "mixed_float16" and len(cell["rounds"]) == 2
        assert min(cell[f"{v} ms"] for v in ("keras", "per gradient", "grouped")) > 0
        assert cell["speed grouped / per gradient"] > 0
    assert gradients.GROUPED is None  # Back to the rule.


def test_evaluation_costs_time_tfmp_evaluate_against_model_evaluate(capsys):
    off, on = micro.evaluation_costs(rounds=2, layers=3, batches=4)
    assert (off["xla"], on["xla"]) == (False, True)
    for cell in (off, on):
        assert cell["tfmp_ms_per_batch"] > 0 and cell["keras_ms_per_batch"] > 0 and len(cell["speedup_rounds"]) == 2
    assert "evaluation cost, XLA on: tfmp.evaluate" in capsys.readouterr().out


def test_the_flags_name_the_real_size_models_there_are():
    """The bench's flags are defined before TensorFlow loads, from names kept apart from the models."""
    assert tuple(realsize.MODELS) == tuple(bench_flags.BATCH_SIZES) and realsize.BATCH_SIZES is bench_flags.BATCH_SIZES
    assert set(bench_flags.GPU_MODELS) <= set(realsize.MODELS)


def test_update_times_keras_against_fused():
    update = micro.update_times("resnet50", rounds=2, calls_per_turn=1)
    assert update["parameters"] > 2e7 and update["keras_ms"] > 0 and update["fused_ms"] > 0
    assert "| resnet50 | 25.6M |" in tables.markdown({"rows": [], "updates": [update]})


def test_autotune_picks_carry_the_rounds_own_error():
    pick = {"policy": "float32", "vs_fastest": 1 / 1.12, "vs_fastest_error": 0.04, "seconds": 30.0}
    choices = [{"model": "lstm", "fastest": "mixed_bfloat16", "fastest_error": 0.04, "picks": [pick]}]
    text = tables.markdown({"rows": [], "choices": choices})
    assert "| lstm | mixed_bfloat16 | float32 (89.3% ±4.0, 30 s) |" in text
    assert tables.share_text({**pick, "vs_fastest_error": None}) == "89.3%"


def test_versus_keras_pools_the_rows_without_xla():
    def row(policy, ratio, error, xla=False):
        return {"model": "m", "policy": policy, "tfmp_vs_keras_fit": ratio, "tfmp_vs_keras_fit_error": error,
                "jit_compile": {"tfmp": xla, "keras": False}}  # fmt: skip

    rows = [row("a", 0.99, 0.01), row("b", 1.01, 0.01), row("c", 0.9, 0.01), row("d", 2.0, 0.01, xla=True)]
    summary = tables.versus_keras(rows)
    assert summary["rows"] == 3 and summary["slower"] == ["m c"]  # 0.99 +- 0.01 is within two errors.
    assert abs(summary["ratio"] - (0.99 * 1.01 * 0.9) ** (1 / 3)) < 1e-9
    assert abs(summary["error"] - 0.03**0.5 / 3 * 0.1) < 1e-9
    assert "rows slower beyond two standard errors: m c" in tables.versus_keras_text(summary)


def test_benchpool_pools_the_rounds_of_several_runs(tmp_path, capsys):

    def run(ours, theirs, device="cpu"):
        row = {"model": "m", "policy": "float32", "rounds": ours, "keras_fit_rounds": theirs,
               "tfmp_vs_keras_fit": 1.0, "jit_compile": {"tfmp": False, "keras": False}}  # fmt: skip
        return {"device": device, "rows": [row]}

    (pooled,) = pool.pool([run([99, 102, 101], [100] * 3), run([104, 98, 103], [100] * 3)])
    assert pooled["rounds"] == 6 and abs(pooled["tfmp_vs_keras_fit"] - 1.015) < 1e-3  # Median of 6 ratios.
    paths = []
    for i, result in enumerate([run([99], [100]), run([101], [100]), run([100], [100], device="gpu")]):
        paths.append(str(tmp_path / f"{i}.json"))
        with open(paths[-1], "w") as f:
            json.dump(result, f)
    assert pool.main(paths[:2]) == 0 and "| m | float32 | 1.00 | 1.00 | 1.000" in capsys.readouterr().out
    assert pool.main(paths) == 2 and "different devices" in capsys.readouterr().err


def _torch_python():
    """A Python with torch and torchvision: this one, else $TFMP_TORCH_PYTHON, else None."""
    return pytorch.find_python("auto") or os.environ.get("TFMP_TORCH_PYTHON")


@pytest.mark.skipif(not _torch_python(), reason="no PyTorch: set TFMP_TORCH_PYTHON to a Python with torchvision")
def test_pytorch_column_trains_torchvision_resnet50_in_its_own_interpreter(capfd):
    rows, facts = pytorch.rates(
        _torch_python(), ["float32", "mixed_bfloat16", "float8"], 2, rounds=2, round_seconds=0.0, max_steps=1
    )
    assert set(rows) == {"float32", "mixed_bfloat16"}  # float8 has no PyTorch counterpart here.
    for row in rows.values():
        assert len(row["rounds"]) == 2 and min(row["rounds"]) > 0 and row["steps_per_round"] == 1
        assert row["examples_per_second"] > 0 and row["final_loss"] >= 0
    assert facts["torch"] and facts["torchvision"] and facts["device"]
    progress = capfd.readouterr().err
    assert "bench: pytorch resnet50 mixed_bfloat16: round 2/2 done" in progress
    assert "PyTorch AMP: torch " in tables.pytorch_text(facts)


def test_pytorch_column_is_left_out_with_its_reason(tmp_path):
    assert pytorch.find_python("off") is None and pytorch.find_python("/opt/py") == "/opt/py"
    failing, silent = tmp_path / "failing", tmp_path / "silent"
    failing.write_text("#!/bin/sh\nexit 3\n")
    silent.write_text("#!/bin/sh\necho warming up\n")
    for script in (failing, silent):
        script.chmod(0o755)
    rows, why = pytorch.rates(str(failing), ["float32"], 2, 1, 0.0, 1)
    assert rows is None and why == f"{failing} exited with 3 (its error is above)"
    rows, why = pytorch.rates(str(silent), ["float32"], 2, 1, 0.0, 1)
    assert rows is None and why.startswith(f"{silent} printed no result")
    rows, why = pytorch.rates(str(tmp_path / "absent"), ["float32"], 2, 1, 0.0, 1)
    assert rows is None and why.startswith("FileNotFoundError")
    assert pytorch.rates(sys.executable, ["float8"], 2, 1, 0.0, 1) == (None, "no policy with a PyTorch counterpart")
    assert tables.pytorch_text({"left_out": why}) == f"PyTorch column left out: {why}"

    # A Python named on the command line that is not there is an error at once, not a column left out. Each
    # refusal comes before TensorFlow loads (the flags and their checks are in tfmp.bench.bench_flags).
    def bench(*flags):
        result = entry_point_process("runpy.run_module('tfmp.bench', run_name='__main__', alter_sys=True)", *flags)
        assert result.returncode == 2 and result.stdout == "tensorflow loaded: False\n", result
        return result.stderr

    assert "not an executable Python" in bench(f"--pytorch={tmp_path / 'absent'}", "--models=resnet50")
    assert "unknown model 'resnet5'; choose from cnn, resnet" in bench("--models=resnet5")
    assert bench("--rounds=0") == "bench: error: flag --rounds=0: 0 is not a positive integer\n"


def test_end_waits_time_each_fit_from_its_end_to_its_return(capsys):
    waits = micro.end_waits(rounds=2, batches=16)
    assert sorted(waits) == ["keras", "tfmp"]
    assert all(len(seconds) == 2 and min(seconds) >= 0 for seconds in waits.values())
    assert "tfmp: median" in capsys.readouterr().out
