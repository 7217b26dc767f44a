// Fused attention, softmax(scale · q kᵀ) v, forward and backward, for bf16 tensors
// [batch, heads, rows, HEAD_DIM] whose last dimension is contiguous. Online softmax over tiles
// of 64 keys (the score matrix is never stored); products on tensor cores with mma.sync
// m16n8k16 (bf16 in, f32 accumulate), operands read from shared memory by ldmatrix, tiles
// brought in by cp.async one step ahead of their use. Compiled at run time by NVRTC with
// -DHEAD_DIM=64 or 128, -DQUERY_TILES=1 or 2 (the forward's query tiles per warp) and
// -DSTAGES=1 or 2 (the backward's query tiles single or double buffered), as the device's shared
// memory allows, for compute capability 8.0 or later.
//
// Forward: one block of 4 warps per 64 · QUERY_TILES query rows; each warp owns QUERY_TILES
// tiles of 16 rows and keeps their scores, probabilities and output accumulators in registers
// (an accumulator tile of one product has the layout of the next product's left operand), so
// that each fragment of K and V read from shared memory feeds the products of all its tiles;
// the queries stay in shared memory, read once per k-step. It writes the output and the row's log-sum-exp (base 2, in
// units of scale · log2 e · q·k).
// Backward: one block per 64 keys; each warp owns 16 keys, walks all query tiles, recomputes
// the transposed probabilities from the log-sum-exp, accumulates dK and dV in registers and adds
// dQ into an f32 buffer with atomics.
//
// Fragment layouts (PTX ISA, mma.m16n8k16, g = lane / 4, t = lane % 4): an accumulator holds
// (row g, columns 2t, 2t+1) and (row g+8, the same columns); a left operand holds (row g,
// k 2t..2t+1), (row g+8, k 2t..), (row g, k 2t+8..), (row g+8, k 2t+8..); a right operand holds
// (k 2t..2t+1, column g) and (k 2t+8.., column g).

#include <cuda_bf16.h>

typedef __nv_bfloat16 bf16;
#define NEG_INF (-__int_as_float(0x7f800000))

constexpr int D = HEAD_DIM;
constexpr int STAGES_ = STAGES;    // query-tile buffers of the backward
constexpr int TILE = 64;           // keys per forward step; keys and queries per backward step
constexpr int WARPS = 4;
constexpr int THREADS = WARPS * 32;
constexpr int QT = QUERY_TILES;    // 16-row query tiles per warp in the forward
constexpr int ROWS = WARPS * 16 * QT; // query rows per forward block
constexpr int LD = D + 8;          // shared row stride of a [TILE][D] tile: rows 16 bytes apart in
                                   // the banks, so ldmatrix reads 8 rows without conflicts
constexpr int TILE_ELEMS = TILE * LD;
constexpr int LDS = TILE + 8;      // shared row stride of the backward's [keys][queries] dS tile
constexpr int DSTEPS = D / 16;     // k-steps over the head dimension
constexpr int DCOLS = D / 8;       // accumulator tiles across the head dimension
constexpr int TSTEPS = TILE / 16;  // k-steps over a tile of rows
constexpr int TCOLS = TILE / 8;    // accumulator tiles across a tile of rows

__device__ __forceinline__ unsigned shared_address(const void* p) {
    return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// Four 8 × 8 matrices from shared memory; lane i gives the address of row i % 8 of matrix i / 8.
__device__ __forceinline__ void ldmatrix(unsigned (&r)[4], const bf16* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(shared_address(p)));
}

// As `ldmatrix`, each matrix transposed.
__device__ __forceinline__ void ldmatrix_t(unsigned (&r)[4], const bf16* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(shared_address(p)));
}

// c += a · b for one 16 × 8 accumulator tile.
__device__ __forceinline__ void mma(float (&c)[4], const unsigned (&a)[4], unsigned b0,
                                    unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two floats as a bf16 pair, the first in the low half.
__device__ __forceinline__ unsigned pack(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<unsigned*>(&v);
}

// The left operand of k-step `s` of a product whose left factor is an accumulator row of tiles.
__device__ __forceinline__ void left_from(unsigned (&a)[4], const float (&acc)[TCOLS][4], int s) {
    a[0] = pack(acc[2 * s][0], acc[2 * s][1]);
    a[1] = pack(acc[2 * s][2], acc[2 * s][3]);
    a[2] = pack(acc[2 * s + 1][0], acc[2 * s + 1][1]);
    a[3] = pack(acc[2 * s + 1][2], acc[2 * s + 1][3]);
}

// Asynchronous copy of `bytes` (4 or 16) from global to shared memory; zeros when `valid` is
// false (nothing is read then).
template <int BYTES>
__device__ __forceinline__ void copy_async(void* dst, const void* src, bool valid) {
    const int size = valid ? BYTES : 0;
    if (BYTES == 16)
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(shared_address(dst)),
                     "l"(src), "r"(size));
    else
        asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(shared_address(dst)),
                     "l"(src), "r"(size));
}

__device__ __forceinline__ void copies_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void copies_wait() { asm volatile("cp.async.wait_all;\n" ::); }

// Starts copying R rows of D values from global memory (rows `stride` apart) into a [R][LD]
// tile; rows from `valid` on become zeros. The caller checks 16-byte alignment.
template <int R = TILE>
__device__ void load_tile(bf16* dst, const bf16* src, long long stride, int valid) {
    constexpr int CHUNKS = D / 8;
    for (int i = threadIdx.x; i < R * CHUNKS; i += THREADS) {
        const int r = i / CHUNKS, c = (i % CHUNKS) * 8;
        const bool live = r < valid;
        copy_async<16>(dst + r * LD + c, live ? src + r * stride + c : src, live);
    }
}

// Starts copying `valid` (at most TILE) f32 values into `dst`; the rest become zeros.
__device__ void load_row_values(float* dst, const float* src, int valid) {
    if (threadIdx.x < TILE) {
        const bool live = threadIdx.x < valid;
        copy_async<4>(dst + threadIdx.x, live ? src + threadIdx.x : src, live);
    }
}

// acc (16 rows × TILE columns) = a · bᵀ, a 16 rows of a [·][LD] tile, b a [TILE][LD] tile.
__device__ __forceinline__ void products_t(float (&acc)[TCOLS][4], const bf16* a, const bf16* b) {
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int n = 0; n < TCOLS; ++n)
        acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
#pragma unroll
    for (int s = 0; s < DSTEPS; ++s) {
        unsigned fa[4];
        ldmatrix(fa, a + (lane % 8 + (lane / 8 % 2) * 8) * LD + s * 16 + (lane / 16) * 8);
#pragma unroll
        for (int n = 0; n < TCOLS; n += 2) {
            unsigned fb[4];
            ldmatrix(fb, b + (n * 8 + lane % 8 + (lane / 16) * 8) * LD + s * 16 + (lane / 8 % 2) * 8);
            mma(acc[n], fa, fb[0], fb[1]);
            mma(acc[n + 1], fa, fb[2], fb[3]);
        }
    }
}

// acc (16 rows × D) += p · b, p 16 × TILE in registers (an accumulator row), b a [TILE][LD] tile.
__device__ __forceinline__ void accumulate(float (&acc)[DCOLS][4], const float (&p)[TCOLS][4],
                                           const bf16* b) {
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int s = 0; s < TSTEPS; ++s) {
        unsigned fa[4];
        left_from(fa, p, s);
#pragma unroll
        for (int n = 0; n < DCOLS; n += 2) {
            unsigned fb[4];
            ldmatrix_t(fb, b + (s * 16 + lane % 8 + (lane / 8 % 2) * 8) * LD + n * 8 + (lane / 16) * 8);
            mma(acc[n], fa, fb[0], fb[1]);
            mma(acc[n + 1], fa, fb[2], fb[3]);
        }
    }
}

// Rows `first` and `first + 8` of an accumulator row of tiles (D wide), times `factor[0|1]`, as
// bf16 at `dst` (rows D apart, starting at row 0 of the tile); rows from `valid` on are skipped.
__device__ __forceinline__ void store_rows(bf16* dst, const float (&acc)[DCOLS][4],
                                           const float (&factor)[2], int valid) {
    const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = g + 8 * r;
        if (row >= valid) continue;
#pragma unroll
        for (int n = 0; n < DCOLS; ++n)
            *reinterpret_cast<unsigned*>(dst + row * D + n * 8 + 2 * t) =
                pack(acc[n][2 * r] * factor[r], acc[n][2 * r + 1] * factor[r]);
    }
}

struct Strides {
    long long batch, head, row;
};

extern "C" __global__ void __launch_bounds__(THREADS)
flash_forward(const bf16* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ v,
              bf16* __restrict__ out, float* __restrict__ lse, int heads, int len_q, int len_k,
              Strides qs, Strides ks, Strides vs, float scale_log2) {
    extern __shared__ __align__(128) unsigned char smem[];
    bf16* sq = reinterpret_cast<bf16*>(smem);  // [ROWS][LD], the query rows
    bf16* sk = sq + ROWS * LD;                 // [2][TILE][LD], double buffered
    bf16* sv = sk + 2 * TILE_ELEMS;            // [2][TILE][LD]

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, t = lane % 4;
    const int bh = blockIdx.y, b = bh / heads, h = bh % heads;
    const int q0 = blockIdx.x * ROWS;
    const bf16* kp = k + b * ks.batch + h * ks.head;
    const bf16* vp = v + b * vs.batch + h * vs.head;
    load_tile<ROWS>(sq, q + b * qs.batch + h * qs.head + q0 * qs.row, qs.row,
                    min(ROWS, len_q - q0));
    load_tile(sk, kp, ks.row, min(TILE, len_k));
    load_tile(sv, vp, vs.row, min(TILE, len_k));
    copies_commit();

    // Tile m of the warp holds rows (warp · QT + m) · 16 onwards of the block's.
    const bf16* q_w = sq + warp * QT * 16 * LD;
    float o[QT][DCOLS][4], s[QT][TCOLS][4];
#pragma unroll
    for (int m = 0; m < QT; ++m)
#pragma unroll
        for (int n = 0; n < DCOLS; ++n) o[m][n][0] = o[m][n][1] = o[m][n][2] = o[m][n][3] = 0.0f;
    // Rows g and g + 8 of each tile: running maximum and this lane's share of the running sum.
    float run_max[QT][2], sum[QT][2];
#pragma unroll
    for (int m = 0; m < QT; ++m)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            run_max[m][r] = NEG_INF;
            sum[m][r] = 0.0f;
        }

    const int tiles = (len_k + TILE - 1) / TILE;
    for (int j = 0; j < tiles; ++j) {
        copies_wait();
        __syncthreads();
        if (j + 1 < tiles) {
            const int next = (j + 1) * TILE, buffer = (j + 1) % 2;
            load_tile(sk + buffer * TILE_ELEMS, kp + next * ks.row, ks.row, min(TILE, len_k - next));
            load_tile(sv + buffer * TILE_ELEMS, vp + next * vs.row, vs.row, min(TILE, len_k - next));
            copies_commit();
        }
        const bf16* kb = sk + (j % 2) * TILE_ELEMS;
        const bf16* vb = sv + (j % 2) * TILE_ELEMS;

#pragma unroll
        for (int m = 0; m < QT; ++m)
#pragma unroll
            for (int n = 0; n < TCOLS; ++n) s[m][n][0] = s[m][n][1] = s[m][n][2] = s[m][n][3] = 0.0f;
#pragma unroll
        for (int s_ = 0; s_ < DSTEPS; ++s_) {
            unsigned qa[QT][4];
#pragma unroll
            for (int m = 0; m < QT; ++m)
                ldmatrix(qa[m], q_w + (m * 16 + lane % 8 + (lane / 8 % 2) * 8) * LD + s_ * 16 +
                                    (lane / 16) * 8);
#pragma unroll
            for (int n = 0; n < TCOLS; n += 2) {
                unsigned fb[4];
                ldmatrix(fb, kb + (n * 8 + lane % 8 + (lane / 16) * 8) * LD + s_ * 16 +
                                 (lane / 8 % 2) * 8);
#pragma unroll
                for (int m = 0; m < QT; ++m) {
                    mma(s[m][n], qa[m], fb[0], fb[1]);
                    mma(s[m][n + 1], qa[m], fb[2], fb[3]);
                }
            }
        }

        const int valid = len_k - j * TILE;
#pragma unroll
        for (int m = 0; m < QT; ++m)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                float tile_max = NEG_INF;
#pragma unroll
                for (int n = 0; n < TCOLS; ++n)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const float x =
                            n * 8 + 2 * t + e < valid ? s[m][n][2 * r + e] * scale_log2 : NEG_INF;
                        s[m][n][2 * r + e] = x;
                        tile_max = fmaxf(tile_max, x);
                    }
                tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffff, tile_max, 1));
                tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffff, tile_max, 2));
                const float new_max = fmaxf(run_max[m][r], tile_max);
                const float factor = exp2f(run_max[m][r] - new_max);
                run_max[m][r] = new_max;
                float tile_sum = 0.0f;
#pragma unroll
                for (int n = 0; n < TCOLS; ++n)
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        const float p = exp2f(s[m][n][2 * r + e] - new_max);
                        s[m][n][2 * r + e] = p;
                        tile_sum += p;
                    }
                sum[m][r] = sum[m][r] * factor + tile_sum;
#pragma unroll
                for (int n = 0; n < DCOLS; ++n) {
                    o[m][n][2 * r] *= factor;
                    o[m][n][2 * r + 1] *= factor;
                }
            }

        // o += p · v, each V fragment feeding both tiles.
#pragma unroll
        for (int s_ = 0; s_ < TSTEPS; ++s_) {
            unsigned pa[QT][4];
#pragma unroll
            for (int m = 0; m < QT; ++m) left_from(pa[m], s[m], s_);
#pragma unroll
            for (int n = 0; n < DCOLS; n += 2) {
                unsigned fb[4];
                ldmatrix_t(fb, vb + (s_ * 16 + lane % 8 + (lane / 8 % 2) * 8) * LD + n * 8 +
                                   (lane / 16) * 8);
#pragma unroll
                for (int m = 0; m < QT; ++m) {
                    mma(o[m][n], pa[m], fb[0], fb[1]);
                    mma(o[m][n + 1], pa[m], fb[2], fb[3]);
                }
            }
        }
    }

    const int g = lane / 4;
#pragma unroll
    for (int m = 0; m < QT; ++m) {
        const int first = q0 + (warp * QT + m) * 16;
        float inverse[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            sum[m][r] += __shfl_xor_sync(0xffffffff, sum[m][r], 1);
            sum[m][r] += __shfl_xor_sync(0xffffffff, sum[m][r], 2);
            inverse[r] = 1.0f / sum[m][r];
            const int row = first + g + 8 * r;
            if (t == 0 && row < len_q)
                lse[(long long)bh * len_q + row] = run_max[m][r] + log2f(sum[m][r]);
        }
        store_rows(out + ((long long)bh * len_q + first) * D, o[m], inverse, len_q - first);
    }
}

// delta[row] = Σ dout[row] ∘ out[row], one warp per row (out contiguous, dout strided).
extern "C" __global__ void flash_backward_delta(const bf16* __restrict__ out,
                                                const bf16* __restrict__ dout,
                                                float* __restrict__ delta, int heads, int len_q,
                                                long long rows, Strides ds) {
    const long long r = ((long long)blockIdx.x * blockDim.x + threadIdx.x) / 32;
    const int lane = threadIdx.x % 32;
    if (r >= rows) return;
    const long long bh = r / len_q, i = r % len_q;
    const bf16* o_row = out + r * D;
    const bf16* d_row = dout + (bh / heads) * ds.batch + (bh % heads) * ds.head + i * ds.row;
    float acc = 0.0f;
    for (int c = lane; c < D; c += 32) acc += __bfloat162float(o_row[c]) * __bfloat162float(d_row[c]);
    for (int offset = 16; offset > 0; offset /= 2) acc += __shfl_xor_sync(0xffffffff, acc, offset);
    if (lane == 0) delta[r] = acc;
}

extern "C" __global__ void __launch_bounds__(THREADS)
flash_backward(const bf16* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ v,
               const bf16* __restrict__ dout, const float* __restrict__ lse,
               const float* __restrict__ delta, float* __restrict__ dq, bf16* __restrict__ dk,
               bf16* __restrict__ dv, int heads, int len_q, int len_k, Strides qs, Strides ks,
               Strides vs, Strides ds, float scale_log2, float scale) {
    extern __shared__ __align__(128) unsigned char smem[];
    bf16* sk = reinterpret_cast<bf16*>(smem);  // [TILE keys][LD]
    bf16* sv = sk + TILE_ELEMS;                // [TILE keys][LD]
    bf16* sq = sv + TILE_ELEMS;                // [STAGES][TILE queries][LD]
    bf16* sdo = sq + STAGES_ * TILE_ELEMS;     // [STAGES][TILE queries][LD]
    bf16* sds = sdo + STAGES_ * TILE_ELEMS;    // [TILE keys][LDS] score gradients, transposed
    float* slse = reinterpret_cast<float*>(sds + TILE * LDS); // [STAGES][TILE]
    float* sdelta = slse + STAGES_ * TILE;                     // [STAGES][TILE]

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int bh = blockIdx.y, b = bh / heads, h = bh % heads;
    const int k0 = blockIdx.x * TILE;
    const int valid_k = min(TILE, len_k - k0);
    const bf16* qp = q + b * qs.batch + h * qs.head;
    const bf16* dp = dout + b * ds.batch + h * ds.head;
    const float* lse_p = lse + (long long)bh * len_q;
    const float* delta_p = delta + (long long)bh * len_q;
    load_tile(sk, k + b * ks.batch + h * ks.head + k0 * ks.row, ks.row, valid_k);
    load_tile(sv, v + b * vs.batch + h * vs.head + k0 * vs.row, vs.row, valid_k);
    // Starts loading query tile `j` into its buffer.
    auto load_queries = [&](int j) {
        const int first = j * TILE, buffer = j % STAGES_, valid = min(TILE, len_q - first);
        load_tile(sq + buffer * TILE_ELEMS, qp + first * qs.row, qs.row, valid);
        load_tile(sdo + buffer * TILE_ELEMS, dp + first * ds.row, ds.row, valid);
        load_row_values(slse + buffer * TILE, lse_p + first, valid);
        load_row_values(sdelta + buffer * TILE, delta_p + first, valid);
        copies_commit();
    };
    load_queries(0);

    // This warp's 16 keys: rows of dK and dV, in registers.
    float dk_acc[DCOLS][4], dv_acc[DCOLS][4];
#pragma unroll
    for (int n = 0; n < DCOLS; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) dk_acc[n][e] = dv_acc[n][e] = 0.0f;
    const bf16* k_w = sk + warp * 16 * LD;
    const bf16* v_w = sv + warp * 16 * LD;
    // Whether the warp's key rows g and g + 8 exist.
    const bool key_live[2] = {warp * 16 + g < valid_k, warp * 16 + g + 8 < valid_k};

    const int tiles = (len_q + TILE - 1) / TILE;
    for (int j = 0; j < tiles; ++j) {
        copies_wait();
        __syncthreads();
        // Two buffers: the next tile loads during all of this one's work.
        if (STAGES_ == 2 && j + 1 < tiles) load_queries(j + 1);
        const int q0 = j * TILE, valid_q = min(TILE, len_q - q0);
        const bf16* qb = sq + (j % STAGES_) * TILE_ELEMS;
        const bf16* dob = sdo + (j % STAGES_) * TILE_ELEMS;
        const float* lse_b = slse + (j % STAGES_) * TILE;
        const float* delta_b = sdelta + (j % STAGES_) * TILE;

        // Pᵀ for the warp's keys against the tile's queries, from the log-sum-exp.
        float p[TCOLS][4];
        products_t(p, k_w, qb);
#pragma unroll
        for (int n = 0; n < TCOLS; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int col = n * 8 + 2 * t + e % 2;
                p[n][e] = key_live[e / 2] && col < valid_q
                              ? exp2f(p[n][e] * scale_log2 - lse_b[col])
                              : 0.0f;
            }
        // dV += Pᵀ dO.
        accumulate(dv_acc, p, dob);
        // dSᵀ = Pᵀ ∘ (V dOᵀ − delta), kept for dK and written out for dQ.
        float dsf[TCOLS][4];
        products_t(dsf, v_w, dob);
#pragma unroll
        for (int n = 0; n < TCOLS; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e)
                dsf[n][e] = p[n][e] * (dsf[n][e] - delta_b[n * 8 + 2 * t + e % 2]);
#pragma unroll
        for (int n = 0; n < TCOLS; ++n)
#pragma unroll
            for (int r = 0; r < 2; ++r)
                *reinterpret_cast<unsigned*>(sds + (warp * 16 + g + 8 * r) * LDS + n * 8 + 2 * t) =
                    pack(dsf[n][2 * r], dsf[n][2 * r + 1]);
        // dK += dSᵀ q (scaled at the end).
        accumulate(dk_acc, dsf, qb);
        __syncthreads();
        // One buffer: the next tile loads during dQ, which reads only k and dS.
        if (STAGES_ == 1 && j + 1 < tiles) load_queries(j + 1);

        // The warp's 16 queries of the tile: dQ += scale · dS k, added into the f32 buffer, half
        // the head dimension at a time.
        const int first_q = q0 + warp * 16;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            float acc[DCOLS / 2][4];
#pragma unroll
            for (int n = 0; n < DCOLS / 2; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
#pragma unroll
            for (int s = 0; s < TSTEPS; ++s) {
                unsigned fa[4];
                ldmatrix_t(fa, sds + (s * 16 + lane % 8 + (lane / 16) * 8) * LDS + warp * 16 +
                                   (lane / 8 % 2) * 8);
#pragma unroll
                for (int n = 0; n < DCOLS / 2; n += 2) {
                    unsigned fb[4];
                    ldmatrix_t(fb, sk + (s * 16 + lane % 8 + (lane / 8 % 2) * 8) * LD +
                                       (half * DCOLS / 2 + n) * 8 + (lane / 16) * 8);
                    mma(acc[n], fa, fb[0], fb[1]);
                    mma(acc[n + 1], fa, fb[2], fb[3]);
                }
            }
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const int row = first_q + g + 8 * r;
                if (row >= len_q) continue;
                float* dst = dq + ((long long)bh * len_q + row) * D + half * D / 2 + 2 * t;
#pragma unroll
                for (int n = 0; n < DCOLS / 2; ++n) {
#if __CUDA_ARCH__ >= 900
                    atomicAdd(reinterpret_cast<float2*>(dst + n * 8),
                              make_float2(acc[n][2 * r] * scale, acc[n][2 * r + 1] * scale));
#else
                    atomicAdd(dst + n * 8, acc[n][2 * r] * scale);
                    atomicAdd(dst + n * 8 + 1, acc[n][2 * r + 1] * scale);
#endif
                }
            }
        }
    }

    const int first_k = k0 + warp * 16;
    const float dk_scale[2] = {scale, scale}, one[2] = {1.0f, 1.0f};
    store_rows(dk + ((long long)bh * len_k + first_k) * D, dk_acc, dk_scale, len_k - first_k);
    store_rows(dv + ((long long)bh * len_k + first_k) * D, dv_acc, one, len_k - first_k);
}

// dq (bf16) from its f32 accumulator.
extern "C" __global__ void flash_backward_dq(const float* __restrict__ acc, bf16* __restrict__ dq,
                                             long long n) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) dq[i] = __float2bfloat16(acc[i]);
}
