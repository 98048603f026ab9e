"""The record of a reported run, for docs/results/: what reproduces it and what it gave.

    python benchmarks/record_run.py RUN_DIR docs/results/NAME --command "train_numpy.py --dataset mnist ..." \
        --data-dir /where/the/idx/files/are --commit abc1234 [--log RUN.log]

Writes into the record folder: metrics.jsonl (every epoch: train loss and accuracy, validation and
test accuracy, seconds), curves.png, and record.json -- the command with the data path written as
DIR, the machine (CPU model from lscpu, cores), the commit, the wall time so far, the epoch chosen
on validation and its test accuracy -- and a README.md that says the same in words.
"""
import argparse
import json
import os
import platform
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def cpu() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except OSError:
        return platform.processor() or "unknown CPU"
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    get = lambda k: fields.get(k, "").strip()
    return (f"{get('Model name')} (family {get('CPU family')} model {get('Model')}), {os.cpu_count()} cores"
            if get("Model name") else platform.processor())


def machine(command: str) -> str:
    """The CPU, and the GPU first where the command trains on one (nvidia-smi names it)."""
    if "cuda" not in command:
        return cpu()
    try:
        gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True).stdout.strip().splitlines()[0]
    except (OSError, IndexError):
        gpu = "a CUDA GPU"
    return f"{gpu}, host {cpu()}"


def _checked(args):
    """(history, the log's bytes or None) of the run, everything a record needs checked before a
    byte of DEST is written: CapsNetError naming what is missing or wrong."""
    from pycapsnet.errors import CapsNetError
    from pycapsnet.training.run_dir import read_metrics
    from pycapsnet.userfiles import read_regular

    metrics = os.path.join(args.run, "metrics.jsonl")
    if not os.path.isdir(args.run):
        raise CapsNetError(f"{args.run} is not a run directory (no such directory): name the --out of a training run")
    if not os.path.isfile(metrics):
        raise CapsNetError(f"{args.run} holds no metrics.jsonl: name the --out of a run that finished an epoch")
    history = read_metrics(metrics)
    if not history:
        raise CapsNetError(f"{metrics} holds no epoch records (empty, or not what training writes)")
    for k, r in enumerate(history):
        if r.get("epoch") != k + 1 or not isinstance(r.get("train_loss"), (int, float)):
            raise CapsNetError(f"{metrics}: line {k + 1} is not the record of epoch {k + 1} that training writes")
    if os.path.exists(args.dest) and not os.path.isdir(args.dest):
        raise CapsNetError(f"{args.dest} is a file; DEST names the record's folder")
    log = None if args.log is None else read_regular(args.log, "the log", 1 << 30)
    return history, log


def _record(args, history) -> dict:
    from pycapsnet.training.run_dir import best_epoch

    command = args.command.replace(args.data_dir, "DIR") if args.data_dir else args.command
    best = best_epoch(history)
    chosen = history[best - 1] if best else history[-1]
    seconds = [r.get("train_seconds") for r in history]
    return {
        "command": command, "commit": args.commit, "machine": machine(command), "epochs_done": len(history),
        "wall_seconds": round(sum(seconds)) if all(isinstance(t, (int, float)) for t in seconds) else None,
        "chosen_epoch": chosen["epoch"], "chosen_by": "validation accuracy" if best else "the last epoch",
        "val_acc": chosen.get("val_acc"), "test_acc": chosen.get("test_acc"),
        "test_error_percent": None if chosen.get("test_acc") is None else round(100 * (1 - chosen["test_acc"]), 2),
    }


def _readme(args, record, history) -> str:
    pct = lambda r, k: "" if r.get(k) is None else f"{100 * r[k]:.2f}"
    secs = lambda r: "" if r.get("train_seconds") is None else f"{r['train_seconds']:.0f}"
    rows = "\n".join(f"| {r['epoch']} | {r['train_loss']:.4f} | {pct(r, 'train_acc')} | {pct(r, 'val_acc')} | "
                     f"{pct(r, 'test_acc')} | {secs(r)} |" for r in history)
    chosen = history[record["chosen_epoch"] - 1]
    hours = "training time not recorded" if record["wall_seconds"] is None else \
        f"{record['wall_seconds'] / 3600:.1f} h of training time"
    test = "no test accuracy" if chosen.get("test_acc") is None else \
        f"test accuracy {100 * chosen['test_acc']:.2f}% ({record['test_error_percent']}% error)"
    return (f"# {os.path.basename(os.path.abspath(args.dest))}\n\n    {record['command']}\n\n"
            f"Commit {args.commit}; {record['machine']}; {len(history)} epochs, {hours}.  Chosen on "
            f"{record['chosen_by']}: epoch {chosen['epoch']}, {test}.  {args.note}\n\n"
            "| epoch | train loss | train % | validation % | test % | seconds |\n|---|---|---|---|---|---|\n"
            f"{rows}\n\n![curves](curves.png)\n")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run")
    p.add_argument("dest")
    p.add_argument("--command", required=True, help="the command as run")
    p.add_argument("--data-dir", default=None, help="the data path in the command, written as DIR in the record")
    p.add_argument("--commit", required=True)
    p.add_argument("--log", default=None, help="the run's log, copied as run.log")
    p.add_argument("--note", default="", help="a sentence for the README: what is left, what differs")
    args = p.parse_args(argv)

    from pycapsnet.errors import CapsNetError
    from pycapsnet.tools.plots import training_curves
    from pycapsnet.training.files import atomic_write

    try:
        history, log = _checked(args)
        record = _record(args, history)
        lines = "".join(json.dumps(r, allow_nan=False) + "\n" for r in history)
        readme = _readme(args, record, history)
        os.makedirs(args.dest, exist_ok=True)
        training_curves(history, os.path.join(args.dest, "curves.png"))  # written whole, like each file here
        atomic_write(os.path.join(args.dest, "metrics.jsonl"), lambda f: f.write(lines), text=True)
        if log is not None:
            atomic_write(os.path.join(args.dest, "run.log"), lambda f: f.write(log))
        atomic_write(os.path.join(args.dest, "record.json"), lambda f: f.write(json.dumps(record, indent=1) + "\n"),
                     text=True)
        atomic_write(os.path.join(args.dest, "README.md"), lambda f: f.write(readme), text=True)
    except CapsNetError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: cannot write the record into {args.dest}: {e.strerror or e}", file=sys.stderr)
        return 2
    print(json.dumps(record, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
