"""tfmp.arguments: callbacks as model.fit and model.evaluate take them, and one clear error for what they cannot."""

import keras
import pytest
from conftest import regression, regression_arrays

import tfmp
from tfmp.errors import UsageError


def test_one_callback_or_nested_lists_are_taken_as_model_fit_takes_them(tmp_path):
    """model.fit flattens its callbacks; tfmp.fit failed at one given alone ("Value after * must be an iterable")."""
    x, y = regression_arrays(64)
    ends = []
    counted = keras.callbacks.LambdaCallback(on_epoch_end=lambda epoch, logs: ends.append(epoch))
    tfmp.fit(regression(), x, y, epochs=2, callbacks=counted, verbose=0)
    tfmp.fit(regression(), x, y, epochs=2, callbacks=[[counted], []], verbose=0)
    tested = keras.callbacks.LambdaCallback(on_test_end=lambda logs: ends.append("test"))
    tfmp.evaluate(regression(), x, y, callbacks=tested, verbose=0)
    assert ends == [0, 1, 0, 1, "test"]
    backup = keras.callbacks.BackupAndRestore(str(tmp_path / "backup"))
    with pytest.raises(UsageError, match="checkpoint_dir= and a keras.callbacks.BackupAndRestore would each restore"):
        tfmp.fit(regression(), x, y, callbacks=backup, checkpoint_dir=str(tmp_path / "run"), verbose=0)


@pytest.mark.parametrize("run", [tfmp.fit, tfmp.evaluate])
def test_a_callback_that_is_no_keras_callback_is_refused_in_words(run):
    """Keras fails at it with "'function' object has no attribute 'set_model'"."""
    x, y = regression_arrays(64)
    with pytest.raises(UsageError, match="^callbacks must be keras.callbacks.Callback objects, got builtins.function$"):
        run(regression(), x, y, callbacks=[lambda logs: None], verbose=0)
