"""Dynamic routing with one transform per capsule type, shared over positions, without û.

With ``share_spatial`` the prediction of parent j by child i = (p, t) (position p, type t) is
û_j|i = W_tj u_pt: linear in u, with a small matrix W_tj (D x K) per type and parent.  Every quantity
routing needs can then be had from u and small per-(t, j) arrays, never from û, which is
P*T*J*D floats per image (6 GB at 224x224x3 with 276 classes):

    s_j  = sum_i c_ij û_j|i = sum_t W_tj z_tj,        z_tj = sum_p c_(p,t)j u_pt     (K-vectors)
    û_j|i . v_j             = u_pt . a_tj,            a_tj = W_tj^T v_j
    b^r_(p,t)j              = u_pt . A^r_tj,           A^r  = sum_{r' < r} a^{r'}

Shapes (N images, T types, P positions, K child dims, J parents, D parent dims):
    u     (N, T, P, K)   children, type before position so that a chunk of positions is one slice
    W     (T, J, D, K)
    A, z  (N, T, J, K)   accumulated agreement directions, coupling-weighted child sums
    b, c  (N, T, p, J)   logits and coupling coefficients of a chunk of p positions
    s, v  (N, J, D)

Forward, r = 0 .. R-1 (A^0 = 0, so c^0 = 1/J and z^0 = sum_p u / J):
    c^r = softmax_j(u . A^r);  z^r = sum_p c^r u;  s^r = sum_t W z^r;  v^r = squash(s^r);
    A^{r+1} = A^r + W^T v^r  (r < R-1).
c is made one chunk of positions at a time (``chunk`` positions) and never kept: the backward makes
it again from u and A^r.  So memory holds u, du and a chunk's (N, T, chunk, J), not (N, J, P*T).

Backward, "full": walk r from R-1 down, carrying G = dL/dA^{r+1} (0 at r = R-1):
    dv^r  = dv (r = R-1)  or  sum_t W_tj G_tj           (v^r reaches the loss through A^{r+1})
    ds^r  = squash_backward(s^r, dv^r)
    dW_tj += sum_n ds^r_j z^r_tj^T  +  sum_n v^r_j G_tj^T   (the second for r < R-1)
    dz^r  = W_tj^T ds^r_j
    du_pt += sum_j c^r dz^r_tj                           (from z^r = sum_p c u)
    dc^r  = u_pt . dz^r_tj;  db^r = c^r (dc^r - sum_j c^r dc^r)        (softmax backward)
    du_pt += sum_j db^r A^r_tj;   G += sum_p db^r u_pt     (from b^r = u . A^r; r > 0)
Backward, "final" (c^{R-1} treated as constants): the r = R-1 step without db.
The materialised form (routing.py) computes the same function and gradient: the tests compare them.
"""
from __future__ import annotations

from .routing import softmax, softmax_backward
from .squash import squash, squash_backward


def _by_parent(B, x):
    """(N, T, J, K) -> (J, T*K, N): a batch over parents j of (T*K, N) matrices."""
    xp = B.xp
    n, t, j, k = x.shape
    return B.contiguous(xp.reshape(xp.permute_dims(x, (2, 1, 3, 0)), (j, t * k, n)))


def _capsules(B, Wm, z):
    """s_j = sum_(t, k) W_tj[:, k] z_tj[k]: Wm (J, D, T*K), z (N, T, J, K) -> (N, J, D)."""
    return B.xp.permute_dims(B.matmul(Wm, _by_parent(B, z)), (2, 0, 1))


def _directions(B, Wm, v, types):
    """a_tj = W_tj^T v_j: Wm (J, D, T*K), v (N, J, D) -> (N, T, J, K)."""
    xp = B.xp
    j, _, tk = Wm.shape
    a = B.matmul(xp.matrix_transpose(Wm), B.contiguous(xp.permute_dims(v, (1, 2, 0))))  # (J, T*K, N)
    return xp.permute_dims(xp.reshape(a, (j, types, tk // types, -1)), (3, 1, 0, 2))


def _outer(B, x, y):
    """sum_n x_j y_tj^T: x (N, J, D), y (N, T, J, K) -> (J, D, T*K)."""
    xp = B.xp
    return B.matmul(B.contiguous(xp.permute_dims(x, (1, 2, 0))), xp.matrix_transpose(_by_parent(B, y)))


def by_parent(B, W):
    """W (T, J, D, K) -> Wm (J, D, T*K), the layout of the products above."""
    xp = B.xp
    t, j, d, k = W.shape
    return B.contiguous(xp.reshape(xp.permute_dims(W, (1, 2, 0, 3)), (j, d, t * k)))


def coupling(B, u, A, a, b):
    """c of positions a..b: softmax over j of b_(p,t)j = u_pt . A_tj -> (N, T, b - a, J)."""
    return softmax(B.xp, B.matmul(u[:, :, a:b], B.xp.matrix_transpose(A)), axis=-1)


def forward(B, u, W, iters: int, chunk: int, fixed_coupling=None, bias=None):
    """(v, trace) with trace[r] = (A^r or None for 0, z^r, s^r, |s^r|, v^r).  ``fixed_coupling``
    (N, T, P, J): the last iteration's c, held fixed (the function "final" mode differentiates).
    ``bias`` (J, D) or None: β_j, added to every iteration's s_j (routing.py)."""
    xp = B.xp
    n, types, positions, _ = u.shape
    parents = W.shape[1]
    Wm = by_parent(B, W)
    A, trace = None, []
    for r in range(iters):
        last = r == iters - 1
        fixed = last and fixed_coupling is not None
        if A is None and not fixed:  # c^0 = 1/J everywhere: z^0 = sum_p u / J, the same for every j
            z = xp.broadcast_to(xp.sum(u, axis=2, keepdims=True) / parents, (n, types, parents, u.shape[3]))
        else:
            z = None
            for a in range(0, positions, chunk):
                b = min(a + chunk, positions)
                c = fixed_coupling[:, :, a:b] if fixed else coupling(B, u, A, a, b)
                part = B.matmul(xp.matrix_transpose(c), u[:, :, a:b])              # (N, T, J, K)
                z = part if z is None else z + part
                del c  # before the next chunk's is made: one chunk's coupling exists at a time
        s = _capsules(B, Wm, z)
        if bias is not None:
            s = s + bias
        v, s_norm = squash(xp, s)
        trace.append((A, z, s, s_norm, v))
        if not last:
            direction = _directions(B, Wm, v, types)
            A = direction if A is None else A + direction
    return v, trace


def backward(B, u, W, trace, dv, mode: str, chunk: int):
    """(du (N, T, P, K), dW (T, J, D, K), dβ (J, D)) from dL/dv (N, J, D); the docstring's
    recursion.  dβ = sum_r sum_n ds^r is the gradient of a bias forward added (unused without one)."""
    xp = B.xp
    types, parents, dims, k = W.shape
    positions = u.shape[2]
    Wm = by_parent(B, W)
    du = B.zeros(tuple(u.shape))
    dWm = B.zeros((parents, dims, types * k))
    G = None  # dL/dA^{r+1}
    dbias = 0
    steps = [len(trace) - 1] if mode == "final" else reversed(range(len(trace)))
    for r in steps:
        A, z, s, s_norm, v = trace[r]
        if G is not None:
            dv = _capsules(B, Wm, G)
        ds = squash_backward(xp, s, s_norm, dv)
        dbias = dbias + xp.sum(ds, axis=0)
        dWm += _outer(B, ds, z)
        if G is not None:
            dWm += _outer(B, v, G)
        dz = _directions(B, Wm, ds, types)                                          # (N, T, J, K)
        if A is None:  # c^0 = 1/J: du_pt += sum_j dz_tj / J at every position; b^0 = 0 is a constant
            du += xp.sum(dz, axis=2, keepdims=True) / parents
            continue
        with_db = mode == "full"
        for a in range(0, positions, chunk):
            b = min(a + chunk, positions)
            c = coupling(B, u, A, a, b)                                             # (N, T, p, J)
            du_part = B.matmul(c, dz)                                               # (N, T, p, K)
            if with_db:
                dc = B.matmul(u[:, :, a:b], xp.matrix_transpose(dz))                # (N, T, p, J)
                db = softmax_backward(xp, c, dc, axis=-1)
                du_part = du_part + B.matmul(db, A)
                g = B.matmul(xp.matrix_transpose(db), u[:, :, a:b])                 # (N, T, J, K)
                G = g if G is None else G + g
                del dc, db
            du[:, :, a:b] += du_part
            del c, du_part  # before the next chunk's are made
    dW = xp.permute_dims(xp.reshape(dWm, (parents, dims, types, k)), (2, 0, 1, 3))
    return du, dW, dbias
