"""Lane-level emulation of ../src/cuda/flash_attention.cu on the CPU.

Each warp instruction the kernels use is emulated per lane with the register layouts of the PTX
ISA (ldmatrix .x4 with and without .trans, mma.m16n8k16 bf16 -> f32, bf16 packing, cp.async as a
plain copy); the kernels' index expressions are transcribed as written, and their outputs are
compared with a float64 attention and its gradients. An error in a fragment index gives errors
near 1; a correct one gives bf16 rounding (about 2e-3). The GPU check is
examples/attention_check.rs; this one needs no GPU:

    python3 flash_emulation.py HEAD_DIM[:STAGES[:QUERY_TILES]] batch,heads,len_q,len_k,strided_v ...
    python3 flash_emulation.py 128 1,2,128,128,0 2,1,200,200,1 1,1,1,70,0
    python3 flash_emulation.py 64:1:1 1,2,100,300,0 1,1,130,65,1

Needs numpy.
"""
import numpy as np, sys
D, STAGES, QT = (int(x) for x in (sys.argv[1] + ":2:2").split(":")[:3])
TILE, WARPS = 64, 4; THREADS = 128; ROWS = WARPS * 16 * QT
LD = D + 8; TILE_ELEMS = TILE * LD; LDS = TILE + 8
DSTEPS, DCOLS, TSTEPS, TCOLS = D // 16, D // 8, TILE // 16, TILE // 8
lane = np.arange(32); g = lane // 4; t = lane % 4

def bf(x):
    x = np.asarray(x, dtype=np.float32)
    b = x.view(np.uint32).astype(np.uint64)
    b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
    return b.astype(np.uint32).view(np.float32)

def ldmatrix(sm, addr):  # addr: per-lane element offsets [32]
    r = np.zeros((4, 32, 2), np.float32)
    for m in range(4):
        rows = addr[m * 8 + g]
        r[m, :, 0] = sm[rows + 2 * t]; r[m, :, 1] = sm[rows + 2 * t + 1]
    return r

def ldmatrix_t(sm, addr):
    r = np.zeros((4, 32, 2), np.float32)
    for m in range(4):
        r[m, :, 0] = sm[addr[m * 8 + 2 * t] + g]; r[m, :, 1] = sm[addr[m * 8 + 2 * t + 1] + g]
    return r

def mma(c, a, b0, b1):  # c [32,4], a [4,32,2], b0/b1 [32,2]
    A = np.zeros((16, 16)); B = np.zeros((16, 8))
    for L in range(32):
        gg, tt = L // 4, L % 4
        A[gg, 2*tt:2*tt+2] = a[0, L]; A[gg+8, 2*tt:2*tt+2] = a[1, L]
        A[gg, 2*tt+8:2*tt+10] = a[2, L]; A[gg+8, 2*tt+8:2*tt+10] = a[3, L]
        B[2*tt:2*tt+2, gg] = b0[L]; B[2*tt+8:2*tt+10, gg] = b1[L]
    C = A @ B
    for L in range(32):
        gg, tt = L // 4, L % 4
        c[L, 0:2] += C[gg, 2*tt:2*tt+2]; c[L, 2:4] += C[gg+8, 2*tt:2*tt+2]

def pack(lo, hi): return np.stack([bf(lo), bf(hi)], -1)

def left_from(acc, s):  # acc [TCOLS,32,4]
    return np.stack([pack(acc[2*s][:, 0], acc[2*s][:, 1]), pack(acc[2*s][:, 2], acc[2*s][:, 3]),
                     pack(acc[2*s+1][:, 0], acc[2*s+1][:, 1]), pack(acc[2*s+1][:, 2], acc[2*s+1][:, 3])])

def load_tile(sm, dst, src, stride, valid, R=TILE):  # src: flat global array + offset
    arr, off = src
    CH = D // 8
    for i in range(R * CH):
        r, c = i // CH, (i % CH) * 8
        sm[dst + r * LD + c: dst + r * LD + c + 8] = arr[off + r * stride + c: off + r * stride + c + 8] if r < valid else 0

def load_row_values(fm, dst, src, valid):
    arr, off = src
    for i in range(TILE):
        fm[dst + i] = arr[off + i] if i < valid else 0

def products_t(sm, a, b):
    acc = np.zeros((TCOLS, 32, 4), np.float32)
    for s in range(DSTEPS):
        fa = ldmatrix(sm, a + (lane % 8 + (lane // 8 % 2) * 8) * LD + s * 16 + (lane // 16) * 8)
        for n in range(0, TCOLS, 2):
            fb = ldmatrix(sm, b + (n * 8 + lane % 8 + (lane // 16) * 8) * LD + s * 16 + (lane // 8 % 2) * 8)
            mma(acc[n], fa, fb[0], fb[1]); mma(acc[n + 1], fa, fb[2], fb[3])
    return acc

def accumulate(sm, acc, p, b):
    for s in range(TSTEPS):
        fa = left_from(p, s)
        for n in range(0, DCOLS, 2):
            fb = ldmatrix_t(sm, b + (s * 16 + lane % 8 + (lane // 8 % 2) * 8) * LD + n * 8 + (lane // 16) * 8)
            mma(acc[n], fa, fb[0], fb[1]); mma(acc[n + 1], fa, fb[2], fb[3])

def store_rows(out, base, acc, factor, valid):
    for r in range(2):
        for L in range(32):
            row = L // 4 + 8 * r
            if row >= valid: continue
            for n in range(DCOLS):
                v = pack(acc[n][L, 2*r] * factor[r], acc[n][L, 2*r+1] * factor[r])
                out[base + row * D + n * 8 + 2 * (L % 4): base + row * D + n * 8 + 2 * (L % 4) + 2] = v

def forward(q, k, v, heads, len_q, len_k, qs, ks, vs, scale_log2, out, lse, bh, bx):
    sm = np.zeros(ROWS * LD + 4 * TILE_ELEMS, np.float32)
    sq = 0; sk = ROWS * LD; sv = sk + 2 * TILE_ELEMS
    b, h = bh // heads, bh % heads; q0 = bx * ROWS
    kp = b * ks[0] + h * ks[1]; vp = b * vs[0] + h * vs[1]
    load_tile(sm, sq, (q, b*qs[0] + h*qs[1] + q0*qs[2]), qs[2], min(ROWS, len_q - q0), ROWS)
    load_tile(sm, sk, (k, kp), ks[2], min(TILE, len_k)); load_tile(sm, sv, (v, vp), vs[2], min(TILE, len_k))
    # W[w][m]: tile m of warp w, rows (w * QT + m) * 16 onwards.
    W = [[dict(o=np.zeros((DCOLS, 32, 4), np.float32), m=np.full((2, 32), -np.inf, np.float32), sum=np.zeros((2, 32), np.float32)) for _ in range(QT)] for _ in range(WARPS)]
    tiles = (len_k + TILE - 1) // TILE
    for j in range(tiles):
        if j + 1 < tiles:
            nxt, buf = (j + 1) * TILE, (j + 1) % 2
            load_tile(sm, sk + buf * TILE_ELEMS, (k, kp + nxt * ks[2]), ks[2], min(TILE, len_k - nxt))
            load_tile(sm, sv + buf * TILE_ELEMS, (v, vp + nxt * vs[2]), vs[2], min(TILE, len_k - nxt))
        kb = sk + (j % 2) * TILE_ELEMS; vb = sv + (j % 2) * TILE_ELEMS
        for w in range(WARPS):
            q_w = sq + w * QT * 16 * LD
            S = [np.zeros((TCOLS, 32, 4), np.float32) for _ in range(QT)]
            for s_ in range(DSTEPS):
                qa = [ldmatrix(sm, q_w + (m * 16 + lane % 8 + (lane // 8 % 2) * 8) * LD + s_ * 16 + (lane // 16) * 8) for m in range(QT)]
                for n in range(0, TCOLS, 2):
                    fb = ldmatrix(sm, kb + (n * 8 + lane % 8 + (lane // 16) * 8) * LD + s_ * 16 + (lane // 8 % 2) * 8)
                    for m in range(QT):
                        mma(S[m][n], qa[m], fb[0], fb[1]); mma(S[m][n + 1], qa[m], fb[2], fb[3])
            valid = len_k - j * TILE
            for m in range(QT):
                Wd = W[w][m]; s = S[m]
                for r in range(2):
                    tm = np.full(32, -np.inf, np.float32)
                    for n in range(TCOLS):
                        for e in range(2):
                            x = np.where(n * 8 + 2 * t + e < valid, s[n][:, 2*r+e] * scale_log2, -np.inf).astype(np.float32)
                            s[n][:, 2*r+e] = x; tm = np.maximum(tm, x)
                    tm = np.maximum(tm, tm[lane ^ 1]); tm = np.maximum(tm, tm[lane ^ 2])
                    nm = np.maximum(Wd['m'][r], tm); factor = np.exp2(Wd['m'][r] - nm); Wd['m'][r] = nm
                    ts = np.zeros(32, np.float32)
                    for n in range(TCOLS):
                        for e in range(2):
                            p = np.exp2(s[n][:, 2*r+e] - nm); s[n][:, 2*r+e] = p; ts += p
                    Wd['sum'][r] = Wd['sum'][r] * factor + ts
                    for n in range(DCOLS):
                        Wd['o'][n][:, 2*r] *= factor; Wd['o'][n][:, 2*r+1] *= factor
            for s_ in range(TSTEPS):
                pa = [left_from(S[m], s_) for m in range(QT)]
                for n in range(0, DCOLS, 2):
                    fb = ldmatrix_t(sm, vb + (s_ * 16 + lane % 8 + (lane // 8 % 2) * 8) * LD + n * 8 + (lane // 16) * 8)
                    for m in range(QT):
                        mma(W[w][m]['o'][n], pa[m], fb[0], fb[1]); mma(W[w][m]['o'][n + 1], pa[m], fb[2], fb[3])
    for w in range(WARPS):
        for m in range(QT):
            Wd = W[w][m]; first = q0 + (w * QT + m) * 16; inv = []
            for r in range(2):
                sm_ = Wd['sum'][r]; sm_ = sm_ + sm_[lane ^ 1]; sm_ = sm_ + sm_[lane ^ 2]
                inv.append(1.0 / sm_)
                for L in range(32):
                    row = first + L // 4 + 8 * r
                    if L % 4 == 0 and row < len_q: lse[bh * len_q + row] = Wd['m'][r][L] + np.log2(sm_[L])
            inv = np.array(inv)  # [2,32]
            for r in range(2):
                for L in range(32):
                    row = L // 4 + 8 * r
                    if row >= len_q - first: continue
                    for n in range(DCOLS):
                        base = (bh * len_q + first) * D
                        out[base + row*D + n*8 + 2*(L%4): base + row*D + n*8 + 2*(L%4) + 2] = pack(Wd['o'][n][L, 2*r] * inv[r][L], Wd['o'][n][L, 2*r+1] * inv[r][L])

def backward(q, k, v, dout, lse, delta, dq, dk, dv, heads, len_q, len_k, qs, ks, vs, ds, scale_log2, scale, bh, bx):
    sm = np.zeros((2 + 2 * STAGES) * TILE_ELEMS + TILE * LDS, np.float32); fm = np.zeros(2 * STAGES * TILE, np.float32)
    sk, sv, sq = 0, TILE_ELEMS, 2 * TILE_ELEMS
    sdo = sq + STAGES * TILE_ELEMS; sds = sdo + STAGES * TILE_ELEMS
    slse, sdelta = 0, STAGES * TILE
    b, h = bh // heads, bh % heads; k0 = bx * TILE; valid_k = min(TILE, len_k - k0)
    qp = b * qs[0] + h * qs[1]; dp = b * ds[0] + h * ds[1]; lse_p = bh * len_q
    load_tile(sm, sk, (k, b*ks[0] + h*ks[1] + k0*ks[2]), ks[2], valid_k)
    load_tile(sm, sv, (v, b*vs[0] + h*vs[1] + k0*vs[2]), vs[2], valid_k)
    def load_queries(j):
        first, buf = j * TILE, j % STAGES; valid = min(TILE, len_q - first)
        load_tile(sm, sq + buf * TILE_ELEMS, (q, qp + first * qs[2]), qs[2], valid)
        load_tile(sm, sdo + buf * TILE_ELEMS, (dout, dp + first * ds[2]), ds[2], valid)
        load_row_values(fm, slse + buf * TILE, (lse, lse_p + first), valid)
        load_row_values(fm, sdelta + buf * TILE, (delta, lse_p + first), valid)
    load_queries(0)
    W = [dict(dk=np.zeros((DCOLS, 32, 4), np.float32), dv=np.zeros((DCOLS, 32, 4), np.float32)) for _ in range(WARPS)]
    tiles = (len_q + TILE - 1) // TILE
    for j in range(tiles):
        if STAGES == 2 and j + 1 < tiles: load_queries(j + 1)
        q0 = j * TILE; valid_q = min(TILE, len_q - q0)
        qb = sq + (j % STAGES) * TILE_ELEMS; dob = sdo + (j % STAGES) * TILE_ELEMS
        lse_b = slse + (j % STAGES) * TILE; delta_b = sdelta + (j % STAGES) * TILE
        for w in range(WARPS):
            k_w = sk + w * 16 * LD; v_w = sv + w * 16 * LD
            key_live = [w * 16 + g < valid_k, w * 16 + g + 8 < valid_k]
            p = products_t(sm, k_w, qb)
            for n in range(TCOLS):
                for e in range(4):
                    col = n * 8 + 2 * t + e % 2
                    p[n][:, e] = np.where(key_live[e // 2] & (col < valid_q), np.exp2(p[n][:, e] * scale_log2 - fm[lse_b + np.minimum(col, TILE-1)]), 0)
            accumulate(sm, W[w]['dv'], p, dob)
            dsf = products_t(sm, v_w, dob)
            for n in range(TCOLS):
                for e in range(4):
                    dsf[n][:, e] = p[n][:, e] * (dsf[n][:, e] - fm[delta_b + n * 8 + 2 * t + e % 2])
            for n in range(TCOLS):
                for r in range(2):
                    a = sds + (w * 16 + g + 8 * r) * LDS + n * 8 + 2 * t
                    pk = pack(dsf[n][:, 2*r], dsf[n][:, 2*r+1])
                    sm[a] = pk[:, 0]; sm[a + 1] = pk[:, 1]
            accumulate(sm, W[w]['dk'], dsf, qb)
        if STAGES == 1 and j + 1 < tiles: load_queries(j + 1)
        for w in range(WARPS):
            first_q = q0 + w * 16
            for half in range(2):
                acc = np.zeros((DCOLS // 2, 32, 4), np.float32)
                for s in range(TSTEPS):
                    fa = ldmatrix_t(sm, sds + (s * 16 + lane % 8 + (lane // 16) * 8) * LDS + w * 16 + (lane // 8 % 2) * 8)
                    for n in range(0, DCOLS // 2, 2):
                        fb = ldmatrix_t(sm, sk + (s * 16 + lane % 8 + (lane // 8 % 2) * 8) * LD + (half * DCOLS // 2 + n) * 8 + (lane // 16) * 8)
                        mma(acc[n], fa, fb[0], fb[1]); mma(acc[n + 1], fa, fb[2], fb[3])
                for r in range(2):
                    for L in range(32):
                        row = first_q + L // 4 + 8 * r
                        if row >= len_q: continue
                        dst = (bh * len_q + row) * D + half * D // 2 + 2 * (L % 4)
                        for n in range(DCOLS // 2):
                            dq[dst + n * 8] += acc[n][L, 2*r] * scale; dq[dst + n * 8 + 1] += acc[n][L, 2*r+1] * scale
    for w in range(WARPS):
        first_k = k0 + w * 16
        for name, out, f in (('dk', dk, scale), ('dv', dv, 1.0)):
            acc = W[w][name]
            for r in range(2):
                for L in range(32):
                    row = L // 4 + 8 * r
                    if row >= len_k - first_k: continue
                    base = (bh * len_k + first_k) * D
                    for n in range(DCOLS):
                        out[base + row*D + n*8 + 2*(L%4): base + row*D + n*8 + 2*(L%4) + 2] = pack(acc[n][L, 2*r] * f, acc[n][L, 2*r+1] * f)

def run(B, H, lq, lk, strided_v, seed=0):
    rng = np.random.default_rng(seed)
    Q = bf(rng.standard_normal((B, H, lq, D)).astype(np.float32))
    K = bf(rng.standard_normal((B, H, lk, D)).astype(np.float32))
    if strided_v:  # v a view into [B, lk, H, 2D] (stride pattern like a split projection)
        big = bf(rng.standard_normal((B, lk, H, 2 * D)).astype(np.float32))
        V = big[..., :D].transpose(0, 2, 1, 3)
        vflat = big.ravel(); vs = (lk * H * 2 * D, 2 * D, H * 2 * D)
    else:
        V = bf(rng.standard_normal((B, H, lk, D)).astype(np.float32)); vflat = V.ravel(); vs = (H*lk*D, lk*D, D)
    dO = bf(rng.standard_normal((B, H, lq, D)).astype(np.float32))
    scale = 1 / np.sqrt(D); sl2 = np.float32(scale * np.log2(np.e))
    qs = (H*lq*D, lq*D, D); ks = (H*lk*D, lk*D, D)
    out = np.zeros(B*H*lq*D, np.float32); lse = np.zeros(B*H*lq, np.float32)
    for bh in range(B * H):
        for bx in range((lq + ROWS - 1) // ROWS):
            forward(Q.ravel(), K.ravel(), vflat, H, lq, lk, qs, ks, vs, sl2, out, lse, bh, bx)
    # float64 reference
    Qd, Kd, Vd, dOd = (x.astype(np.float64) for x in (Q, K, V, dO))
    S = Qd @ Kd.transpose(0, 1, 3, 2) * scale; P = np.exp(S - S.max(-1, keepdims=True)); P /= P.sum(-1, keepdims=True)
    O = P @ Vd
    dV = P.transpose(0, 1, 3, 2) @ dOd; dP = dOd @ Vd.transpose(0, 1, 3, 2)
    dS = P * (dP - (dP * P).sum(-1, keepdims=True)); dQ = dS @ Kd * scale; dK = dS.transpose(0, 1, 3, 2) @ Qd * scale
    err = lambda a, b: np.linalg.norm(a.ravel() - b.ravel()) / np.linalg.norm(b.ravel())
    print(f"D={D} {B}x{H} lq={lq} lk={lk} strided_v={strided_v}: out {err(out, O):.2e}", end=" ")
    lse_ref = (np.log(np.exp(S - S.max(-1, keepdims=True)).sum(-1)) + S.max(-1)) / np.log(2)
    print(f"lse {err(lse, lse_ref):.2e}", end=" ")
    # delta kernel (per row, f32)
    delta = (out.reshape(B, H, lq, D).astype(np.float32) * dO).sum(-1).ravel().astype(np.float32)
    dq = np.zeros(B*H*lq*D, np.float32); dk = np.zeros(B*H*lk*D, np.float32); dv = np.zeros(B*H*lk*D, np.float32)
    dss = (H*lq*D, lq*D, D)
    for bh in range(B * H):
        for bx in range((lk + TILE - 1) // TILE):
            backward(Q.ravel(), K.ravel(), vflat, dO.ravel(), lse, delta, dq, dk, dv, H, lq, lk, qs, ks, vs, dss, sl2, np.float32(scale), bh, bx)
    dq = bf(dq)
    print(f"dq {err(dq, dQ):.2e} dk {err(dk, dK):.2e} dv {err(dv, dV):.2e}")

if __name__ == "__main__":
    for case in sys.argv[2:]:
        B, H, lq, lk, sv = case.split(",")
        run(int(B), int(H), int(lq), int(lk), sv == "1")
