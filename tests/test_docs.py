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
    "torchrun --standalone --nproc_per_node 2 train_numpy.py --out runs/parallel":
        f"torchrun --standalone --nproc_per_node 2 train_numpy.py --out runs/parallel {QUICK_MODEL}",
    "torchrun --nnodes 2 --nproc_per_node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 train_torch.py --device cuda":
        (None, "needs two machines with 8 GPUs each; tests/test_distributed.py runs two processes here"),
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
    for cmd in re.findall(r"`((?:python|bash|pycapsnet|pip) [^`]+)`", text):
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
