"""tfmp.worker_files: on a worker other than the chief, Keras' file-writing callbacks write
under a temporary directory while tfmp.fit runs, and get their paths back after it."""

import os

import keras

from tfmp import worker_files


def writers(directory):
    return [
        keras.callbacks.ModelCheckpoint(os.path.join(directory, "m-{epoch}.keras")),
        keras.callbacks.CSVLogger(os.path.join(directory, "log.csv")),
        keras.callbacks.TensorBoard(os.path.join(directory, "tb")),
        keras.callbacks.BackupAndRestore(os.path.join(directory, "backup")),
        keras.callbacks.EarlyStopping(),
    ]


def paths(callbacks):
    checkpoint, csv_logger, tensorboard, backup, _ = callbacks
    return [checkpoint.filepath, csv_logger.filename, tensorboard.log_dir, backup.backup_dir, backup._weights_path]  # noqa: SLF001


def test_other_workers_write_under_a_temporary_directory_and_resume_from_the_chiefs_backup(tmp_path):
    (tmp_path / "backup").mkdir()
    (tmp_path / "backup" / "training_metadata.json").write_text('{"epoch": 2}')
    callbacks = writers(str(tmp_path))
    before = paths(callbacks)
    with worker_files.apart(callbacks, chief=False):
        during = paths(callbacks)
        temporary = os.path.commonpath(during)
        assert not temporary.startswith(str(tmp_path)) and os.path.isdir(temporary)
        assert [os.path.basename(p) for p in during] == [os.path.basename(p) for p in before]
        assert "{epoch}" in during[0]  # Its name still formatted per epoch.
        # The chief's backup, copied: this worker resumes from the same epoch.
        assert open(os.path.join(during[3], "training_metadata.json")).read() == '{"epoch": 2}'
    assert paths(callbacks) == before and not os.path.exists(temporary)


def test_the_chief_writes_where_it_was_told():
    callbacks = writers("out")
    with worker_files.apart(callbacks, chief=True):
        assert paths(callbacks) == paths(writers("out"))
    with worker_files.apart(None, chief=False):
        pass
