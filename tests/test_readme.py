"""README's "Your own model" example runs as written and resumes from its checkpoints; the documents' links hold."""

import dataclasses
import os
import re
import shlex
import subprocess
import sys

from conftest import REPO


def _example(heading="## Your own model"):
    text = open(os.path.join(REPO, "README.md")).read()
    section = text.split(heading, 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_your_own_model_example_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    namespace = {}
    exec(compile(_example(), "README.md", "exec"), namespace)  # noqa: S102 - the README's own code.
    history, model = namespace["history"], namespace["model"]
    # It learns, whatever policy auto picked on this CPU: both validation losses fall every
    # epoch, the total by 15% over the three (8 updates an epoch; bfloat16 and float32 runs
    # differ in the fourth digit), not an accuracy a little above chance (0.25).
    val_loss, val_kind_loss = history.history["val_loss"], history.history["val_kind_loss"]
    assert len(val_loss) == 3 and val_loss[0] > val_loss[1] > val_loss[2] and val_loss[2] < 0.9 * val_loss[0]
    assert val_kind_loss[0] > val_kind_loss[1] > val_kind_loss[2]
    assert int(model.optimizer.iterations.numpy()) == 3 * 8  # 16 batches an epoch, 2 per update.
    assert list((tmp_path / "runs" / "mine").glob("ckpt-*.index"))
    assert (tmp_path / "runs" / "mine" / "history.csv").exists()
    assert "'val_loss':" in capsys.readouterr().out
    rerun = {}
    exec(compile(_example(), "README.md", "exec"), rerun)  # Resumes after the last epoch: nothing left to do.
    assert rerun["history"].history == {} and int(rerun["model"].optimizer.iterations.numpy()) == 24


def test_numerics_doctor_example_runs(tmp_path, monkeypatch, capsys):
    import numpy as np

    monkeypatch.chdir(tmp_path)
    namespace = {}
    exec(compile(_example("## Numerics doctor"), "README.md", "exec"), namespace)  # noqa: S102
    assert namespace["diagnosis"].keep_float32 == ["blowup"]
    assert np.isfinite(namespace["history"].history["loss"]).all()
    assert (tmp_path / "doctor" / "gradients.png").exists()
    table = capsys.readouterr().out
    readme = open(os.path.join(REPO, "README.md")).read()
    for line in table.splitlines():  # The README shows this example's real output.
        if line.startswith(("keep in float32", "recommended")):
            assert line in readme, line


def _shell_commands():
    """Every command line of README's sh blocks, comments dropped, as argv lists."""
    text = open(os.path.join(REPO, "README.md")).read()
    for block in re.findall(r"```sh\n(.*?)```", text, re.S):
        for line in block.splitlines():
            for command in line.split(" # ")[0].split("&&"):
                if command.strip():
                    yield shlex.split(command)


def test_every_readme_command_parses_and_validates(tmp_path, monkeypatch):
    """Each train.py and tfmp.launch line of README takes the flags and values it shows (a
    renamed flag or a stale value fails here); the main command, the examples above and the
    launcher run end to end in test_train.py, test_launch.py and this file."""
    from absl import flags

    import train  # noqa: F401 - defines train.py's flags (once per process).
    from tfmp import cli, launch
    from tfmp.app import training

    monkeypatch.chdir(tmp_path)
    for name in ("train.py", "my_script.py"):
        (tmp_path / name).write_text("")

    def check_train(args):
        flags.FLAGS.unparse_flags()
        cli.flags_parser("train.py")(["train.py", *args])
        fields = {f.name for f in dataclasses.fields(training.Config)}
        values = {name: flags.FLAGS[name].value for name in flags.FLAGS if name in fields}
        training.validate(training.Config(**{**values, "model_dir": str(tmp_path / "run"), "export_dir": None}))

    seen = {"train.py": 0, "launch": 0, "pip": 0, "pytest": 0}
    for argv in _shell_commands():
        assert argv[0] == "python3", argv
        if argv[1:] == ["train.py", "--help"]:
            shown = subprocess.run(
                [sys.executable, os.path.join(REPO, "train.py"), "--help"], capture_output=True, text=True, timeout=300
            )
            assert "--jit_compile" in shown.stdout and not shown.stderr, shown.stderr[-2000:]  # absl: exit 1.
            seen["train.py"] += 1
        elif argv[1] == "train.py":
            check_train(argv[2:])
            seen["train.py"] += 1
        elif argv[1:3] == ["-m", "tfmp.launch"]:
            options = launch.parse(argv[3:])
            if options.script == "train.py":
                check_train(options.args)
            seen["launch"] += 1
        else:
            assert argv[1:4] in (["-m", "pip", "install"], ["-m", "pytest", "-q"]), argv
            seen["pip" if argv[2] == "pip" else "pytest"] += 1
    flags.FLAGS.unparse_flags()
    assert seen["train.py"] >= 10 and seen["launch"] == 3 and seen["pip"] == 2 and seen["pytest"] == 1


def test_ci_runs_readmes_test_command_and_the_slow_tests():
    """.ci/run runs README's test command as README shows it (python3 there, the venv's python here), then
    the tests that command leaves out."""
    (readme,) = [argv for argv in _shell_commands() if argv[1:3] == ["-m", "pytest"]]
    lines = [shlex.split(line.split(" # ")[0]) for line in open(os.path.join(REPO, ".ci", "run")) if "pytest" in line]
    ran = [argv[1:] for argv in lines if argv and argv[0] == "python"]
    assert readme[1:] in ran, (readme, ran)
    assert readme[readme.index("-m", 2) + 1] == "not slow" and [*readme[1:-2], "slow", "tests"] in ran, ran


def _headings(text):
    """A Markdown text's headings outside code blocks, as (their #s, their title)."""
    return re.findall(r"^(#+) (.+)$", re.sub(r"```.*?```", "", text, flags=re.S), re.M)


def _anchor(title):
    """GitHub's anchor of a heading: lower case, punctuation but - and _ gone, each space a -."""
    return re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")


def test_every_link_between_the_documents_finds_its_file_and_heading():
    """A link in a top-level document to a file of the repo names one that exists, and a `#part` of a
    Markdown file one of its headings (DECISIONS.md's contents, README's links into GUIDE.md)."""
    anchors = {}  # Each linked Markdown file's, read once.
    broken, checked = [], 0
    for doc in sorted(f for f in os.listdir(REPO) if f.endswith(".md")):
        for target in re.findall(r"\]\(([^)\s]+)\)", open(os.path.join(REPO, doc)).read()):
            if re.match(r"[a-z]+://", target):
                continue
            path, _, anchor = target.partition("#")
            path = path or doc
            checked += 1
            if not os.path.exists(os.path.join(REPO, path)):
                broken.append(f"{doc}: {target} (no such file)")
            elif anchor and path.endswith(".md"):
                if path not in anchors:
                    anchors[path] = {_anchor(title) for _, title in _headings(open(os.path.join(REPO, path)).read())}
                if anchor not in anchors[path]:
                    broken.append(f"{doc}: {target} (no such heading)")
    assert checked >= 40 and not broken, broken


def test_the_long_documents_contents_list_every_section():
    """DECISIONS.md's and BENCHMARKS.md's contents at the top name each of their sections (a section added
    without its line would be missed by a reader who starts there)."""
    for doc, levels in (("DECISIONS.md", ("##",)), ("BENCHMARKS.md", ("##", "###"))):
        text = open(os.path.join(REPO, doc)).read()
        contents = text.split("\n## ", 1)[0]
        sections = [title for marks, title in _headings(text) if marks in levels]
        missing = [title for title in sections if f"](#{_anchor(title)})" not in contents]
        assert len(sections) >= 15 and not missing, (doc, missing)
