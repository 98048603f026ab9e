"""Will it fit, for a described network: its train step measured, layer by layer, not modelled.

plan.py works a built-in network's step out on paper, from its configuration.  A network that a
user describes can stack any layers in any order, so here the step is run instead, on the NumPy
backend, under tracemalloc (which sees every NumPy array), at two small batches a < b (2 and 4
samples a host thread):

* **kept** by a layer: the bytes of the arrays reachable from it after its forward that were not
  reachable before (its cache, and anything else its forward keeps for its backward), each
  underlying buffer counted once, by the first layer that holds it;
* **work**: the most that a layer's forward or backward adds, at its peak, to what was alive when
  it began (its temporaries and its output, or its input's gradient);
* **state**, held whatever the batch: what is reachable from a layer before the step, less its
  parameters and gradients (batch norm's running statistics, per-shape constants);
* the step's **peak**: the most bytes alive at once, and where in the step it fell.

The step is cut into segments at each layer's forward and backward.  What is alive in a segment
grows linearly with the batch except where a layer works in bounded chunks, so each segment's peak
is extrapolated along the line through its peaks at a and b, and the step's peak at batch n is the
largest of those lines at n (measured directly when n <= b).  Chunked temporaries still growing
between a and b make the slope steeper than it is further out: the extrapolation then errs high,
and the largest batch low.  Like plan.py,
it counts NumPy's arrays; GPU allocators cache and round blocks, so read a GPU plan as a lower bound.
"""
from __future__ import annotations

import tracemalloc
import types
from dataclasses import dataclass, field

import numpy as np

from pycapsnet import backends
from pycapsnet.backends.base import Backend
from pycapsnet.backends.host import cpu_threads
from pycapsnet.errors import CapsNetError

from .ledger import LayerMemory, OPTIMIZER_SLOTS
from .plan import SEARCH_CAP  # largest_batch counts no further, as the built-in plan's
from ..core import architecture
from ..training import optim


@dataclass
class MeasuredPlan:
    batch_size: int
    itemsize: int
    optimizer: str
    layers: list = field(default_factory=list)   # LayerMemory per layer, at batch_size
    state: int = 0          # parameters, gradients, optimizer slots, buffers and constants (bytes)
    peak: int = 0           # the step's peak at batch_size (bytes), measured or extrapolated
    peak_at: str = ""
    lines: dict = field(default_factory=dict)    # segment -> (bytes at batch 0, bytes per image)
    measured_at: tuple = ()  # the batches whose steps were run

    @property
    def n_params(self) -> int:
        return sum(layer.params for layer in self.layers)

    @property
    def per_image(self) -> float:
        """What one more image adds to the peak: the slope of the segment where it falls."""
        return self.lines[self.peak_at][1] if self.peak_at in self.lines else 0.0

    def peak_for(self, n: int) -> tuple:
        """(bytes, segment): the largest of the segments' lines at batch n."""
        return max((base + slope * n, label) for label, (base, slope) in self.lines.items())

    def largest_batch(self, budget: int) -> int:
        """The largest batch at which every segment's line stays within ``budget`` bytes (0 if not
        even one image fits; SEARCH_CAP if the lines allow that many: the count stops there)."""
        most = SEARCH_CAP
        for base, slope in self.lines.values():
            if base + slope > budget:
                return 0
            if slope > 0:
                most = min(most, int((budget - base) // slope))
        return most


def measured_batches() -> tuple:
    """The two batches each line goes through: 2 and 4 samples a host thread.  Below 2 a thread the
    NumPy backend runs a batch's gathers and products whole, from there on split over its threads
    (base.py, _over_batch), so both batches must lie where the step splits as large ones do."""
    threads = cpu_threads()
    return 2 * threads, 4 * threads


def plan_network(arch: dict, batch_size: int, dtype: str = "float32", optimizer: str = "adam") -> MeasuredPlan:
    """The memory plan of one training step of the described network ``arch`` (its input_shape and
    n_classes set) at ``batch_size``: measured at two small batches, extrapolated (module docstring)."""
    if optimizer not in OPTIMIZER_SLOTS:
        raise ValueError(f"unknown optimizer {optimizer!r}: use one of {tuple(OPTIMIZER_SLOTS)}")
    a, b = measured_batches()
    n = batch_size
    steps = {k: measure_step(arch, k, dtype, optimizer) for k in sorted({a, b} | ({n} if n <= b else set()))}
    lo, hi = steps[a]["segments"], steps[b]["segments"]
    lines = {k: (lo[k] - (hi[k] - lo[k]) / (b - a) * a, (hi[k] - lo[k]) / (b - a)) for k in lo.keys() & hi.keys()}
    step = steps.get(n, steps[b])
    plan = MeasuredPlan(n, np.dtype(dtype).itemsize, optimizer, step["layers"], step["state"], step["peak"],
                        step["peak_at"], lines, (a, b))
    if n not in steps:
        along = lambda x, y: max(0, round(y + (y - x) / (b - a) * (n - b)))  # noqa: E731  the line through a, b
        for row, low in zip(plan.layers, steps[a]["layers"]):
            row.kept, row.work = along(low.kept, row.kept), along(low.work, row.work)
        peak, plan.peak_at = plan.peak_for(n)
        plan.peak = round(peak)
    return plan


def measure_step(arch: dict, n: int, dtype: str = "float32", optimizer: str = "adam") -> dict:
    """Run two train steps (the first makes the optimizer's slots and per-shape constants) of ``arch``
    at batch ``n`` on the NumPy backend under tracemalloc, from before the network is built.
    Returns {"peak", "peak_at", "state", "layers"}: the peak over both steps, and the second
    step's rows (LayerMemory, every layer of the body and the decoder in order)."""
    B = backends.get("numpy", dtype=dtype)
    rng = np.random.default_rng(0)
    x = rng.random((n, *arch["input_shape"])).astype(dtype)
    y = np.arange(n) % arch["n_classes"]
    try:
        architecture.build(arch, B).train_step_grads(x[:1], y[:1])  # imports what a step imports, untraced
        tracemalloc.start()
        net = architecture.build(arch, B)
        opt = optim.make(optimizer, net, 1e-3)
        meter, rows = _Meter(), []
        for name, layer in _layers(net):
            rows.append(_instrument(name, layer, meter))
        net.train_step_grads(x, y)
        opt.step()
        meter.mark("the optimizer")
        state = tracemalloc.get_traced_memory()[0]
        for row in rows:
            row.begin_step()
        meter.claimed = set()
        net.train_step_grads(x, y)
        meter.mark("the end of the backward")
        opt.step()
        meter.mark("the optimizer")
        batch = x.nbytes + y.nbytes  # made before tracing began
        return {"peak": meter.peak + batch, "peak_at": meter.at, "state": state,
                "segments": {k: v + batch for k, v in meter.segments.items()},
                "layers": [row.memory for row in rows]}
    except MemoryError:
        raise CapsNetError(f"measuring a train step at batch {n} ran out of this machine's memory: plan a "
                           f"smaller batch, or make the network's layers smaller") from None
    finally:
        tracemalloc.stop()  # a no-op where it never started


def _layers(net):
    """(name, layer) of the body's layers, then the decoder's: each a row of the plan."""
    yield from net.body
    if net.decoder is not None:
        yield from net.decoder


class _Meter:
    """The step cut into segments at each layer's forward and backward: the traced peak of each
    (tracemalloc's peak is reset at every cut), the largest so far and the segment it fell in."""

    def __init__(self):
        self.peak, self.at, self.last = 0, "", "the start"
        self.last_peak, self.claimed = 0, set()  # the closed segment's peak; buffers a layer has kept
        self.segments = {}  # label -> its peak (bytes)

    def mark(self, label: str) -> int:
        """Close the segment that ran up to now, naming it ``label``; return the bytes alive now."""
        current, peak = tracemalloc.get_traced_memory()
        self.segments[label] = max(peak, self.segments.get(label, 0))
        if peak > self.peak:
            self.peak, self.at = peak, label
        tracemalloc.reset_peak()
        self.last, self.last_peak = label, peak
        return current

    def between(self) -> int:
        return self.mark(f"what follows {self.last}")


class _Row:
    """One layer's measurements, taken by wrapping its forward and backward (instance attributes)."""

    def __init__(self, name, layer):
        self.layer, self.memory = layer, LayerMemory(name, sum(int(p.size) for p in layer.params.values()))
        self.before = {}  # buffer id -> bytes reachable from the layer when the measured step began

    def begin_step(self):
        own = _buffers([self.layer.params, self.layer.grads])  # grads may view one flat buffer: all of it
        held = _buffers(self.layer)
        self.memory.state = sum(nbytes for key, nbytes in held.items() if key not in own)
        self.memory.kept = self.memory.work = 0
        self.before = held


def _instrument(name, layer, meter) -> _Row:
    row = _Row(name, layer)
    forward, backward = layer.forward, layer.backward

    def measured_forward(x):
        start = meter.between()
        out = forward(x)
        meter.mark(f"{name} forward")
        row.memory.work = max(row.memory.work, meter.last_peak - start)
        kept = {k: v for k, v in _buffers(layer).items() if k not in row.before and k not in meter.claimed}
        meter.claimed |= kept.keys()
        row.memory.kept = sum(kept.values())
        return out

    def measured_backward(dy, input_grad=True):
        start = meter.between()
        out = backward(dy, input_grad=input_grad)
        meter.mark(f"{name} backward")
        row.memory.work = max(row.memory.work, meter.last_peak - start)
        return out

    layer.forward, layer.backward = measured_forward, measured_backward
    return row


def _buffers(obj, found=None, seen=None, depth=0) -> dict:
    """{id: bytes} of the NumPy buffers reachable from ``obj`` through containers and attributes:
    each array counted by the buffer it views (its base's base...), so a view costs nothing more."""
    found = {} if found is None else found
    seen = set() if seen is None else seen
    if id(obj) in seen or depth > 8:
        return found
    seen.add(id(obj))
    if isinstance(obj, np.ndarray):
        while isinstance(obj.base, np.ndarray):
            obj = obj.base
        found[id(obj)] = obj.nbytes
    elif isinstance(obj, dict):
        for value in obj.values():
            _buffers(value, found, seen, depth + 1)
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for value in obj:
            _buffers(value, found, seen, depth + 1)
    elif hasattr(obj, "__dict__") and not isinstance(obj, (type, types.ModuleType, types.FunctionType)) \
            and not isinstance(obj, Backend):
        for value in vars(obj).values():
            _buffers(value, found, seen, depth + 1)
    return found
