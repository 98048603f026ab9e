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
import shutil
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

    from pycapsnet.tools.plots import training_curves
    from pycapsnet.training.run_dir import best_epoch, read_metrics

    history = read_metrics(os.path.join(args.run, "metrics.jsonl"))
    os.makedirs(args.dest, exist_ok=True)
    shutil.copyfile(os.path.join(args.run, "metrics.jsonl"), os.path.join(args.dest, "metrics.jsonl"))
    if args.log:
        shutil.copyfile(args.log, os.path.join(args.dest, "run.log"))
    training_curves(history, os.path.join(args.dest, "curves.png"))
    command = args.command.replace(args.data_dir, "DIR") if args.data_dir else args.command
    best = best_epoch(history)
    chosen = history[best - 1] if best else history[-1]
    record = {
        "command": command, "commit": args.commit, "machine": machine(command), "epochs_done": len(history),
        "wall_seconds": round(sum(r["train_seconds"] for r in history)),
        "chosen_epoch": chosen["epoch"], "chosen_by": "validation accuracy" if best else "the last epoch",
        "val_acc": chosen.get("val_acc"), "test_acc": chosen.get("test_acc"),
        "test_error_percent": None if chosen.get("test_acc") is None else round(100 * (1 - chosen["test_acc"]), 2),
    }
    with open(os.path.join(args.dest, "record.json"), "w") as f:
        json.dump(record, f, indent=1)
        f.write("\n")
    pct = lambda r, k: "" if r.get(k) is None else f"{100 * r[k]:.2f}"
    rows = "\n".join(f"| {r['epoch']} | {r['train_loss']:.4f} | {pct(r, 'train_acc')} | {pct(r, 'val_acc')} | "
                     f"{pct(r, 'test_acc')} | {r['train_seconds']:.0f} |" for r in history)
    with open(os.path.join(args.dest, "README.md"), "w") as f:
        f.write(f"# {os.path.basename(os.path.abspath(args.dest))}\n\n"
                f"    {command}\n\n"
                f"Commit {args.commit}; {record['machine']}; {len(history)} epochs, "
                f"{record['wall_seconds'] / 3600:.1f} h of training time.  Chosen on {record['chosen_by']}: "
                f"epoch {chosen['epoch']}, test accuracy {100 * (chosen.get('test_acc') or 0):.2f}% "
                f"({record['test_error_percent']}% error).  {args.note}\n\n"
                "| epoch | train loss | train % | validation % | test % | seconds |\n|---|---|---|---|---|---|\n"
                f"{rows}\n\n![curves](curves.png)\n")
    print(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
