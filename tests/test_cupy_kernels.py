"""The CuPy backend's fused kernels (backends/cupy_kernels.py) against their NumPy references: the
readable ``@fusable`` functions of pycapsnet/core and optim.Adam's own update.

Without a GPU, each kernel's body is compiled by the host's C compiler into a loop over its index
``i`` (as cupy.ElementwiseKernel runs it, one thread per index) and driven through the same
``CupyKernels`` wrapper, NumPy standing in for CuPy: the math, the indexing and the wrapper's
shapes and argument order are checked here.  On a GPU the same comparisons run on CuPy's kernels."""
import ctypes
import re
import shutil
import subprocess
import types

import numpy as np
import pytest

from pycapsnet import backends
from pycapsnet.backends import cupy_kernels as ck
from pycapsnet.core.routing import softmax, softmax_backward
from pycapsnet.core.squash import squash, squash_backward
from pycapsnet.training import optim

CC = shutil.which("cc") or shutil.which("gcc")
TOL = {"float64": 1e-12, "float32": 2e-6}


class HostElementwiseKernel:
    """cupy.ElementwiseKernel's calling convention on the host: the body in a C loop over i, raw
    arrays as pointers, non-raw arrays as their element i, scalars as values."""

    def __init__(self, in_params, out_params, body, name, tmp):
        self.params = [p.split() for p in (in_params + ", " + out_params).split(", ")]
        self.body, self.name, self.tmp, self._libs = body, name, tmp, {}

    def __call__(self, *args, size=None):
        assert len(args) == len(self.params), (self.name, len(args))
        arrays = [a for a in args if isinstance(a, np.ndarray)]
        ctype = {np.float64: "double", np.float32: "float"}[arrays[0].dtype.type]
        nonraw = [a for p, a in zip(self.params, args) if p[0] != "raw" and isinstance(a, np.ndarray)]
        assert (size is None) == bool(nonraw), "CuPy takes size only when every array is raw"
        n = nonraw[0].size if nonraw else size
        for a in arrays:
            assert a.flags.c_contiguous
        lib = self._build(ctype, tuple(isinstance(a, np.ndarray) for a in args))
        c_args = [a.ctypes.data_as(ctypes.c_void_p) if isinstance(a, np.ndarray)
                  else ctypes.c_int(a) if p[-2] == "int32"
                  else (ctypes.c_double if ctype == "double" else ctypes.c_float)(a)
                  for p, a in zip(self.params, args)]
        lib.run(ctypes.c_long(n), *c_args)

    def _build(self, ctype, is_array):
        if (ctype, is_array) in self._libs:
            return self._libs[ctype, is_array]
        sig, defines = [], []
        for p, arr in zip(self.params, is_array):
            name, typ = p[-1], "int" if p[-2] == "int32" else "T"
            if not arr:
                sig.append(f"{typ} {name}")
            elif p[0] == "raw":
                sig.append(f"T *{name}")
            else:
                sig.append(f"T *{name}__")
                defines.append(f"#define {name} ({name}__[i])")
        src = (f"#include <math.h>\ntypedef {ctype} T;\n{chr(10).join(defines)}\n"
               f"void run(long n_, {', '.join(sig)}) {{\n for (long i = 0; i < n_; i++) {{\n{self.body}\n }}\n}}\n")
        base = self.tmp / f"{self.name}_{ctype}_{len(self._libs)}"
        base.with_suffix(".c").write_text(src)
        subprocess.run([CC, "-O2", "-shared", "-fPIC", "-o", str(base.with_suffix(".so")), str(base.with_suffix(".c")),
                        "-lm"], check=True, capture_output=True, text=True)
        self._libs[ctype, is_array] = lib = ctypes.CDLL(str(base.with_suffix(".so")))
        return lib


def _host_kernels(tmp_path):
    fake = types.SimpleNamespace(
        ElementwiseKernel=lambda i, o, body, name: HostElementwiseKernel(i, o, body, name, tmp_path),
        empty_like=np.empty_like, empty=np.empty, ascontiguousarray=np.ascontiguousarray)
    return ck.CupyKernels(fake), np, (lambda a: a)


def _gpu_kernels(tmp_path):
    reason = backends.gpu_unavailable_reason("cupy")
    if reason:
        pytest.skip(f"cupy: {reason}")
    import cupy

    return ck.CupyKernels(cupy), cupy, cupy.asnumpy


WHERE = [pytest.param(_host_kernels, id="host-cc", marks=pytest.mark.skipif(CC is None, reason="no C compiler")),
         pytest.param(_gpu_kernels, id="cupy")]


def _close(actual, expected, dtype, what):
    np.testing.assert_allclose(actual, expected, rtol=TOL[dtype], atol=TOL[dtype] * np.abs(expected).max(), err_msg=what)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("where", WHERE)
def test_squash_and_its_backward(where, dtype, tmp_path):
    K, xp, host = where(tmp_path)
    rng = np.random.default_rng(0)
    s = rng.normal(size=(5, 3, 4, 8)).astype(dtype)
    s[0, 0, 0] = 0  # |s| = 0: v = 0 and the gradient's limit
    s[1, 1, 1] *= 1e-4
    dv = rng.normal(size=s.shape).astype(dtype)
    v_ref, n_ref = squash.reference(np, s)
    v, n = K.squash(xp.asarray(s))
    _close(host(v), v_ref, dtype, "v")
    _close(host(n), n_ref, dtype, "|s|")
    ds = K.squash_backward(xp.asarray(s), n, xp.asarray(dv))
    _close(host(ds), squash_backward.reference(np, s, n_ref, dv), dtype, "ds")


@pytest.mark.parametrize("shape", [(4, 10, 36), (3, 6)])  # routing's (N, J, I); gradcheck's 2-D
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("where", WHERE)
def test_softmax_over_output_capsules_and_its_backward(where, dtype, shape, tmp_path):
    K, xp, host = where(tmp_path)
    rng = np.random.default_rng(1)
    b = (5 * rng.normal(size=shape)).astype(dtype)
    b[0, 0] = 80  # exp would overflow without the max subtracted
    dc = rng.normal(size=shape).astype(dtype)
    c_ref = softmax.reference(np, b)
    c = K.softmax(xp.asarray(b))
    _close(host(c), c_ref, dtype, "c")
    _close(host(K.softmax_backward(c, xp.asarray(dc))), softmax_backward.reference(np, c_ref, dc), dtype, "db")


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("where", WHERE)
def test_adam_is_optim_adams_update(where, dtype, tmp_path):
    """Three steps of the kernel against optim.Adam's own update on NumPy (Backend's form), the step's
    scalars read from arrays as on the device."""
    K, xp, host = where(tmp_path)
    rng = np.random.default_rng(2)
    B = backends.get("numpy", dtype=dtype)
    shapes = {"W": (3, 7), "b": (5,)}
    params = {k: rng.normal(size=s).astype(dtype) for k, s in shapes.items()}
    model = types.SimpleNamespace(B=B, params={k: p.copy() for k, p in params.items()}, grads={})
    opt = optim.Adam(model, lr=1e-2)
    w = {k: xp.asarray(p) for k, p in params.items()}
    m = {k: xp.zeros(s, dtype=dtype) for k, s in shapes.items()}
    v = {k: xp.zeros(s, dtype=dtype) for k, s in shapes.items()}
    for step in range(3):
        model.grads = {k: rng.normal(size=s).astype(dtype) for k, s in shapes.items()}
        opt.step()  # NumPy's backend: Backend.adam's form, optim.Adam's update
        scalars = (xp.asarray(opt._step_size), xp.asarray(opt._c2))
        for k in shapes:
            K.adam(w[k], xp.asarray(model.grads[k]), m[k], v[k], *scalars, (opt.b1, opt.b2), opt.eps)
        for k in shapes:
            _close(host(w[k]), model.params[k], dtype, f"w {k} step {step + 1}")
            _close(host(m[k]), opt.state["m"][k], dtype, f"m {k}")
            _close(host(v[k]), opt.state["v"][k], dtype, f"v {k}")


def test_no_kernel_uses_cupys_reserved_names():
    """``n``, ``i`` and names starting with ``_`` are CuPy's own inside an elementwise kernel."""
    for k in ck.KERNELS:
        names = [p.split()[-1] for p in (k.in_params + ", " + k.out_params).split(", ")]
        assert not [x for x in names if x in ("n", "i") or x.startswith("_")], k.name
        assert not re.search(r"\bn\b", re.sub(r"//.*", "", k.body)), k.name
