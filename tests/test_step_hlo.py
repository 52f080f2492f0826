"""step_hlo: the kernels of each loop's compiled step, counted in XLA's optimized HLO."""

from tfmp.bench import step_hlo

HLO = """HloModule a_inference__packed_update_1__.24, entry_computation_layout={(f32[8]{0})->f32[]}

%fused_computation (param_0: f32[8]) -> f32[] {
  %param_0 = f32[8]{0} parameter(0)
  ROOT %r = f32[] reduce(%param_0, %c), dimensions={0}, to_apply=%add
}

ENTRY %main (arg0.1: f32[8], arg1.1: (f32[8], f32[8])) -> (f32[], f32[8]) {
  %arg0.1 = f32[8]{0} parameter(0)
  %constant.1 = f32[] constant(0)
  %pair = (f32[8]{0}, f32[8]{0}) parameter(1)
  %first = f32[8]{0} get-tuple-element(%pair), index=0
  %multiply_reduce_fusion = f32[] fusion(%arg0.1), kind=kInput, calls=%fused_computation, metadata={op_type="L2Loss"}
  %gemm = (f32[8]{0}, s8[64]{0}) custom-call(%arg0.1, %first), custom_call_target="x", metadata={op_type="MatMul"}
  %copy.2 = f32[8]{0} copy(%first)
  %bitcast.1 = f32[8]{0} bitcast(%copy.2)
  ROOT %tuple = (f32[], f32[8]{0}) tuple(%multiply_reduce_fusion, %bitcast.1)
}
"""


def test_kernels_counts_the_entry_computations_launches_by_opcode_and_op_type():
    counted = step_hlo.kernels(HLO)
    assert counted == {
        "kernels": 3,  # Not the parameters, the constant, the tuple's parts, the bitcast, nor the fused reduce.
        "by_opcode": {"fusion": 1, "custom-call": 1, "copy": 1},
        "by_op_type": {"L2Loss": 1, "MatMul": 1, "-": 1},
    }


def test_a_smoke_run_finds_both_loops_steps_and_tfmps_norm(tmp_path):
    """On a CPU, a tiny convolutional stand-in: each loop's step module is found, and neither
    computes a gradient norm (L2Loss): tfmp.fit's step, like the benchmarks', has no log_dir to
    read it, and no loss scale or clip to need it (`Steps`' grad_norm)."""
    result = step_hlo.run(str(tmp_path), "resnet50", "float32", "sgd", 8, smoke=True, dump=str(tmp_path / "dump"))
    loops = result["loops"]
    assert set(loops) == {"keras", "tfmp"} and all(loops[k]["kernels"] > 10 for k in loops)
    assert "L2Loss" not in loops["tfmp"]["by_op_type"] and "L2Loss" not in loops["keras"]["by_op_type"]
    assert all(op != "L2Loss" for op, _, _ in step_hlo.differences(loops))
    written = (tmp_path / "step_hlo.md").read_text()
    assert "| tfmp |" in written and "| TensorFlow op type |" in written
