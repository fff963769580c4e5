"""The chunked gated delta rule (Gated DeltaNet) in Pallas (Mosaic TPU), forward and backward.

The same function as `gattn.model.gdn.chunk_gated_delta_rule` (its reference, with the math): per
value head a float32 state S [K, V] is carried over chunks of C tokens, and inside a chunk the C
delta-rule steps are matmuls (the WY / UT transform). Here a chunk is one kernel step:

    grid (batch, chunk, key head): the chunk axis walks the sequence in order with every head's
    state in VMEM scratch (float32 whatever the inputs' dtype); a step reads the key head's q, k
    once and runs its H/G value heads (Qwen3.5's ratio) in a static loop.

T = (I + A)^-1 of the chunk's strictly lower system is computed by block elimination in log2(C)
doublings, T_2b = T_b - T_b L_b T_b (L_b: A's entries below the diagonal b-blocks of each
2b-block), i.e. 2 log2(C) full C x C matmuls and no sequential row loop.

Backward (`custom_vjp`): the forward saves the state at the start of every chunk ([B, N, H, K, V]
float32, the only residual besides the inputs), or with `save_states=False` keeps only the inputs
and the backward first recomputes those states (kernel `gdn_states`: the forward without the
outputs); the backward kernel walks the chunks in reverse, carrying dS in VMEM, recomputes the
chunk's T, U, W from the chunk's state and writes dq, dk, dv, dg, dbeta per chunk and d(initial
state) at the end.

Layout. q, k [B, S, G*K] and v, o [B, S, H*V] as the projections produce them (a block is a
chunk of one key head's lanes, K and V padded to a multiple of 128, in interpret mode too, so
the tests run the layout Mosaic compiles); g and beta [B, S, H] with a
step reading all H lanes of its chunk and picking its heads' columns, so no [.., S, 1] or
[.., 1, S] array is needed (C = 64 is no multiple of 128). Document resets travel inside g as
-inf: a reset is exactly a decay of exp(-inf) = 0 of the state before the token, and the kernel
drops such g from the within-chunk cumsum as the reference does (no inf - inf). That cumsum is a
masked [C, C] row sum: Mosaic has no lowering for `cumsum` ("Unimplemented primitive in Pallas
TPU lowering for tc: cumsum", jax 0.10.2).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import PartitionSpec as P

import gattn.kernels.flash_blocks as fb
from gattn.config import BATCH_AXES
from gattn.config.checks import GDN_IMPLS

F32 = jnp.float32
IMPLS = GDN_IMPLS  # exec.gdn_impl
LANES = 128  # K and V are padded to a multiple: a block's last dimension on TPU


@dataclasses.dataclass(frozen=True)
class Static:
    """What a trace of the kernels needs to know."""
    chunk: int      # C
    chunks: int     # N (padded length / C)
    ratio: int      # value heads per key head (H / G)
    heads: int      # H
    dk: int         # K (padded to 128 when compiled)
    dv: int         # V (likewise)
    scale: float    # K ** -0.5 of the unpadded K
    interpret: bool
    save_states: bool  # the forward saves every chunk's state for the backward (else recomputed)


# ---------------------------------------------------------------- chunk math (values, not refs)

def _mm(a, b, ta=False, tb=False):
    """a @ b (a^T, b^T as asked) in float32 at full precision."""
    dims = (((0 if ta else 1,), (1 if tb else 0,)), ((), ()))
    return jax.lax.dot_general(a, b, dims, precision=jax.lax.Precision.HIGHEST, preferred_element_type=F32)


def _iota(c):
    return jax.lax.broadcasted_iota(jnp.int32, (c, c), 0), jax.lax.broadcasted_iota(jnp.int32, (c, c), 1)


def _lane(x_CxH, h):
    """Column h (traced) of a [C, H] block: (C, 1)."""
    lanes = jax.lax.broadcasted_iota(jnp.int32, x_CxH.shape, 1)
    return jnp.sum(jnp.where(lanes == h, x_CxH, 0.0), axis=1, keepdims=True)


def _set_lane(ref, h, col_Cx1):
    lanes = jax.lax.broadcasted_iota(jnp.int32, ref.shape, 1)
    ref[...] = jnp.where(lanes == h, col_Cx1, ref[...]).astype(ref.dtype)


def _unit_lower_inverse(a_CxC):
    """(I + A)^-1 for strictly lower A by block elimination: with T_b the inverse of I + A's
    diagonal b-blocks, the 2b-blocks' is T_b - T_b L_b T_b, L_b the entries of A in the lower
    off-diagonal b-block of each 2b-block."""
    c = a_CxC.shape[0]
    i, j = _iota(c)
    t = (i == j).astype(F32)
    b = 1
    while b < c:
        below = (i // (2 * b) == j // (2 * b)) & (i // b != j // b) & (i > j)
        t = t - _mm(_mm(t, jnp.where(below, a_CxC, 0.0)), t)
        b *= 2
    return t


@dataclasses.dataclass(frozen=True)
class _Chunk:
    """One value head's chunk-local quantities (reference: chunk_gated_delta_rule)."""
    reset: jax.Array      # (C, 1) bool: a document starts here
    beta: jax.Array       # (C, 1)
    cum: jax.Array        # (C, 1) within-chunk cumsum of g, resets dropped
    cum_last: jax.Array   # (1, 1)
    gamma: jax.Array      # (C, C) exp(cum_i - cum_j), same document, j <= i
    start: jax.Array      # (C, 1) bool: the token still sees the carried state
    end: jax.Array        # (C, 1) bool: the chunk's state keeps the token
    carry: jax.Array      # (1, 1) the carried state's decay over the chunk
    p: jax.Array          # (C, C) diag(beta) K K^T
    t: jax.Array          # (C, C) (I + strictly_lower(P * Gamma))^-1


def _chunk(g_CxH, beta_CxH, h, kk_CxC) -> _Chunk:
    g = _lane(g_CxH, h)
    reset = g == -jnp.inf
    gz, run_step = jnp.where(reset, 0.0, g), reset.astype(F32)
    c = g.shape[0]
    i, j = _iota(c)
    upto = j <= i
    cum = jnp.sum(jnp.where(upto, gz.T, 0.0), axis=1, keepdims=True)
    run = jnp.sum(jnp.where(upto, run_step.T, 0.0), axis=1, keepdims=True)
    last = i[:, :1] == c - 1
    cum_last = jnp.sum(jnp.where(last, cum, 0.0), axis=0, keepdims=True)
    run_last = jnp.sum(run_step, axis=0, keepdims=True)
    same = (run == run.T) & upto
    gamma = jnp.where(same, jnp.exp(jnp.where(same, cum - cum.T, 0.0)), 0.0)
    beta = _lane(beta_CxH, h)
    p = beta * kk_CxC
    t = _unit_lower_inverse(jnp.where(i > j, p * gamma, 0.0))
    carry = jnp.where(run_last == 0, jnp.exp(cum_last), 0.0)
    return _Chunk(reset, beta, cum, cum_last, gamma, run == 0, run == run_last, carry, p, t)


def _chunk_terms(ch: _Chunk, q, k, v, s):
    """The forward's products: (x1, x2, wk, qi, ko, v_new), as the backward needs them too."""
    x1 = v * ch.beta
    x2 = jnp.where(ch.start, k * ch.beta * jnp.exp(ch.cum), 0.0)
    wk = _mm(ch.t, x2)
    qi = jnp.where(ch.start, q * jnp.exp(ch.cum), 0.0)
    ko = jnp.where(ch.end, k * jnp.exp(ch.cum_last - ch.cum), 0.0)
    v_new = _mm(ch.t, x1) - _mm(wk, s)
    return x1, x2, wk, qi, ko, v_new


# ---------------------------------------------------------------- forward

def _fwd_kernel(st: Static, outputs: tuple[str, ...], q_ref, k_ref, v_ref, g_ref, b_ref, s0_ref, *refs):
    """`outputs`: what the call writes besides the final state: "o" (the outputs) and / or
    "states" (the state at the start of every chunk, the backward's residual)."""
    refs = list(refs)
    o_ref = refs.pop(0) if "o" in outputs else None
    states_ref = refs.pop(0) if "states" in outputs else None
    sf_ref, s_sc = refs
    n, j = pl.program_id(1), pl.program_id(2)
    own = pl.ds(j * st.ratio, st.ratio)

    @pl.when(n == 0)
    def _init():
        s_sc[own] = s0_ref[own].astype(F32)

    q = q_ref[...].astype(F32) * st.scale
    k = k_ref[...].astype(F32)
    kk = _mm(k, k, tb=True)
    qk = _mm(q, k, tb=True) if o_ref is not None else None
    g, beta = g_ref[...], b_ref[...]
    for r in range(st.ratio):
        h = j * st.ratio + r
        ch = _chunk(g, beta, h, kk)
        s = s_sc[h]
        if states_ref is not None:
            states_ref[r] = s
        lanes = slice(r * st.dv, (r + 1) * st.dv)
        _, _, _, qi, ko, v_new = _chunk_terms(ch, q, k, v_ref[:, lanes].astype(F32), s)
        if o_ref is not None:
            o = _mm(qi, s) + _mm(qk * ch.gamma, v_new)
            o_ref[:, lanes] = o.astype(o_ref.dtype)
        s_sc[h] = ch.carry * s + _mm(ko, v_new, ta=True)

    @pl.when(n == st.chunks - 1)
    def _final():
        sf_ref[own] = s_sc[own]


def _specs(st: Static, chunk_of):
    """BlockSpecs on grid (b, n, j); `chunk_of(n)` is the chunk a step reads (reversed in the
    backward)."""
    def key_head(b, n, j):
        return b, chunk_of(n), j

    def all_heads(b, n, j):
        return b, chunk_of(n), 0

    def state_of_head(b, n, j):
        return b, chunk_of(n), j, 0, 0

    def whole_state(b, n, j):
        return b, 0, 0, 0

    c, r = st.chunk, st.ratio
    return dict(qk=pl.BlockSpec((None, c, st.dk), key_head), v=pl.BlockSpec((None, c, r * st.dv), key_head),
                scalars=pl.BlockSpec((None, c, st.heads), all_heads),
                states=pl.BlockSpec((None, None, r, st.dk, st.dv), state_of_head),
                state=pl.BlockSpec((None, st.heads, st.dk, st.dv), whole_state))


def _params():
    return pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary", "arbitrary"),
                                vmem_limit_bytes=fb.VMEM_LIMIT)


def _cost(st: Static, b: int, passes: int, nbytes: int) -> pl.CostEstimate:
    """Per chunk and value head: ~14 C x C x (K or V) products and 2 log2(C) C^3 ones."""
    c, h = st.chunk, st.heads
    per = 2 * c * c * (7 * max(st.dk, st.dv)) + 4 * (c.bit_length() - 1) * c ** 3 + 6 * c * st.dk * st.dv
    return pl.CostEstimate(flops=passes * b * st.chunks * h * per,
                           transcendentals=passes * b * st.chunks * h * c * (c + 3), bytes_accessed=nbytes)


def _forward(st: Static, q, k, v, g, beta, s0, outputs: tuple[str, ...]):
    """{name: array} for `outputs` ("o", "states", as `_fwd_kernel`) and "final"."""
    b = q.shape[0]
    sp = _specs(st, lambda n: n)
    specs = {"o": sp["v"], "states": sp["states"], "final": sp["state"]}
    shapes = {"o": fb.sds(v.shape, v.dtype, v), "states": fb.sds((b, st.chunks, st.heads, st.dk, st.dv), F32, v),
              "final": fb.sds(s0.shape, F32, s0)}
    names = [name for name in ("o", "states") if name in outputs] + ["final"]
    nbytes = (sum(x.size * x.dtype.itemsize for x in (q, k, v, g, beta, s0))
              + sum(shapes[name].size * shapes[name].dtype.itemsize for name in names))
    out = pl.pallas_call(
        functools.partial(_fwd_kernel, st, tuple(names[:-1])),
        grid=(b, st.chunks, st.heads // st.ratio),
        in_specs=[sp["qk"], sp["qk"], sp["v"], sp["scalars"], sp["scalars"], sp["state"]],
        out_specs=[specs[name] for name in names], out_shape=[shapes[name] for name in names],
        scratch_shapes=[pltpu.VMEM((st.heads, st.dk, st.dv), F32)],
        compiler_params=_params(), cost_estimate=_cost(st, b, 1, nbytes),
        interpret=st.interpret, name="gdn_fwd" if "o" in outputs else "gdn_states",
    )(q, k, v, g, beta, s0)
    return dict(zip(names, out))


# ---------------------------------------------------------------- backward

def _bwd_kernel(st: Static, q_ref, k_ref, v_ref, g_ref, b_ref, states_ref, do_ref, dsf_ref,
                dq_ref, dk_ref, dv_ref, dg_ref, db_ref, ds0_ref, ds_sc):
    n, j = pl.program_id(1), pl.program_id(2)
    own = pl.ds(j * st.ratio, st.ratio)

    @pl.when(n == 0)  # the last chunk: dS after it is the final state's cotangent
    def _init():
        ds_sc[own] = dsf_ref[own].astype(F32)

    q = q_ref[...].astype(F32) * st.scale
    k = k_ref[...].astype(F32)
    qk, kk = _mm(q, k, tb=True), _mm(k, k, tb=True)
    g, beta = g_ref[...], b_ref[...]
    c = q.shape[0]
    i, jj = _iota(c)
    dq, dk = jnp.zeros_like(q), jnp.zeros_like(k)
    for r in range(st.ratio):
        h = j * st.ratio + r
        ch = _chunk(g, beta, h, kk)
        s, ds_next = states_ref[r], ds_sc[h]
        lanes = slice(r * st.dv, (r + 1) * st.dv)
        v, do = v_ref[:, lanes].astype(F32), do_ref[:, lanes].astype(F32)
        x1, x2, wk, qi, ko, v_new = _chunk_terms(ch, q, k, v, s)
        attn = qk * ch.gamma
        # through O = qi S + attn V',  S' = carry S + ko^T V',  V' = T x1 - (T x2) S
        dv_new = _mm(attn, do, ta=True) + _mm(ko, ds_next)
        dattn = _mm(do, v_new, tb=True)
        dqi = _mm(do, s, tb=True)
        dko = _mm(v_new, ds_next, tb=True)
        ds_sc[h] = _mm(qi, do, ta=True) + ch.carry * ds_next - _mm(wk, dv_new, ta=True)
        dwk = -_mm(dv_new, s, tb=True)
        dx1, dx2 = _mm(ch.t, dv_new, ta=True), _mm(ch.t, dwk, ta=True)
        dt = _mm(dv_new, x1, tb=True) + _mm(dwk, x2, tb=True)
        da = jnp.where(i > jj, -_mm(_mm(ch.t, dt, ta=True), ch.t, tb=True), 0.0)
        # A = strictly_lower(P * Gamma), P = beta K K^T; attn = (Q K^T) * Gamma
        dp = da * ch.gamma
        dgamma = da * ch.p + dattn * qk
        dqk = dattn * ch.gamma
        dkk = ch.beta * dp
        dbeta = jnp.sum(dp * kk, axis=1, keepdims=True)
        dq = dq + _mm(dqk, k) + jnp.where(ch.start, dqi * jnp.exp(ch.cum), 0.0)
        dk = (dk + _mm(dkk, k) + _mm(dkk, k, ta=True) + _mm(dqk, q, ta=True)
              + jnp.where(ch.start, dx2 * ch.beta * jnp.exp(ch.cum), 0.0)
              + jnp.where(ch.end, dko * jnp.exp(ch.cum_last - ch.cum), 0.0))
        dbeta = (dbeta + jnp.sum(dx1 * v, axis=1, keepdims=True)
                 + jnp.sum(jnp.where(ch.start, dx2 * k * jnp.exp(ch.cum), 0.0), axis=1, keepdims=True))
        dv_ref[:, lanes] = (dx1 * ch.beta).astype(dv_ref.dtype)
        # cum enters through qi, x2 (+), ko (-, and cum_last +), carry (cum_last) and Gamma
        ko_w = jnp.sum(dko * ko, axis=1, keepdims=True)
        dcarry = jnp.sum(jnp.sum(s * ds_next, axis=1, keepdims=True), axis=0, keepdims=True)
        m = dgamma * ch.gamma
        dcum = (jnp.sum(dqi * qi, axis=1, keepdims=True) + jnp.sum(dx2 * x2, axis=1, keepdims=True) - ko_w
                + jnp.sum(m, axis=1, keepdims=True) - jnp.sum(m, axis=0, keepdims=True).T)
        dcum_last = jnp.sum(ko_w, axis=0, keepdims=True) + dcarry * ch.carry
        dcum = dcum + jnp.where(i[:, :1] == c - 1, dcum_last, 0.0)
        # cum_i = sum_{j <= i} g_j: dg_j = sum_{i >= j} dcum_i
        dg = jnp.sum(jnp.where(jj >= i, dcum.T, 0.0), axis=1, keepdims=True)
        _set_lane(dg_ref, h, jnp.where(ch.reset, 0.0, dg))
        _set_lane(db_ref, h, dbeta)
    dq_ref[...] = (dq * st.scale).astype(dq_ref.dtype)
    dk_ref[...] = dk.astype(dk_ref.dtype)

    @pl.when(n == st.chunks - 1)  # the first chunk: dS before it is the initial state's
    def _final():
        ds0_ref[own] = ds_sc[own]


def _backward(st: Static, q, k, v, g, beta, states, do, dsf):
    b = q.shape[0]
    sp = _specs(st, lambda n: st.chunks - 1 - n)
    nbytes = 2 * sum(x.size * x.dtype.itemsize for x in (q, k, v, g, beta)) + states.size * 4 + do.size * 2
    return pl.pallas_call(
        functools.partial(_bwd_kernel, st),
        grid=(b, st.chunks, st.heads // st.ratio),
        in_specs=[sp["qk"], sp["qk"], sp["v"], sp["scalars"], sp["scalars"], sp["states"], sp["v"], sp["state"]],
        out_specs=[sp["qk"], sp["qk"], sp["v"], sp["scalars"], sp["scalars"], sp["state"]],
        out_shape=[fb.sds(q.shape, q.dtype, q), fb.sds(k.shape, k.dtype, k), fb.sds(v.shape, v.dtype, v),
                   fb.sds(g.shape, F32, g), fb.sds(beta.shape, F32, beta), fb.sds(dsf.shape, F32, dsf)],
        scratch_shapes=[pltpu.VMEM((st.heads, st.dk, st.dv), F32)],
        compiler_params=_params(), cost_estimate=_cost(st, b, 3, nbytes),
        interpret=st.interpret, name="gdn_bwd",
    )(q, k, v, g, beta, states, do, dsf)


# ---------------------------------------------------------------- custom_vjp core

@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _gdn(st, q, k, v, g, beta, s0):
    out = _forward(st, q, k, v, g, beta, s0, ("o",))
    return out["o"], out["final"]


def _gdn_fwd(st, q, k, v, g, beta, s0):
    """Residuals: the inputs and, with `st.save_states`, the state at every chunk start
    ([B, N, H, K, V] float32); without, the initial state, and the backward recomputes them."""
    out = _forward(st, q, k, v, g, beta, s0, ("o", "states") if st.save_states else ("o",))
    return (out["o"], out["final"]), (q, k, v, g, beta, out["states"] if st.save_states else s0)


def _gdn_bwd(st, res, cotangents):
    q, k, v, g, beta, saved = res
    states = saved if st.save_states else _forward(st, q, k, v, g, beta, saved, ("states",))["states"]
    do, dsf = cotangents
    return _backward(st, q, k, v, g, beta, states, do, dsf)


_gdn.defvjp(_gdn_fwd, _gdn_bwd)


# ---------------------------------------------------------------- public entry points

def resolve(impl: str) -> str:
    """`exec.gdn_impl` on this trace's platform (`fb.on_tpu`): auto -> pallas on TPU, else xla."""
    if impl not in IMPLS:
        raise ValueError(f"gdn impl {impl!r} is not available; implemented: {', '.join(IMPLS)}")
    if impl == "auto":
        return "pallas" if fb.on_tpu() else "xla"
    return impl


def _pad_to(x, axis, n):
    return x if x.shape[axis] == n else jnp.pad(x, [(0, n - x.shape[axis]) if a == axis else (0, 0)
                                                  for a in range(x.ndim)])


def gated_delta_rule(q_BxSxGxK, k_BxSxGxK, v_BxSxHxV, g_BxSxH, beta_BxSxH, resets_BxS=None,
                     state_BxHxKxV=None, *, chunk_size: int = 64, interpret: bool | None = None,
                     save_states: bool = True):
    """`gattn.model.gdn.chunk_gated_delta_rule` as Pallas kernels: the same arguments (q, k as the
    layer gives them, unscaled; key head j serves value heads j*H/G .. (j+1)*H/G - 1; `resets`
    True zeroes the state before that token; the state defaults to zeros) and results (o
    [B, S, H, V] in v's dtype, the final state [B, H, K, V] float32). The state is float32 in the
    kernels whatever the inputs' dtype. `interpret` defaults to True off TPU (the same blocks:
    K and V are padded to a multiple of 128 either way). Differentiable in q, k, v, g, beta and
    the state; `save_states` keeps every chunk's starting state from the forward for the backward
    ([B, S/C, H, K, V] float32), False recomputes them there (one more pass over the chunks, no
    residual but the inputs: docs/kernel.md has the memory of both)."""
    b, s, groups, dk = q_BxSxGxK.shape
    heads, dv = v_BxSxHxV.shape[2:]
    if k_BxSxGxK.shape != q_BxSxGxK.shape or v_BxSxHxV.shape[:2] != (b, s) or heads % groups:
        raise ValueError(f"gated_delta_rule: q {q_BxSxGxK.shape} and k {k_BxSxGxK.shape} must be [B, S, G, K] "
                         f"alike and v {v_BxSxHxV.shape} [B, S, H, V] with H a multiple of G")
    for name, x in (("g", g_BxSxH), ("beta", beta_BxSxH)):
        if x.shape != (b, s, heads):
            raise ValueError(f"gated_delta_rule: {name} {x.shape} must be [B, S, H] = {(b, s, heads)}")
    if not isinstance(chunk_size, int) or chunk_size < 8 or chunk_size % 8:
        raise ValueError(f"gated_delta_rule: chunk_size = {chunk_size!r} must be a multiple of 8")
    interpret = not fb.on_tpu() if interpret is None else bool(interpret)
    kp, vp = fb.round_up(dk, LANES), fb.round_up(dv, LANES)
    c = chunk_size
    sp = fb.round_up(s, c)
    g = g_BxSxH.astype(F32)
    if resets_BxS is not None:
        g = jnp.where(resets_BxS.astype(bool)[..., None], -jnp.inf, g)
    state = (jnp.zeros((b, heads, dk, dv), F32) if state_BxHxKxV is None else state_BxHxKxV.astype(F32))
    state = _pad_to(_pad_to(state, 2, kp), 3, vp)

    def lanes(x, d):  # [B, S, X, D] -> [B, Sp, X * Dp]
        x = _pad_to(_pad_to(x, 3, d), 1, sp)
        return x.reshape(b, sp, -1)

    st = Static(chunk=c, chunks=sp // c, ratio=heads // groups, heads=heads, dk=kp, dv=vp,
                scale=float(dk ** -0.5), interpret=interpret, save_states=bool(save_states))
    o, final = _gdn(st, lanes(q_BxSxGxK, kp), lanes(k_BxSxGxK, kp), lanes(v_BxSxHxV, vp), _pad_to(g, 1, sp),
                    _pad_to(beta_BxSxH.astype(F32), 1, sp), state)
    return o.reshape(b, sp, heads, vp)[:, :s, :, :dv], final[:, :, :dk, :dv]


def gated_delta_rule_on_mesh(q, k, v, g, beta, resets=None, state=None, *, chunk_size: int = 64,
                             interpret: bool | None = None, save_states: bool = True, head_axis: str = "model"):
    """`gated_delta_rule` under the mesh set with `jax.set_mesh`: a Pallas call is not partitioned
    automatically, so on a mesh of more than one device it runs in shard_map, rows split over the
    batch axes and heads over `head_axis` when that divides the key heads (a contiguous block of
    key heads carries exactly its value heads); the sequence stays whole."""
    mesh = jax.sharding.get_abstract_mesh()
    rule = functools.partial(gated_delta_rule, chunk_size=chunk_size, interpret=interpret, save_states=save_states)
    if mesh.empty or mesh.size == 1:
        return rule(q, k, v, g, beta, resets, state)
    b, s, groups, dk = q.shape
    heads, dv = v.shape[2:]
    if resets is not None:  # (a reset is a decay of exp(-inf): one array fewer to shard)
        g = jnp.where(resets.astype(bool)[..., None], -jnp.inf, g.astype(F32))
    state = jnp.zeros((b, heads, dk, dv), F32) if state is None else state
    manual = set(getattr(mesh, "manual_axes", ()))
    batch = tuple(a for a in BATCH_AXES if a in mesh.axis_names and a not in manual) or None
    split = (head_axis if head_axis in mesh.axis_names and head_axis not in manual
             and groups % mesh.shape[head_axis] == 0 else None)
    tile, rows, states = P(batch, None, split, None), P(batch, None, split), P(batch, split, None, None)

    def body(q, k, v, g, beta, state):
        return rule(q, k, v, g, beta, None, state)

    return jax.shard_map(body, mesh=mesh, in_specs=(tile, tile, tile, rows, rows, states),
                         out_specs=(tile, states), check_vma=False)(q, k, v, g, beta, state)
