"""Ring attention: queries stay put, key/value blocks travel around the `sequence` ring.

At step s device j holds the keys/values of device j - s, merges them into an online
softmax, and passes them on with `ppermute`; after N steps every query has seen every
key and no device ever held more than one remote block. The backward pass is a custom
VJP that runs the ring again, recomputing each block's probabilities from the saved
log-sum-exp, while the key/value gradients travel with their blocks and a final shift
hands them to their owners. Residuals are the local q, k, v, output and log-sum-exp, so
memory stays O(S/N) in forward and backward alike.

Causal masking works on chunks (see `load_balance`): a block whose keys all follow its
queries is skipped with `lax.switch`, a block on the diagonal gets the triangular mask,
every other block is computed unmasked. Within a chunk pair the local block kernel
(`blockwise.attend_tiled`, the one `flash` attention runs) takes [Q_TILE, KEY_TILE] score
blocks and skips those above a diagonal chunk's diagonal.

A sliding window skips the chunk pairs wholly outside it and masks the rest at their
distance in the sequence (the chunks' offset), where the block kernel skips the tiles
outside it. Learned sinks start each local row's softmax; their gradient is summed over
the ring and the batch here, since this VJP is ours.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec

from jdist.models.precision import accumulator
from jdist.parallel import CHECK_VMA, kernel_mesh, manual_axes
from jdist.parallel.attention import blockwise as bw
from jdist.parallel.attention.load_balance import block_kind, chunk_ids
from jdist.spmd.axes import STAGE
from jdist.spmd.rules import mesh_axes_of
from jdist.spmd.varying import varying, vma, zeros


@dataclasses.dataclass(frozen=True)
class Ring:
    axis: tuple[str, ...]     # mesh axes the sequence is split over (the ring)
    n: int                    # devices in the ring
    causal: bool
    balanced: bool            # two chunks per device (j, 2N-1-j) instead of one
    tile: int = bw.KEY_TILE   # keys per score block inside a chunk pair
    window: int | None = None  # sliding window (causal), in tokens
    sinks: bool = False       # learned sinks come after the operands (and segment ids)
    # Mesh axes this kernel splits the rows (batch and sequence) over, where the sinks'
    # gradient is summed (the step's own replica axes excluded: it sums those).
    row_axes: tuple[str, ...] = ()
    # Inside a pipeline stage (its tick's lax.switch): shift with an all-gather, see `shift`.
    nested: bool = False

    @property
    def n_chunks(self) -> int:
        # Without a mask nothing is skipped, so one block per device is enough.
        return 2 if self.balanced and self.causal else 1

    def shift(self, tree):
        """Send to the next device of the ring (device j receives from j - 1).

        Nested, the ring runs inside a pipeline stage's `lax.switch`, so only that stage's
        devices take part. A `collective-permute` has no replica groups: XLA (CPU) meets
        every device of the program at it, matched by channel id, and JAX gives every
        permute the same one, so the stage's ring shift pairs up with whatever permute
        the other stages run at that tick (the pipeline's own) and moves the wrong
        buffers. An all-gather names its group (this stage's ring) and meets only it; it
        moves N-1 blocks instead of one, so it is used only there."""
        if not self.nested:
            moved = lax.ppermute(tree, self.axis, [(i, (i + 1) % self.n) for i in range(self.n)])
        else:
            source = (lax.axis_index(self.axis) - 1) % self.n
            moved = jax.tree.map(lambda x: lax.all_gather(x, self.axis)[source], tree)
        # Unchecked (CHECK_VMA), the collective drops the outer replica axes from the type.
        return jax.tree.map(lambda m, x: varying(m, vma(x)), moved, tree)

    def split(self, x: jax.Array) -> list[jax.Array]:
        return jnp.split(x, self.n_chunks, axis=1)

    def kinds(self, step, chunk_len: int) -> list[list]:
        """kinds[a][b]: what to do with local query chunk a and visiting key chunk b (of
        `chunk_len` tokens each), and how far the queries' positions lie after the keys'."""
        me = lax.axis_index(self.axis)
        q_ids = chunk_ids(me, self.n, self.balanced)
        k_ids = chunk_ids((me - step) % self.n, self.n, self.balanced)
        return [[(block_kind(qc, kc, self.causal, jnp, chunk_len, self.window),
                  (qc - kc) * chunk_len) for kc in k_ids] for qc in q_ids]

    def run(self, compute: Callable, travelling, local):
        """compute(step, travelling, local) -> (travelling, local) for steps 0..N-1,
        shifting `travelling` to the next device between steps (not after the last)."""
        def body(step, carry):
            travelling, local = compute(step, *carry)
            return self.shift(travelling), local
        carry = lax.fori_loop(0, self.n - 1, body, (travelling, local))
        return compute(self.n - 1, *carry)


def _dispatch(ring: Ring, kind_offset, block: Callable, acc, *args):
    """Run `block(acc, *args, offset)` as the chunk pair's kind says: skip it, compute it
    unmasked (offset None), or under the causal mask (and window) of queries `offset`
    positions after the keys."""
    if not ring.causal:
        return block(acc, *args, None)
    kind, offset = kind_offset
    return lax.switch(kind, (lambda acc, *_: acc,
                             lambda acc, *a: block(acc, *a, None),
                             lambda acc, *a: block(acc, *a, offset)), acc, *args)


def _segment_chunks(ring: Ring, seg: tuple) -> list:
    """Packed documents' segment ids [b, L] (`seg` = () without packing) per chunk."""
    return ring.split(seg[0]) if seg else [None] * ring.n_chunks


def _pair(q_seg, k_seg):
    return None if q_seg is None else (q_seg, k_seg)


def _forward(ring: Ring, q, k, v, *seg_sinks):
    """Local blocks q [b, L, h, d], k/v [b, L, kv, d] (and, packed, their segment ids
    [b, L], which travel with k/v; then the local heads' sinks [h], if any) -> (out
    [b, L, h, d], lse [b, L, h])."""
    seg, sinks = _seg_and_sinks(seg_sinks, ring)
    q_chunks = ring.split(bw.group_heads(q, k.shape[2]))
    q_segs = _segment_chunks(ring, seg)
    chunk_len = q_chunks[0].shape[1]

    def attend(acc, qc, kc, vc, segments, offset):
        return bw.attend_tiled(acc, qc, kc, vc, offset, k_tile=ring.tile, segments=segments,
                               window=ring.window)

    def compute(step, kv, accs):
        kinds = ring.kinds(step, chunk_len)
        accs = list(accs)
        k_segs = _segment_chunks(ring, kv[2:])
        for a, qc in enumerate(q_chunks):
            for b, (kc, vc) in enumerate(zip(ring.split(kv[0]), ring.split(kv[1]))):
                accs[a] = _dispatch(ring, kinds[a][b], attend, accs[a], qc, kc, vc,
                                    _pair(q_segs[a], k_segs[b]))
        return kv, tuple(accs)

    _, accs = ring.run(compute, (k, v, *seg), tuple(bw.empty(qc, sinks) for qc in q_chunks))
    outs, lses = zip(*(bw.finish(acc) for acc in accs))
    out = bw.ungroup_heads(jnp.concatenate(outs, axis=1)).astype(q.dtype)
    lse = jnp.concatenate(lses, axis=-1)  # [b, kv, g, L]
    return out, _lse_to_heads(lse)


def _backward(ring: Ring, q, k, v, out, lse, dout, *seg_sinks):
    """Local gradients (dq, dk, dv, and the sinks' summed over the ring and the batch);
    dk/dv travel with their k/v blocks and end at home."""
    seg, sinks = _seg_and_sinks(seg_sinks, ring)
    n_kv = k.shape[2]
    q_chunks = ring.split(bw.group_heads(q, n_kv))
    q_segs = _segment_chunks(ring, seg)
    chunk_len = q_chunks[0].shape[1]
    dout_g = bw.group_heads(dout, n_kv)
    do_chunks = ring.split(dout_g)
    lse_g = _lse_from_heads(lse, n_kv)
    delta = bw.row_delta(bw.group_heads(out, n_kv), dout_g)
    lse_chunks = jnp.split(lse_g, ring.n_chunks, axis=-1)
    delta_chunks = jnp.split(delta, ring.n_chunks, axis=-1)

    def block(acc, qc, kc, vc, doc, lsec, deltac, segments, offset):
        dq, dk, dv = bw.grads_tiled(qc, kc, vc, doc, lsec, deltac, offset, k_tile=ring.tile,
                                     segments=segments, window=ring.window)
        return acc[0] + dq, acc[1] + dk, acc[2] + dv

    def compute(step, travelling, dqs):
        kc_all, vc_all, dk_all, dv_all, *k_seg = travelling
        ks, vs = ring.split(kc_all), ring.split(vc_all)
        k_segs = _segment_chunks(ring, k_seg)
        dks, dvs, dqs = ring.split(dk_all), ring.split(dv_all), list(dqs)
        kinds = ring.kinds(step, chunk_len)
        for a in range(ring.n_chunks):
            for b in range(ring.n_chunks):
                dqs[a], dks[b], dvs[b] = _dispatch(
                    ring, kinds[a][b], block, (dqs[a], dks[b], dvs[b]), q_chunks[a], ks[b],
                    vs[b], do_chunks[a], lse_chunks[a], delta_chunks[a],
                    _pair(q_segs[a], k_segs[b]))
        travelling = (kc_all, vc_all, jnp.concatenate(dks, 1), jnp.concatenate(dvs, 1),
                      *k_seg)
        return travelling, tuple(dqs)

    acc = accumulator(q, k, v)  # gradients travel in float32 (or wider): sums of N parts
    zeros_kv = zeros(k.shape, acc, k)
    dq_init = tuple(zeros(qc.shape, acc, qc) for qc in q_chunks)
    (_, _, dk, dv, *_), dqs = ring.run(compute, (k, v, zeros_kv, zeros_kv, *seg), dq_init)
    dk, dv = ring.shift((dk, dv))  # after N steps each gradient sits one device short of home
    dq = bw.ungroup_heads(jnp.concatenate(dqs, axis=1))
    grads = (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype))
    if sinks is None:
        return grads
    dsinks = bw.sink_grads(sinks, lse_g, delta)  # this device's rows; every row shares them
    over = tuple(a for a in ring.row_axes if a in vma(dsinks))
    return (*grads, (lax.psum(dsinks, over) if over else dsinks).astype(sinks.dtype))


def _seg_and_sinks(seg_sinks: tuple, ring: Ring) -> tuple[tuple, jax.Array | None]:
    """The kernels' trailing operands: (segment ids,) or (), then the sinks if `ring.sinks`."""
    if ring.sinks:
        return seg_sinks[:-1], seg_sinks[-1]
    return seg_sinks, None


def _lse_to_heads(lse: jax.Array) -> jax.Array:
    """[b, kv, g, L] -> [b, L, h], laid out like the queries so it shards like them."""
    b, kv, g, s = lse.shape
    return jnp.transpose(lse, (0, 3, 1, 2)).reshape(b, s, kv * g)


def _lse_from_heads(lse: jax.Array, n_kv: int) -> jax.Array:
    b, s, h = lse.shape
    return jnp.transpose(lse.reshape(b, s, n_kv, h // n_kv), (0, 2, 3, 1))


def ring_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, mesh, q_spec: PartitionSpec,
                   kv_spec: PartitionSpec, ring: Ring, segment_ids: jax.Array | None = None,
                   sinks: jax.Array | None = None) -> jax.Array:
    """Attention of global q [b, S, h, d] against k, v [b, S, kv, d], sequence-sharded over
    `ring.axis` as `q_spec`/`kv_spec` say (heads may be sharded too: blocks are per head).
    `segment_ids` [b, S]: packed documents (in the same token order), attended apart.
    `sinks` [h]: learned sinks, split as the heads are."""
    lse_spec = PartitionSpec(*q_spec[:3])
    seg = () if segment_ids is None else (segment_ids,)
    seg_specs = (PartitionSpec(*q_spec[:2]),) * len(seg)
    sink = () if sinks is None else (sinks,)
    sink_specs = (PartitionSpec(q_spec[2]),) * len(sink)
    where = kernel_mesh(mesh)
    outer = manual_axes()
    rows = tuple(a for a in mesh_axes_of(q_spec[0]) + mesh_axes_of(q_spec[1]) if a not in outer)
    ring = dataclasses.replace(ring, sinks=bool(sink), row_axes=rows)
    if STAGE in outer:  # inside a pipeline stage's branch: see `Ring.shift`
        ring = dataclasses.replace(ring, nested=True)
    smap = partial(jax.shard_map, **where, check_vma=CHECK_VMA)
    fwd = smap(partial(_forward, ring),
               in_specs=(q_spec, kv_spec, kv_spec, *seg_specs, *sink_specs),
               out_specs=(q_spec, lse_spec))
    bwd = smap(partial(_backward, ring),
               in_specs=(q_spec, kv_spec, kv_spec, q_spec, lse_spec, q_spec, *seg_specs,
                         *sink_specs),
               out_specs=(q_spec, kv_spec, kv_spec, *sink_specs))

    @jax.custom_vjp
    def attention(q, k, v, seg, sink):
        return fwd(q, k, v, *seg, *sink)[0]

    def attention_fwd(q, k, v, seg, sink):
        out, lse = fwd(q, k, v, *seg, *sink)
        return out, (q, k, v, out, lse, seg, sink)

    def attention_bwd(residuals, dout):
        *res, seg, sink = residuals
        dq, dk, dv, *dsink = bwd(*res, dout, *seg, *sink)
        return dq, dk, dv, jax.tree.map(lambda _: None, seg), tuple(dsink)

    attention.defvjp(attention_fwd, attention_bwd)
    return attention(q, k, v, seg, sink)
