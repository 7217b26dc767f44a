// Fused attention, softmax(scale · q kᵀ) v, forward and backward, for bf16 tensors
// [batch, heads, rows, HEAD_DIM] whose last dimension is contiguous. Online softmax over tiles
// of 64 keys (the score matrix is never stored), products on tensor cores through WMMA
// (bf16 in, f32 accumulate). Compiled at run time by NVRTC with -DHEAD_DIM=64 or 128.
//
// Forward: one block of 4 warps per 64 query rows; each warp owns 16 rows, keeps its output
// accumulator in shared memory (rescaled by the running maximum) and writes the output and the
// row's log-sum-exp (base 2, in units of scale · log2 e · q·k).
// Backward: one block per 64 keys; it walks all query tiles, recomputes the probabilities from
// the log-sum-exp, accumulates dK and dV in registers and adds dQ into an f32 buffer with
// atomics.

#include <cuda_bf16.h>
#include <mma.h>

using namespace nvcuda;
typedef __nv_bfloat16 bf16;
#define NEG_INF (-__int_as_float(0x7f800000))

constexpr int D = HEAD_DIM;
constexpr int TILE = 64;          // query rows per forward block, key rows per backward block
constexpr int WARPS = 4;
constexpr int THREADS = WARPS * 32;
constexpr int ROWS = TILE / WARPS; // rows per warp: one WMMA tile high

typedef wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major> RowA;
typedef wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::col_major> ColA;
typedef wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::row_major> RowB;
typedef wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::col_major> ColB;
typedef wmma::fragment<wmma::accumulator, 16, 16, 16, float> Acc;

// TILE rows of D values from global memory (rows `stride` apart) into a dense [TILE][D] tile;
// rows from `valid` on are zeros. 16-byte copies: the caller checks the alignment.
__device__ void load_tile(bf16* dst, const bf16* src, long long stride, int valid) {
    constexpr int CHUNKS = D / 8;
    for (int i = threadIdx.x; i < TILE * CHUNKS; i += THREADS) {
        int r = i / CHUNKS, c = (i % CHUNKS) * 8;
        uint4 value = make_uint4(0, 0, 0, 0);
        if (r < valid) value = *reinterpret_cast<const uint4*>(src + r * stride + c);
        *reinterpret_cast<uint4*>(dst + r * D + c) = value;
    }
}

// out (16 × TILE, f32, row stride TILE) = a (16 × D, rows D apart) · bᵀ, b a [TILE][D] tile.
__device__ void scores(float* out, const bf16* a, const bf16* b) {
    for (int n = 0; n < TILE / 16; ++n) {
        Acc acc;
        wmma::fill_fragment(acc, 0.0f);
        for (int k = 0; k < D; k += 16) {
            RowA fa;
            ColB fb;
            wmma::load_matrix_sync(fa, a + k, D);
            wmma::load_matrix_sync(fb, b + n * 16 * D + k, D);
            wmma::mma_sync(acc, fa, fb, acc);
        }
        wmma::store_matrix_sync(out + n * 16, acc, TILE, wmma::mem_row_major);
    }
}

// A warp's ROWS × D accumulator, times `factor`, as bf16 rows (the first `valid` of them) at
// `dst`, through the warp's f32 scratch.
__device__ __forceinline__ void store_rows(bf16* dst, const Acc (&acc)[D / 16], float* scratch,
                                           int valid, float factor) {
    const int lane = threadIdx.x % 32;
    __syncwarp();
#pragma unroll
    for (int n = 0; n < D / 16; ++n)
        wmma::store_matrix_sync(scratch + n * 16, acc[n], D, wmma::mem_row_major);
    __syncwarp();
    for (int i = lane; i < ROWS * D; i += 32)
        if (i / D < valid) dst[i] = __float2bfloat16(scratch[i] * factor);
}

struct Strides {
    long long batch, head, row;
};

extern "C" __global__ void __launch_bounds__(THREADS)
flash_forward(const bf16* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ v,
              bf16* __restrict__ out, float* __restrict__ lse, int heads, int len_q, int len_k,
              Strides qs, Strides ks, Strides vs, float scale_log2) {
    extern __shared__ __align__(128) unsigned char smem[];
    bf16* sq = reinterpret_cast<bf16*>(smem);            // [TILE][D]
    bf16* sk = sq + TILE * D;                             // [TILE][D]
    bf16* sv = sk + TILE * D;                             // [TILE][D]
    bf16* sp = sv + TILE * D;                             // [TILE][TILE] probabilities
    float* ss = reinterpret_cast<float*>(sp + TILE * TILE); // [TILE][TILE] scores
    float* so = ss + TILE * TILE;                         // [TILE][D] output accumulator
    float* srescale = so + TILE * D;                      // [TILE]

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int bh = blockIdx.y, b = bh / heads, h = bh % heads;
    const int q0 = blockIdx.x * TILE;
    const bf16* kp = k + b * ks.batch + h * ks.head;
    const bf16* vp = v + b * vs.batch + h * vs.head;
    load_tile(sq, q + b * qs.batch + h * qs.head + q0 * qs.row, qs.row, min(TILE, len_q - q0));

    const bf16* q_w = sq + warp * ROWS * D;
    float* s_w = ss + warp * ROWS * TILE;
    bf16* p_w = sp + warp * ROWS * TILE;
    float* o_w = so + warp * ROWS * D;
    float* rescale_w = srescale + warp * ROWS;
    for (int i = lane; i < ROWS * D; i += 32) o_w[i] = 0.0f;
    // Two lanes per row, 32 columns each; both keep the row's running maximum and sum.
    const int row = lane / 2, half = lane % 2;
    float run_max = NEG_INF, sum = 0.0f;

    for (int k0 = 0; k0 < len_k; k0 += TILE) {
        __syncthreads();
        const int valid = min(TILE, len_k - k0);
        load_tile(sk, kp + k0 * ks.row, ks.row, valid);
        load_tile(sv, vp + k0 * vs.row, vs.row, valid);
        __syncthreads();
        scores(s_w, q_w, sk);
        __syncwarp();

        float* s_row = s_w + row * TILE + half * 32;
        float tile_max = NEG_INF;
#pragma unroll
        for (int c = 0; c < 32; ++c) {
            float s = half * 32 + c < valid ? s_row[c] * scale_log2 : NEG_INF;
            s_row[c] = s;
            tile_max = fmaxf(tile_max, s);
        }
        tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffff, tile_max, 1));
        const float new_max = fmaxf(run_max, tile_max);
        float tile_sum = 0.0f;
        bf16* p_row = p_w + row * TILE + half * 32;
#pragma unroll
        for (int c = 0; c < 32; ++c) {
            float p = exp2f(s_row[c] - new_max);
            p_row[c] = __float2bfloat16(p);
            tile_sum += p;
        }
        tile_sum += __shfl_xor_sync(0xffffffff, tile_sum, 1);
        const float factor = exp2f(run_max - new_max);
        sum = sum * factor + tile_sum;
        run_max = new_max;
        if (half == 0) rescale_w[row] = factor;
        __syncwarp();
        for (int i = lane; i < ROWS * D; i += 32) o_w[i] *= rescale_w[i / D];
        __syncwarp();
        for (int n = 0; n < D / 16; ++n) {
            Acc acc;
            wmma::load_matrix_sync(acc, o_w + n * 16, D, wmma::mem_row_major);
            for (int c = 0; c < TILE; c += 16) {
                RowA fp;
                RowB fv;
                wmma::load_matrix_sync(fp, p_w + c, TILE);
                wmma::load_matrix_sync(fv, sv + c * D + n * 16, D);
                wmma::mma_sync(acc, fp, fv, acc);
            }
            wmma::store_matrix_sync(o_w + n * 16, acc, D, wmma::mem_row_major);
        }
        __syncwarp();
    }

    const int first = q0 + warp * ROWS;
    if (half == 0) {
        rescale_w[row] = 1.0f / sum;
        if (first + row < len_q) lse[(long long)bh * len_q + first + row] = run_max + log2f(sum);
    }
    __syncwarp();
    bf16* out_w = out + ((long long)bh * len_q + first) * D;
    for (int i = lane; i < ROWS * D; i += 32) {
        const int r = i / D;
        if (first + r < len_q) out_w[i] = __float2bfloat16(o_w[i] * rescale_w[r]);
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
    bf16* sk = reinterpret_cast<bf16*>(smem);   // [TILE][D]
    bf16* sv = sk + TILE * D;                    // [TILE][D]
    bf16* sq = sv + TILE * D;                    // [TILE][D]
    bf16* sdo = sq + TILE * D;                   // [TILE][D]
    bf16* sp = sdo + TILE * D;                   // [TILE queries][TILE keys] probabilities
    bf16* sds = sp + TILE * TILE;                // [TILE queries][TILE keys] score gradients
    float* scratch = reinterpret_cast<float*>(sds + TILE * TILE); // [WARPS][ROWS][max(TILE, D)]

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int bh = blockIdx.y, b = bh / heads, h = bh % heads;
    const int k0 = blockIdx.x * TILE;
    const int valid_k = min(TILE, len_k - k0);
    load_tile(sk, k + b * ks.batch + h * ks.head + k0 * ks.row, ks.row, valid_k);
    load_tile(sv, v + b * vs.batch + h * vs.head + k0 * vs.row, vs.row, valid_k);
    const bf16* qp = q + b * qs.batch + h * qs.head;
    const bf16* dp = dout + b * ds.batch + h * ds.head;

    constexpr int WIDTH = TILE > D ? TILE : D;
    float* f_w = scratch + warp * ROWS * WIDTH;
    const int row = lane / 2, half = lane % 2;
    // This warp's key rows of dK and dV, in registers.
    Acc dk_acc[D / 16], dv_acc[D / 16];
#pragma unroll
    for (int n = 0; n < D / 16; ++n) {
        wmma::fill_fragment(dk_acc[n], 0.0f);
        wmma::fill_fragment(dv_acc[n], 0.0f);
    }
    float p[32];

    for (int q0 = 0; q0 < len_q; q0 += TILE) {
        __syncthreads();
        const int valid_q = min(TILE, len_q - q0);
        load_tile(sq, qp + q0 * qs.row, qs.row, valid_q);
        load_tile(sdo, dp + q0 * ds.row, ds.row, valid_q);
        __syncthreads();

        // This warp's query rows: probabilities P, then dS = P ∘ (dO vᵀ − delta).
        const int qrow = q0 + warp * ROWS + row;
        const bool live = qrow < len_q;
        const long long at = (long long)bh * len_q + qrow;
        scores(f_w, sq + warp * ROWS * D, sk);
        __syncwarp();
        const float row_lse = live ? lse[at] : 0.0f;
#pragma unroll
        for (int c = 0; c < 32; ++c) {
            const int col = half * 32 + c;
            p[c] = live && col < valid_k ? exp2f(f_w[row * TILE + col] * scale_log2 - row_lse) : 0.0f;
            sp[(warp * ROWS + row) * TILE + col] = __float2bfloat16(p[c]);
        }
        __syncwarp();
        scores(f_w, sdo + warp * ROWS * D, sv);
        __syncwarp();
        const float row_delta = live ? delta[at] : 0.0f;
#pragma unroll
        for (int c = 0; c < 32; ++c) {
            const int col = half * 32 + c;
            sds[(warp * ROWS + row) * TILE + col] =
                __float2bfloat16(p[c] * (f_w[row * TILE + col] - row_delta));
        }
        __syncthreads();

        // This warp's key rows: dV += Pᵀ dO, dK += dSᵀ q (scaled at the end).
#pragma unroll
        for (int n = 0; n < D / 16; ++n) {
#pragma unroll
            for (int c = 0; c < TILE; c += 16) {
                ColA fa;
                RowB fb;
                wmma::load_matrix_sync(fa, sp + c * TILE + warp * ROWS, TILE);
                wmma::load_matrix_sync(fb, sdo + c * D + n * 16, D);
                wmma::mma_sync(dv_acc[n], fa, fb, dv_acc[n]);
                wmma::load_matrix_sync(fa, sds + c * TILE + warp * ROWS, TILE);
                wmma::load_matrix_sync(fb, sq + c * D + n * 16, D);
                wmma::mma_sync(dk_acc[n], fa, fb, dk_acc[n]);
            }
        }
        // This warp's query rows: dQ += scale · dS k, added into the f32 buffer.
        for (int n = 0; n < D / 16; ++n) {
            Acc acc;
            wmma::fill_fragment(acc, 0.0f);
            for (int c = 0; c < TILE; c += 16) {
                RowA fa;
                RowB fb;
                wmma::load_matrix_sync(fa, sds + warp * ROWS * TILE + c, TILE);
                wmma::load_matrix_sync(fb, sk + c * D + n * 16, D);
                wmma::mma_sync(acc, fa, fb, acc);
            }
            wmma::store_matrix_sync(f_w + n * 16, acc, D, wmma::mem_row_major);
        }
        __syncwarp();
        const int first_q = q0 + warp * ROWS;
        for (int i = lane; i < ROWS * D; i += 32) {
            const int r = i / D;
            if (first_q + r < len_q)
                atomicAdd(dq + ((long long)bh * len_q + first_q + r) * D + i % D, f_w[i] * scale);
        }
    }

    const int first_k = k0 + warp * ROWS;
    store_rows(dk + ((long long)bh * len_k + first_k) * D, dk_acc, f_w, len_k - first_k, scale);
    store_rows(dv + ((long long)bh * len_k + first_k) * D, dv_acc, f_w, len_k - first_k, 1.0f);
}

// dq (bf16) from its f32 accumulator.
extern "C" __global__ void flash_backward_dq(const float* __restrict__ acc, bf16* __restrict__ dq,
                                             long long n) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) dq[i] = __float2bfloat16(acc[i]);
}
