"""An experiment's finished units -- one network trained from one seed, and what was measured of it
-- kept in OUT/units.json as each one ends.  The same command run again after a stop (a kill, a
Ctrl-C, a GPU call's time limit) goes on from the first unit not yet finished: a unit depends only
on its seed and the flags, never on the units before it, so the results are the uninterrupted
run's.  Units recorded under other flags are not reused (the file says which flags it holds)."""
from __future__ import annotations

import json
import os

from ..errors import CapsNetError, first_line, printable
from ..training.files import atomic_write
from ..training.log import say

FILE = "units.json"
# what a unit does not depend on: more seeds are more units; the parts run or left out are other units;
# the affine target picks the epoch each network is read at, after training
NOT_FLAGS = ("seeds", "out", "fn", "command", "no_affine", "no_multimnist", "routings", "affine_target")


class Units:
    def __init__(self, out: str, args=None, flags: dict | None = None, layout: dict | None = None):
        """``flags``: what the units depend on, given (the routing study's settings); else the
        arguments' values but those of NOT_FLAGS.  ``layout``: kept beside them, not compared (the
        routing study's rows and seeds, which a merge reads)."""
        self.path = os.path.join(out, FILE)
        self.layout = layout
        self.flags = json.loads(json.dumps(flags)) if flags is not None else \
            {k: (list(v) if isinstance(v, tuple) else v) for k, v in sorted(vars(args).items())
             if k not in NOT_FLAGS and not callable(v)}
        self.done = {}
        saved = self._read()
        if saved is None:
            return
        if saved.get("flags") == self.flags:
            self.done = saved.get("units", {})
            shown = ", ".join(list(self.done)[:6]) + (f" and {len(self.done) - 6} more" if len(self.done) > 6 else "")
            say(f"{len(self.done)} finished unit(s) in {self.path} reused: {shown} (delete the file to train them "
                "again)")
        elif flags is not None:  # the routing study's units are hours of work: never replaced unasked
            other = saved.get("flags") if isinstance(saved.get("flags"), dict) else {}
            what = sorted(k for k in set(other) | set(self.flags) if other.get(k) != self.flags.get(k))
            raise CapsNetError(f"{self.path} holds units run with other {' and '.join(what) or 'settings'} (settings "
                               "or code): give another --out, or delete the file to train them again")
        else:
            say(f"{self.path} holds units of other flags: they are not reused, and the file is replaced")

    def _read(self):
        if not os.path.exists(self.path):
            return None
        try:
            with open(self.path) as f:
                saved = json.load(f)
        except (OSError, ValueError, RecursionError) as e:  # (JSON nested deeper than Python's stack)
            why = "nested too deep" if isinstance(e, RecursionError) else printable(first_line(e))
            raise CapsNetError(f"cannot read {self.path} ({why}): delete it to train every unit again") from None
        if not isinstance(saved, dict) or not isinstance(saved.get("units", {}), dict):
            raise CapsNetError(f"{self.path} is not an experiment's units file: delete it to train every unit again")
        return saved

    @classmethod
    def read(cls, out: str) -> tuple:
        """(flags, units, layout) of the units file in ``out``; CapsNetError if there is none or it is damaged."""
        units = cls.__new__(cls)
        units.path = os.path.join(out, FILE)
        saved = units._read()
        if saved is None:
            raise CapsNetError(f"{out} holds no {FILE}: give folders a routing study wrote")
        return saved.get("flags"), saved.get("units", {}), saved.get("layout")

    def measure(self, key: str, train) -> dict:
        """What the unit ``key`` measured: recorded, if it finished; else ``train()``'s, recorded
        now, the file written whole."""
        if key in self.done:
            return self.done[key]
        measured = self.done[key] = train()
        record = {"flags": self.flags, **({"layout": self.layout} if self.layout else {}), "units": self.done}
        try:
            atomic_write(self.path, lambda f: json.dump(record, f, indent=1), text=True)
        except OSError as e:
            raise CapsNetError(f"cannot write {self.path}: {e.strerror or e}") from None
        return measured
