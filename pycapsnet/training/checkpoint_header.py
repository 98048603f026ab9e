"""What a checkpoint's JSON header must hold, checked before anything is built from it: the network
(a built-in's configuration or a description), the epoch, the optimizer, the recipe, the class
names, the record of the data read, the generators' states and one finite record per epoch."""
from __future__ import annotations

import math
from dataclasses import fields

from .optim import NAMES as optim_names
from ..core.model import CapsNetConfig


def header_problem(header) -> str | None:
    """What makes ``header`` other than what ``save`` writes, in words; None if nothing."""
    if not isinstance(header, dict):
        return f"its header is a JSON {type(header).__name__}, not the object pycapsnet writes"
    problem = _architecture_problem(header)
    if problem:
        return problem
    epoch = header.get("epoch", 0)
    if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
        return f"its epoch is {epoch!r}, not a whole number of at least 0"
    if header.get("optimizer") not in (None, *optim_names):
        return f"its optimizer is {header['optimizer']!r}, not one of {', '.join(optim_names)}"
    for key, kind in (("recipe", dict), ("history", list)):
        if header.get(key) is not None and not isinstance(header[key], kind):
            return f"its {key} is a JSON {type(header[key]).__name__}, not {'an object' if kind is dict else 'a list'}"
    classes = header.get("classes")
    if classes is not None and not (isinstance(classes, list) and all(isinstance(c, str) for c in classes)
                                    and len(classes) == n_classes_of(header)):
        return "its class names are not a list of one name per class"
    record = header.get("data")
    if record is not None and not (isinstance(record, list) and all(
            isinstance(r, list) and len(r) == 5 and isinstance(r[2], int) and r[4] in ("train", "test")
            and all(isinstance(r[k], str) for k in (0, 1, 3, 4)) for r in record)):
        return "its record of the data it read is not a list of [path, class, size, hash, split]"
    generators = header.get("generators")
    if generators is not None and not (isinstance(generators, dict) and all(
            isinstance(k, str) and isinstance(v, dict) for k, v in generators.items())):
        return "its generator states are not an object of one state per layer"
    history = header.get("history") or []
    if not all(isinstance(r, dict) and r.get("epoch") == k + 1 for k, r in enumerate(history)) \
            or (history and len(history) != epoch):
        return f"its history does not hold one record for each of its {epoch} epochs"
    return next(filter(None, (_record_problem(r) for r in history)), None)


# What an epoch's record holds (loop.Training.train): numbers, the accuracies shares of 1.  The
# history lies outside the digest (it grows, the weights' binding does not): each value is checked.
RECORD_NUMBERS = ("lr", "train_loss", "test_loss", "val_loss", "train_seconds", "train_samples_per_s")
RECORD_SHARES = ("train_acc", "test_acc", "val_acc")


def _record_problem(record) -> str | None:
    for key in (*RECORD_NUMBERS, *RECORD_SHARES):
        if key not in record:
            continue
        v = record[key]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or \
                (key in RECORD_SHARES and not 0 <= v <= 1):
            what = "a share from 0 to 1" if key in RECORD_SHARES else "a finite number"
            return f"its history's record of epoch {record['epoch']} holds {key} {v!r}, not {what}"
    if "processes" in record and (isinstance(record["processes"], bool) or not isinstance(record["processes"], int)
                                  or record["processes"] < 1):
        return f"its history's record of epoch {record['epoch']} holds processes {record['processes']!r}"
    return None


def _architecture_problem(header) -> str | None:
    """What is wrong with the header's model: a built-in's configuration or a description."""
    if "architecture" in header and "config" not in header:
        arch = header["architecture"]
        if not isinstance(arch, dict) or not isinstance(arch.get("body"), list) \
                or not isinstance(arch.get("n_classes"), int) or not isinstance(arch.get("input_shape"), list):
            return "its network description is not an object with a body, input_shape and n_classes"
        return None
    config = header.get("config")
    if not isinstance(config, dict):
        return "its header has no model configuration" if config is None else \
            f"its model configuration is a JSON {type(config).__name__}, not an object"
    unknown = sorted(set(config) - {f.name for f in fields(CapsNetConfig)})
    if unknown:
        return f"its model configuration has fields this pycapsnet does not know: {', '.join(unknown)}"
    try:
        CapsNetConfig(**config)
    except (TypeError, ValueError) as e:  # CapsNetError is a ValueError
        return f"its model configuration is invalid ({e})"
    return None


def n_classes_of(header: dict) -> int:
    return header["config"].get("n_classes", 10) if "config" in header else header["architecture"]["n_classes"]
