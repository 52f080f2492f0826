"""The TensorFlow internals tfmp relies on (tfmp/tf_compat.py), a test per behaviour: a
TensorFlow release that changes one of them fails here, by name."""

import keras
import numpy as np
import tensorflow as tf

from tfmp import tf_compat


def test_replica_local_updates_count_on_each_replicas_copy_and_put_the_aggregation_back(mirrored):
    with mirrored.scope():
        optimizer = keras.optimizers.SGD(0.1)
        weight = keras.Variable(np.ones(2, np.float32), aggregation="mean")
    only_first = tf.VariableAggregation.ONLY_FIRST_REPLICA
    assert optimizer.iterations.value.aggregation == only_first

    def replica_count():
        with tf_compat.replica_local_updates([*optimizer.variables, weight]):
            assert optimizer.iterations.value.aggregation == tf.VariableAggregation.NONE
            assert weight.value.aggregation == tf.VariableAggregation.MEAN  # Only first-replica ones.
            optimizer.iterations.assign_add(1)

    mirrored.run(tf.function(replica_count))
    assert optimizer.iterations.value.aggregation == only_first
    assert [int(c) for c in mirrored.experimental_local_results(optimizer.iterations.value)] == [1, 1]


def test_a_host_variable_made_in_a_strategys_scope_is_plain_and_a_dataset_updates_it(mirrored):
    with mirrored.scope():
        reads = tf_compat.host_variable(tf.constant(0, tf.int64))
    assert type(reads).__name__ == "ResourceVariable" and "CPU:0" in reads.device
    count = tf.data.Dataset.range(5).map(lambda i: reads.assign_add(1))
    assert list(count.as_numpy_iterator()) == [1, 2, 3, 4, 5] and reads.numpy() == 5


def test_op_determinism_reads_tensorflows_switch():
    assert tf_compat.op_determinism() is False
    tf.config.experimental.enable_op_determinism()  # conftest turns it off again after the test.
    assert tf_compat.op_determinism() is True


def test_num_workers(mirrored):
    """One process: 1 worker (two worker processes read 2: tests/test_loop.py's cluster run,
    whose metrics.json says workers == 2)."""
    assert tf_compat.num_workers(mirrored) == 1 and tf_compat.num_workers(tf.distribute.get_strategy()) == 1


def test_float_ops_counts_a_matmul():
    graph = (
        tf.function(lambda a, b: tf.matmul(a, b))
        .get_concrete_function(tf.TensorSpec((4, 8), tf.float32), tf.TensorSpec((8, 3), tf.float32))
        .graph
    )
    assert tf_compat.float_ops(graph) == 2 * 4 * 8 * 3


def test_no_merge_call_inside_replica_local_updates_and_back_after(mirrored):
    extended = mirrored.extended
    with tf_compat.replica_local_updates([], mirrored):
        assert extended._use_merge_call() is False
    assert "_use_merge_call" not in vars(extended) and extended._use_merge_call() is True


def test_replica_local_updates_leave_a_strategy_of_another_kind_as_it_is():
    """The extended classes it knows by name are MirroredStrategy's and MultiWorkerMirroredStrategy's; a
    one-device strategy (TPUs' too) keeps its merge calls and its variables' aggregation."""
    from tensorflow.python.distribute import collective_all_reduce_strategy

    multi_worker = collective_all_reduce_strategy.CollectiveAllReduceExtended.__name__
    mirrored = type(tf.distribute.MirroredStrategy(["/cpu:0"]).extended).__name__
    assert {mirrored, multi_worker} == set(tf_compat._MIRRORED)
    one = tf.distribute.OneDeviceStrategy("/cpu:0")
    with one.scope():
        optimizer = keras.optimizers.SGD(0.1)
        optimizer.build([keras.Variable(np.ones(2, np.float32))])
    aggregation = optimizer.iterations.value.aggregation
    with tf_compat.replica_local_updates(optimizer.variables, one):
        assert "_use_merge_call" not in vars(one.extended)
        assert optimizer.iterations.value.aggregation == aggregation


def test_each_strategy_gets_keys_of_its_own_once():
    first, second = (tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]) for _ in range(2))
    tf_compat.own_collective_keys(first)
    keys = tf_compat.collective_group_keys(first)
    tf_compat.own_collective_keys(first)  # Seen again: unchanged.
    assert tf_compat.collective_group_keys(first) == keys
    tf_compat.own_collective_keys(second)
    third = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])  # Made after: past both, though tfmp never sees it.
    assert len({tuple(tf_compat.collective_group_keys(s)) for s in (first, second, third)}) == 3
    tf_compat.own_collective_keys(tf.distribute.get_strategy())  # Not a MirroredStrategy: nothing to do.


def _retracing_warnings(make, caplog):
    """The retracing warnings TensorFlow logs while five functions made by `make` from one
    closure (as tfmp makes a step a model) are each traced once and called once more."""
    caplog.clear()
    with caplog.at_level("WARNING", logger="tensorflow"):
        for scale in range(5):

            def scaled(x, scale=float(scale)):
                return x * scale

            fn = make(scaled)
            fn(tf.constant(1.0))
            fn(tf.constant(2.0))
    return [r.getMessage() for r in caplog.records if "triggered tf.function retracing" in r.getMessage()]


def test_function_counts_its_traces_apart_from_those_of_functions_made_from_the_same_code(caplog):
    assert _retracing_warnings(tf.function, caplog)  # TensorFlow's count, which tfmp's steps would read as retracing.
    assert not _retracing_warnings(tf_compat.function, caplog)
    assert tf_compat.function(autograph=False)(lambda x: x + 1)(tf.constant(1)).numpy() == 2  # The decorator form.


def test_reorders_sees_a_shuffle_or_random_source_drawing_anew_for_each_iterator():
    """Two iterators of one shuffled dataset read different orders (tf.data's default); `reorders` finds the
    shuffle wherever it sits in the pipeline, and not where each iterator reads alike."""
    shuffled = tf.data.Dataset.range(8).shuffle(8, seed=1)
    assert list(shuffled.as_numpy_iterator()) != list(shuffled.as_numpy_iterator())
    ranges = [tf.data.Dataset.range(3)] * 2
    for dataset in (
        shuffled,
        tf.data.Dataset.zip(tf.data.Dataset.range(8), shuffled).batch(2).map(lambda a, b: a + b).prefetch(1),
        tf.data.Dataset.sample_from_datasets(ranges, seed=1, rerandomize_each_iteration=True),
    ):
        assert tf_compat.reorders(dataset), dataset
    fixed = tf.data.Dataset.range(8).shuffle(8, seed=1, reshuffle_each_iteration=False)
    assert list(fixed.as_numpy_iterator()) == list(fixed.as_numpy_iterator())
    for dataset in (
        fixed.batch(2),
        tf.data.Dataset.range(8).repeat(),
        tf.data.Dataset.sample_from_datasets(ranges, seed=1),
    ):
        assert not tf_compat.reorders(dataset), dataset


def test_xla_kernels_lists_xlas_kernels_for_a_device_with_their_dtype_constraints():
    tf.function(lambda: tf.constant(1.0) + 1.0, jit_compile=True)()  # XLA registers its kernels by now.
    kernels = tf_compat.xla_kernels("XLA_CPU_JIT")
    assert "MatMul" in kernels and "PrintV2" not in kernels and "PyFuncStateless" not in kernels
    allowed = {name: types for kernel in kernels["MatMul"] for name, types in kernel}
    assert tf.float32.as_datatype_enum in allowed["T"] and tf.string.as_datatype_enum not in allowed["T"]
    assert tf_compat.xla_kernels("NO_SUCH_DEVICE") == {}


def test_called_graph_is_the_traced_graph_of_a_function_a_graph_calls():
    inner = tf.function(lambda x: tf.identity(x, name="inside"), autograph=False)
    outer = tf.function(lambda x: inner(x), autograph=False).get_concrete_function(tf.constant(1.0))
    (call,) = [
        op
        for op in outer.graph.get_operations()
        if op.type == "StatefulPartitionedCall" or op.type == "PartitionedCall"
    ]
    found, graph = tf_compat.called_graph(outer.graph, call.get_attr("f").name)
    assert found and "inside" in [op.name for op in graph.get_operations()]
    assert tf_compat.called_graph(outer.graph, "no_such_function") == (False, None)


def test_registered_op_tells_an_op_from_a_functions_name():
    concrete = tf.function(lambda x: x + 1.0, autograph=False).get_concrete_function(tf.constant(1.0))
    assert tf_compat.registered_op("AddV2") and tf_compat.registered_op("PyFunc")
    assert not tf_compat.registered_op(concrete.name)
