"""The README's commands run as written, so that the README cannot rot.

Every command in a ```bash block, and every ```python block, is run here, in a scratch directory,
in order (the training command leaves the checkpoint that inspect and evaluate read).  A long
command is marked in LONG with the quick form this test runs instead -- the same command with
flags that shrink the work appended -- or, where it cannot run here, with the place that runs it."""
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = Path(ROOT, "README.md")
QUICK_MODEL = "--epochs 1 --limit 64 --limit-test 32 --conv-channels 16 --primary-types 4 --no-progress"

# command as written -> what runs instead: a str (the quick form) or None with the reason it is not run here
LONG = {
    "pip install -e . && python train_numpy.py": f"python train_numpy.py {QUICK_MODEL}",
    "python train_numpy.py": f"python train_numpy.py {QUICK_MODEL} --out quick-run",
    "pycapsnet train": f"pycapsnet train {QUICK_MODEL} --out quick-train",
    # every check, fewer entries per tensor (the default 20 is most of this test's time; tests/test_cli.py
    # runs it at 2 and checks its table and its failure)
    "pycapsnet gradcheck": "pycapsnet gradcheck --samples 1",
    'pip install torch==2.13.0 -e ".[test]" && python -m pytest': (None, ".ci/run runs exactly this line"),
    "python examples/build_your_own.py": "python examples/build_your_own.py --quick --out examples-run",
    # a network small enough for float64 finite differences, written where the README's command reads it
    "pycapsnet gradcheck --network net.json":
        "python -c \"import json; from pycapsnet.tools.gradcheck import composed_architectures as c; "
        "json.dump(c()['ConvCaps network routing=full'], open('net.json', 'w'))\" "
        "&& pycapsnet gradcheck --network net.json --samples 3",
    'pip install -e ".[cupy]"': (None, "CuPy installs on a CUDA machine only"),
    'pip install -e ".[tensorboard]"': (None, "the test command installs tensorboard (the [test] extra)"),
    # two images of the README's names, for the run the README's Python example trained
    "pycapsnet predict runs/mine photo.jpg more_images/ --top 3":
        "python -c \"import os, numpy as np; from PIL import Image; os.makedirs('more_images'); "
        "[Image.fromarray((255 * np.random.rand(28, 28)).astype('uint8')).save(p) "
        "for p in ('photo.jpg', 'more_images/a.png')]\" && pycapsnet predict runs/mine photo.jpg more_images/ --top 3",
    'pip install -e ".[torch]"': (None, "the test command installs torch (the [test] extra)"),
    "pycapsnet data mnist": (None, "downloads: tests/test_download.py runs it against a server on 127.0.0.1"),
    "bash benchmarks/gpu_check.sh": (None, "needs a CUDA GPU; benchmarks/gpu_check.sh is run on one"),
    "pycapsnet train --plugin my_routing --routing even":
        (None, "tests/test_routing_contract.py trains with a plugin module, tests/routing_plugin.py"),
    "pycapsnet check-routing vb": "pycapsnet check-routing vb --samples 2",
    "torchrun --standalone --nproc_per_node 2 train_numpy.py --out runs/parallel":
        f"torchrun --standalone --nproc_per_node 2 train_numpy.py --out runs/parallel {QUICK_MODEL}",
}


def readme_blocks():
    text = README.read_text(encoding="utf-8")
    return re.findall(r"```(bash|python)\n(.*?)```", text, flags=re.S)


def readme_commands():
    """(language, command) in README order: each line of a bash block, each python block whole.
    Inline commands of the prose (`bash ...`, `python ...`) count too."""
    out = []
    for lang, body in readme_blocks():
        if lang == "python":
            out.append(("python", body))
        else:
            out += [("bash", line.split("  #")[0].strip()) for line in body.splitlines() if line.strip()]
    text = README.read_text(encoding="utf-8")
    for cmd in re.findall(r"`((?:python|bash|pycapsnet|pip|torchrun) [^`]+)`", text):
        if ("bash", cmd) not in out:
            out.append(("bash", cmd))
    return out


def _shell_form(cmd):
    """The command with the repository's scripts named by their path (it runs in a scratch dir)."""
    for script in ("train_numpy.py", "train_torch.py", "train_cupy.py", "benchmarks/", "examples/"):
        cmd = re.sub(rf"(?<![\w/]){re.escape(script)}", os.path.join(ROOT, script), cmd)
    return cmd


def test_every_readme_command_is_run_or_marked(tmp_path):
    ran = []
    for lang, cmd in readme_commands():
        if lang == "python":
            r = subprocess.run([sys.executable, "-c", cmd], cwd=tmp_path, capture_output=True, text=True, timeout=300)
            assert r.returncode == 0, f"README's Python example failed:\n{r.stderr[-2000:]}"
            ran.append("python example")
            continue
        if cmd in LONG and isinstance(LONG[cmd], tuple):
            continue  # run elsewhere (LONG says where)
        quick = LONG.get(cmd, cmd)
        if quick.startswith("pip "):
            pytest.fail(f"README command {cmd!r} installs packages: mark it in LONG")
        r = subprocess.run(_shell_form(quick), shell=True, cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, f"README command {cmd!r} (run as {quick!r}) failed:\n{r.stderr[-2000:]}"
        ran.append(cmd)
    assert "python example" in ran and any(c.startswith("pycapsnet gradcheck") for c in ran), ran


def test_the_marks_name_readme_commands():
    commands = {c for _, c in readme_commands()}
    stale = [c for c in LONG if c not in commands]
    assert not stale, f"LONG names commands the README no longer has: {stale}"


def test_ci_runs_exactly_the_readme_test_command():
    ci = Path(ROOT, ".ci", "run").read_text(encoding="utf-8")
    test_command = 'pip install torch==2.13.0 -e ".[test]" && python -m pytest'
    assert ("bash", test_command) in readme_commands()
    assert test_command in ci.splitlines()[-1], "the last line of .ci/run must be the README's test command"


def test_readme_is_short():
    assert len(README.read_bytes()) <= 12_000  # bytes, as `wc -c` counts them (× and → take two or three)


def test_shell_form_names_scripts_by_path():
    assert _shell_form("python train_numpy.py --x") == f"python {os.path.join(ROOT, 'train_numpy.py')} --x"
    assert shlex.split(_shell_form("python benchmarks/bench.py"))[1] == os.path.join(ROOT, "benchmarks/bench.py")


def test_the_defaults_and_parameter_counts_the_docs_quote_are_the_codes():
    """What can be checked of docs' numbers: the trainer's defaults in README's table, and the
    parameter counts README, architecture.md and performance.md quote."""
    from pycapsnet.core.model import CapsNet
    from pycapsnet.training.recipe import EPOCHS, RECIPE, ROUTING_RECIPE

    import numpy as np

    import pycapsnet

    root = Path(ROOT)
    readme = README.read_text(encoding="utf-8")
    em = ROUTING_RECIPE["em"]
    assert f"| `--epochs`, `--batch-size` | {EPOCHS} (em: {em['epochs']}), {RECIPE['batch_size']} (em: {em['batch_size']}) |" \
        in readme
    lr, em_lr, decay = re.search(r"\| ([\de.-]+) \(em: ([\de.-]+)\), ([\d.]+), none, adam, off \|", readme).groups()
    assert (float(lr), float(em_lr), float(decay)) == (RECIPE["lr"], em["lr"], RECIPE["lr_decay"])
    efficient = pycapsnet.build("efficient").network
    body = sum(int(np.prod(p.shape)) for k, p in efficient.params.items() if not k.startswith("decoder"))
    assert f"{body:,} parameters, decoder apart" in readme
    assert f"{body:,} parameters without the decoder" in (root / "docs" / "architecture.md").read_text()
    performance = (root / "docs" / "performance.md").read_text()
    assert f"paper's CapsNet (dynamic, {CapsNet('numpy').n_params() / 1e6:.1f} M parameters)" in performance
    sys.path.insert(0, str(root / "examples"))
    try:
        import build_your_own
    finally:
        sys.path.pop(0)
    counts = {k: pycapsnet.build(a).network.n_params() for k, a in build_your_own.NETWORKS.items()}
    assert f"two routing layers ({counts['two-routing'] / 1e6:.1f} M parameters)" in performance
    assert f"ConvCaps ({counts['convcaps'] / 1e6:.1f} M parameters)" in performance


def test_the_slurm_script_in_experiments_md_runs_as_written(tmp_path):
    """docs/experiments.md's study.sh (issue 108): a first line sbatch accepts, $DATA set, one thread
    a shard, --choices once a merge wrote one; run by bash with a stand-in pycapsnet that prints
    what it was given."""
    text = Path(ROOT, "docs", "experiments.md").read_text()
    script = re.search(r"```bash\n(#!/bin/bash\n.*?)```", text, re.S).group(1)
    (tmp_path / "study.sh").write_text(script)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "pycapsnet").write_text('#!/bin/bash\necho "$OMP_NUM_THREADS $PYCAPSNET_THREADS $*"\n')
    (bin_dir / "pycapsnet").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "SLURM_ARRAY_TASK_ID": "2",
           "SLURM_ARRAY_TASK_COUNT": "8", "HOME": str(tmp_path)}
    env.pop("DATA", None)
    first = subprocess.run(["bash", "study.sh"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert first.returncode == 0, first.stderr
    assert first.stdout.split() == ["1", "1", "experiment", "routings", "--dataset", "mnist", "--data-dir",
                                    f"{tmp_path}/data/mnist", "--margin", "0.1", "--shard", "2/8", "--out", "run-2"]
    (tmp_path / "merged").mkdir()
    (tmp_path / "merged" / "choices.json").write_text("{}")
    again = subprocess.run(["bash", "study.sh"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert "--choices merged/choices.json" in again.stdout and script.startswith("#!")
