//! The shared-memory plan of the fused attention kernels (`flash_attention.cu`): bytes per
//! block for each kernel and head size, and how many query tiles the backward kernel buffers on
//! a device with a given per-block limit. Pure, so the CPU tests check it against the limits of
//! real GPUs.

/// Keys per forward step, keys and queries per backward step (`TILE` in the source); also the
/// query rows of one tile per warp across a block's four warps.
pub const TILE: usize = 64;

/// Bytes of one bf16 `[TILE][d + 8]` tile in shared memory (rows padded by 16 bytes).
fn tile_bytes(d: usize) -> usize {
    TILE * (d + 8) * 2
}

/// Query rows per forward block with `query_tiles` tiles of 16 rows per warp.
pub fn forward_rows(query_tiles: usize) -> usize {
    query_tiles * TILE
}

/// Bytes of dynamic shared memory the forward kernel uses for head size `d` and
/// `query_tiles` tiles per warp: the block's query rows, and K and V double buffered.
pub fn forward_shared(d: usize, query_tiles: usize) -> usize {
    (query_tiles + 4) * tile_bytes(d)
}

/// Query tiles per warp for the forward kernel (`QUERY_TILES` in the source): two, so that each
/// K and V fragment feeds twice the products, where a block may use that much shared memory,
/// else one; `None` when even one does not fit.
pub fn forward_query_tiles(d: usize, shared_per_block: usize) -> Option<usize> {
    [2, 1]
        .into_iter()
        .find(|&tiles| forward_shared(d, tiles) <= shared_per_block)
}

/// Bytes of dynamic shared memory the backward kernel uses for head size `d` with `stages`
/// buffers of query tiles: K, V, the q and dO tiles, the transposed score gradients and two f32
/// rows of statistics per buffer.
pub fn backward_shared(d: usize, stages: usize) -> usize {
    (2 + 2 * stages) * tile_bytes(d) + tile_bytes(TILE) + 2 * stages * TILE * 4
}

/// Query-tile buffers for the backward kernel (`STAGES` in the source): two, so that loads
/// overlap all of a tile's work, where a block may use that much shared memory, else one;
/// `None` when even one does not fit.
pub fn backward_stages(d: usize, shared_per_block: usize) -> Option<usize> {
    [2, 1]
        .into_iter()
        .find(|&stages| backward_shared(d, stages) <= shared_per_block)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Opt-in shared memory per block (`cudaDevAttrMaxSharedMemoryPerBlockOptin`), bytes.
    const H100_H200: usize = 227 * 1024;
    const A100: usize = 163 * 1024;
    const RTX_3090_4090: usize = 99 * 1024;

    #[test]
    fn byte_counts_follow_the_kernel_layout() {
        // Head 128: tiles of 64 × 136 bf16 (17,408 B), dS 64 × 72 bf16, f32 rows of 64.
        assert_eq!(forward_shared(128, 2), 6 * 17_408);
        assert_eq!(forward_rows(2), 128);
        assert_eq!(backward_shared(128, 2), 6 * 17_408 + 9_216 + 4 * 256);
        assert_eq!(backward_shared(128, 1), 4 * 17_408 + 9_216 + 2 * 256);
        // Head 64: tiles of 64 × 72 bf16.
        assert_eq!(backward_shared(64, 2), 6 * 9_216 + 9_216 + 4 * 256);
    }

    #[test]
    fn large_shared_memory_double_buffers_and_100_kb_gpus_single_buffer() {
        for d in [64, 128] {
            assert_eq!(backward_stages(d, H100_H200), Some(2));
            assert_eq!(backward_stages(d, A100), Some(2));
            assert_eq!(forward_query_tiles(d, H100_H200), Some(2));
            assert_eq!(forward_query_tiles(d, A100), Some(2));
        }
        // Two buffers at head 128 need 112 KB, two query tiles 104 KB: more than a 4090 gives
        // one block.
        assert_eq!(backward_stages(128, RTX_3090_4090), Some(1));
        assert_eq!(forward_query_tiles(128, RTX_3090_4090), Some(1));
        assert_eq!(backward_stages(64, RTX_3090_4090), Some(2));
        assert_eq!(forward_query_tiles(64, RTX_3090_4090), Some(2));
        assert_eq!(backward_stages(128, 48 * 1024), None);
        assert_eq!(forward_query_tiles(128, 48 * 1024), None);
    }
}
