//! How a matrix product of strided row-major tensors maps onto one column-major BLAS call
//! (`gemm` / `gemmStridedBatched`). Pure: no device code, so the CPU tests check every
//! transposition, leading dimension and batch stride the CUDA path will use.
//!
//! Burn's `lhs · rhs` (`[.., M, K] · [.., K, N]`, batch dimensions broadcast, missing leading
//! dimensions too) is computed as the column-major product `outᵀ = rhsᵀ · lhsᵀ`: a row-major
//! matrix read column-major is its transpose, so the output comes out row-major without a copy.
//! An operand whose last two dimensions are swapped (a transposed view, as attention's `kᵀ` and
//! the backward passes make them) is passed with the BLAS transpose flag instead of copied.

/// A tensor's shape and strides, in elements.
#[derive(Debug, Clone, Copy)]
pub struct Layout<'a> {
    /// Sizes, outermost first.
    pub shape: &'a [usize],
    /// Element strides, one per dimension.
    pub strides: &'a [usize],
}

/// One input of the column-major call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Operand {
    /// Whether BLAS must transpose the matrix it reads.
    pub transpose: bool,
    /// Leading dimension: elements between consecutive columns of the matrix as stored.
    pub ld: usize,
    /// Elements between consecutive matrices of the batch (0: the same matrix for all).
    pub batch_stride: usize,
}

/// A column-major `C (m × n) = op(A) (m × k) · op(B) (k × n)`, `batch` times, where `A` is
/// Burn's `rhs`, `B` is Burn's `lhs` and `C` is a fresh contiguous output of shape `out_shape`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GemmPlan {
    /// The output's shape (Burn's row-major `[.., M, N]`).
    pub out_shape: Vec<usize>,
    /// Rows of `C`: Burn's `N`.
    pub m: usize,
    /// Columns of `C`: Burn's `M` (times the batch when it folds into the rows).
    pub n: usize,
    /// The contracted dimension.
    pub k: usize,
    /// Burn's `rhs`.
    pub a: Operand,
    /// Burn's `lhs`.
    pub b: Operand,
    /// Leading dimension of the output: `m`.
    pub ldc: usize,
    /// Elements between consecutive output matrices.
    pub stride_c: usize,
    /// Number of products.
    pub batch: usize,
}

/// Floating-point operations below which a product stays with Burn's kernels when the products
/// are ordered by host waits: those cost tens of microseconds per product, which a product this
/// small (a LoRA factor, a modulation on the pooled vector) does not win back. 2³³ ≈ 8.6 GFLOP: at FLUX.1
/// size every base projection, attention product and their gradients are routed, no LoRA
/// factor is.
pub const MIN_ROUTED_FLOPS: u64 = 1 << 33;

impl GemmPlan {
    /// Multiply-adds times two, over the whole batch.
    pub fn flops(&self) -> u64 {
        [self.m, self.n, self.k, self.batch]
            .into_iter()
            .fold(2, |acc, v| acc.saturating_mul(v as u64))
    }

    /// Whether the product is large enough to be worth handing to BLAS (see
    /// [`MIN_ROUTED_FLOPS`]).
    pub fn worth_routing(&self) -> bool {
        self.flops() >= MIN_ROUTED_FLOPS
    }
}

/// A matrix (the last two dimensions of an operand) as stored.
#[derive(Debug, Clone, Copy)]
enum Storage {
    /// Rows contiguous: element `(r, c)` at `r · ld + c`.
    RowMajor { ld: usize },
    /// Columns contiguous: element `(r, c)` at `c · ld + r`.
    ColMajor { ld: usize },
}

fn storage(rows: usize, cols: usize, row_stride: usize, col_stride: usize) -> Option<Storage> {
    if cols == 1 || col_stride == 1 {
        let ld = if rows == 1 { cols } else { row_stride };
        if ld >= cols && ld >= 1 {
            return Some(Storage::RowMajor { ld });
        }
    }
    if rows == 1 || row_stride == 1 {
        let ld = if cols == 1 { rows } else { col_stride };
        if ld >= rows && ld >= 1 {
            return Some(Storage::ColMajor { ld });
        }
    }
    None
}

/// The single stride that walks all batch dimensions of an operand in order (0 when the
/// operand is the same matrix for the whole batch), given the broadcast batch shape, or `None`
/// when its batch dimensions do not collapse into one stride.
fn batch_stride(out_batch: &[usize], sizes: &[usize], strides: &[usize]) -> Option<usize> {
    // (stride of the innermost batch dimension, matrices walked so far)
    let mut walk: Option<(usize, usize)> = None;
    for ((&out, &size), &stride) in out_batch.iter().zip(sizes).zip(strides).rev() {
        if out == 1 {
            continue;
        }
        let stride = if size == 1 { 0 } else { stride };
        walk = match walk {
            None => Some((stride, out)),
            Some((base, count)) if stride == base * count => Some((base, count * out)),
            Some(_) => return None,
        };
    }
    Some(walk.map_or(0, |(base, _)| base))
}

/// `layout` with size-1, stride-0 dimensions in front up to `rank`.
fn padded(layout: Layout<'_>, rank: usize) -> (Vec<usize>, Vec<usize>) {
    let missing = rank - layout.shape.len();
    let shape = std::iter::repeat_n(1, missing).chain(layout.shape.iter().copied());
    let strides = std::iter::repeat_n(0, missing).chain(layout.strides.iter().copied());
    (shape.collect(), strides.collect())
}

fn operand(storage: Storage, batch_stride: usize) -> Operand {
    match storage {
        Storage::RowMajor { ld } => Operand {
            transpose: false,
            ld,
            batch_stride,
        },
        Storage::ColMajor { ld } => Operand {
            transpose: true,
            ld,
            batch_stride,
        },
    }
}

/// Plans `lhs · rhs`, or `None` when the layouts cannot be passed to BLAS as they are (the
/// caller then runs Burn's own kernel): ranks below 2, mismatched or empty dimensions, batch
/// dimensions that do not broadcast or do not collapse into one stride, matrices with no unit
/// stride, sizes beyond 32-bit BLAS arguments.
///
/// When `rhs` is one matrix for the whole batch and `lhs`'s rows run on from one matrix to the
/// next (a linear layer on `[batch, tokens, features]`), the batch folds into the rows: one
/// large product instead of many small ones.
pub fn plan(lhs: Layout<'_>, rhs: Layout<'_>) -> Option<GemmPlan> {
    let (lhs_rank, rhs_rank) = (lhs.shape.len(), rhs.shape.len());
    if lhs_rank < 2
        || rhs_rank < 2
        || lhs.strides.len() != lhs_rank
        || rhs.strides.len() != rhs_rank
    {
        return None;
    }
    let rank = lhs_rank.max(rhs_rank);
    let (lhs_shape, lhs_strides) = padded(lhs, rank);
    let (rhs_shape, rhs_strides) = padded(rhs, rank);
    let (m, k) = (lhs_shape[rank - 2], lhs_shape[rank - 1]);
    let n = rhs_shape[rank - 1];
    if rhs_shape[rank - 2] != k || m == 0 || n == 0 || k == 0 {
        return None;
    }
    let mut out_shape = lhs_shape[..rank - 2]
        .iter()
        .zip(&rhs_shape[..rank - 2])
        .map(|(&l, &r)| match (l, r) {
            (l, r) if l == r || r == 1 => Some(l),
            (1, r) => Some(r),
            _ => None,
        })
        .collect::<Option<Vec<_>>>()?;
    let batch: usize = out_shape.iter().product();
    if batch == 0 {
        return None;
    }
    let lhs_batch = batch_stride(&out_shape, &lhs_shape[..rank - 2], &lhs_strides[..rank - 2])?;
    let rhs_batch = batch_stride(&out_shape, &rhs_shape[..rank - 2], &rhs_strides[..rank - 2])?;
    let lhs_storage = storage(m, k, lhs_strides[rank - 2], lhs_strides[rank - 1])?;
    let rhs_storage = storage(k, n, rhs_strides[rank - 2], rhs_strides[rank - 1])?;
    out_shape.extend([m, n]);
    let mut plan = GemmPlan {
        out_shape,
        m: n,
        n: m,
        k,
        a: operand(rhs_storage, rhs_batch),
        b: operand(lhs_storage, lhs_batch),
        ldc: n,
        stride_c: m * n,
        batch,
    };
    if batch > 1 && plan.a.batch_stride == 0 && !plan.b.transpose {
        // A single row needs no row stride of its own: the batch stride can serve as one.
        let row_ld = if m == 1 && lhs_batch >= k {
            lhs_batch
        } else {
            plan.b.ld
        };
        if lhs_batch == m * row_ld {
            plan.b = Operand {
                transpose: false,
                ld: row_ld,
                batch_stride: 0,
            };
            plan.n = m * batch;
            plan.stride_c = plan.m * plan.n;
            plan.batch = 1;
        }
    }
    let fits = |v: usize| i32::try_from(v).is_ok();
    [
        plan.m, plan.n, plan.k, plan.a.ld, plan.b.ld, plan.ldc, plan.batch,
    ]
    .into_iter()
    .all(fits)
    .then_some(plan)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A strided operand: its logical shape and strides over a buffer of distinct values.
    struct Strided {
        shape: Vec<usize>,
        strides: Vec<usize>,
        data: Vec<f64>,
    }

    impl Strided {
        fn new(shape: &[usize], strides: &[usize], seed: u64) -> Self {
            let len = 1 + shape
                .iter()
                .zip(strides)
                .map(|(&d, &s)| d.saturating_sub(1) * s)
                .sum::<usize>();
            let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
            let data = (0..len)
                .map(|_| {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    (state % 2001) as f64 / 1000.0 - 1.0
                })
                .collect();
            Self {
                shape: shape.to_vec(),
                strides: strides.to_vec(),
                data,
            }
        }

        /// Contiguous row-major strides.
        fn contiguous(shape: &[usize], seed: u64) -> Self {
            Self::new(shape, &contiguous_strides(shape), seed)
        }

        /// The view with its last two dimensions swapped, as `swap_dims` makes it.
        fn transposed(mut self) -> Self {
            let r = self.shape.len();
            self.shape.swap(r - 2, r - 1);
            self.strides.swap(r - 2, r - 1);
            self
        }

        fn layout(&self) -> Layout<'_> {
            Layout {
                shape: &self.shape,
                strides: &self.strides,
            }
        }

        /// Element at `index` (right-aligned to the shape, broadcasting size-1 dimensions).
        fn at(&self, index: &[usize]) -> f64 {
            let skip = index.len() - self.shape.len();
            let offset: usize = index[skip..]
                .iter()
                .zip(&self.shape)
                .zip(&self.strides)
                .map(|((&i, &d), &s)| if d == 1 { 0 } else { i * s })
                .sum();
            self.data[offset]
        }
    }

    fn contiguous_strides(shape: &[usize]) -> Vec<usize> {
        let mut strides = vec![1; shape.len()];
        for i in (0..shape.len().saturating_sub(1)).rev() {
            strides[i] = strides[i + 1] * shape[i + 1];
        }
        strides
    }

    /// The product straight from the definition, on the logical elements.
    fn reference(lhs: &Strided, rhs: &Strided, out_shape: &[usize]) -> Vec<f64> {
        let rank = out_shape.len();
        let k = lhs.shape[lhs.shape.len() - 1];
        let total: usize = out_shape.iter().product();
        let strides = contiguous_strides(out_shape);
        (0..total)
            .map(|flat| {
                let index: Vec<usize> = strides
                    .iter()
                    .zip(out_shape)
                    .map(|(&s, &d)| flat / s % d)
                    .collect();
                (0..k)
                    .map(|l| {
                        let mut li = index.clone();
                        li[rank - 1] = l;
                        let mut ri = index.clone();
                        ri[rank - 2] = l;
                        lhs.at(&li) * rhs.at(&ri)
                    })
                    .sum()
            })
            .collect()
    }

    /// The column-major strided-batched GEMM as the BLAS reference defines it, run on the
    /// operands' buffers exactly as the plan describes them.
    fn blas(plan: &GemmPlan, a: &[f64], b: &[f64]) -> Vec<f64> {
        let mut c = vec![f64::NAN; plan.batch * plan.stride_c];
        for p in 0..plan.batch {
            for j in 0..plan.n {
                for i in 0..plan.m {
                    let sum = (0..plan.k)
                        .map(|l| {
                            let (ai, bi) = (
                                if plan.a.transpose {
                                    i * plan.a.ld + l
                                } else {
                                    l * plan.a.ld + i
                                },
                                if plan.b.transpose {
                                    l * plan.b.ld + j
                                } else {
                                    j * plan.b.ld + l
                                },
                            );
                            a[p * plan.a.batch_stride + ai] * b[p * plan.b.batch_stride + bi]
                        })
                        .sum();
                    c[p * plan.stride_c + j * plan.ldc + i] = sum;
                }
            }
        }
        c
    }

    fn check(lhs: &Strided, rhs: &Strided) -> GemmPlan {
        let plan = plan(lhs.layout(), rhs.layout()).expect("a BLAS plan");
        let got = blas(&plan, &rhs.data, &lhs.data);
        let want = reference(lhs, rhs, &plan.out_shape);
        assert_eq!(got.len(), want.len(), "output size for {plan:?}");
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(
                (g - w).abs() <= 1e-12,
                "element {i}: {g} vs {w} in {plan:?}"
            );
        }
        plan
    }

    #[test]
    fn contiguous_matrices_with_odd_sizes() {
        let plan = check(
            &Strided::contiguous(&[5, 7], 1),
            &Strided::contiguous(&[7, 3], 2),
        );
        assert_eq!((plan.m, plan.n, plan.k, plan.batch), (3, 5, 7, 1));
        assert!(!plan.a.transpose && !plan.b.transpose);
        assert_eq!(plan.out_shape, vec![5, 3]);
    }

    #[test]
    fn transposed_views_pass_the_transpose_flag() {
        let rhs_t = Strided::contiguous(&[3, 7], 3).transposed();
        let lhs_t = Strided::contiguous(&[7, 5], 4).transposed();
        let plan = check(&Strided::contiguous(&[5, 7], 1), &rhs_t);
        assert!(plan.a.transpose && !plan.b.transpose);
        let plan = check(&lhs_t, &Strided::contiguous(&[7, 3], 2));
        assert!(!plan.a.transpose && plan.b.transpose);
        let plan = check(&lhs_t, &rhs_t);
        assert!(plan.a.transpose && plan.b.transpose);
    }

    #[test]
    fn row_strides_wider_than_the_row() {
        // A narrowed view: 7 of every 10 columns.
        check(
            &Strided::new(&[5, 7], &[10, 1], 1),
            &Strided::new(&[7, 3], &[4, 1], 2),
        );
    }

    #[test]
    fn attention_scores_and_values() {
        // q · kᵀ over [batch, heads, tokens, head_dim], kᵀ a swapped view; then p · v.
        let q = Strided::contiguous(&[2, 3, 6, 4], 1);
        let k_t = Strided::contiguous(&[2, 3, 5, 4], 2).transposed();
        let plan = check(&q, &k_t);
        assert_eq!(plan.batch, 6);
        assert_eq!(plan.out_shape, vec![2, 3, 6, 5]);
        let p = Strided::contiguous(&[2, 3, 6, 5], 3);
        let v = Strided::contiguous(&[2, 3, 5, 4], 4);
        check(&p, &v);
        // The backward's products: gradᵀ-style views on both sides.
        check(&p.transposed(), &Strided::contiguous(&[2, 3, 6, 4], 5));
    }

    #[test]
    fn a_shared_weight_folds_the_batch_into_rows() {
        // A linear layer: [batch, tokens, d_in] · [d_in, d_out].
        let x = Strided::contiguous(&[2, 3, 6, 7], 1);
        let plan = check(&x, &Strided::contiguous(&[7, 4], 2));
        assert_eq!((plan.batch, plan.n), (1, 36));
        assert_eq!(plan.out_shape, vec![2, 3, 6, 4]);
        // Explicitly broadcast batch dimensions fold too; a transposed weight as well.
        check(&x, &Strided::contiguous(&[1, 1, 7, 4], 3));
        let plan = check(&x, &Strided::contiguous(&[4, 7], 4).transposed());
        assert_eq!((plan.batch, plan.a.transpose), (1, true));
        // Single rows whose batch stride is wider than the row.
        let plan = check(
            &Strided::new(&[3, 1, 7], &[9, 7, 1], 5),
            &Strided::contiguous(&[7, 4], 6),
        );
        assert_eq!((plan.batch, plan.b.ld), (1, 9));
    }

    #[test]
    fn batches_that_cannot_fold_stay_batched() {
        // Transposed activations: each matrix is its own column-major block.
        let x_t = Strided::contiguous(&[3, 7, 5], 1).transposed();
        let plan = check(&x_t, &Strided::contiguous(&[7, 4], 2));
        assert_eq!((plan.batch, plan.a.batch_stride), (3, 0));
        // The lhs shared, the rhs batched.
        let plan = check(
            &Strided::contiguous(&[5, 7], 3),
            &Strided::contiguous(&[3, 7, 4], 4),
        );
        assert_eq!((plan.batch, plan.b.batch_stride), (3, 0));
    }

    #[test]
    fn weight_gradient_from_flattened_activations() {
        // xᵀ · grad over all tokens: [d_in, tokens] · [tokens, d_out].
        let x = Strided::contiguous(&[12, 7], 1).transposed();
        let plan = check(&x, &Strided::contiguous(&[12, 4], 2));
        assert_eq!((plan.m, plan.n, plan.k), (4, 7, 12));
    }

    #[test]
    fn only_products_larger_than_a_lora_factor_are_worth_routing() {
        let linear = |rows: usize, d_in: usize, d_out: usize| {
            let x = Strided::contiguous(&[1, rows, d_in], 1);
            let w = Strided::contiguous(&[d_in, d_out], 2);
            plan(x.layout(), w.layout()).unwrap()
        };
        // FLUX.1 at 1024²: 4096 image tokens, width 3072, LoRA rank 32.
        let projection = linear(4096, 3072, 3072);
        assert_eq!(projection.flops(), 2 * 4096 * 3072 * 3072);
        assert!(projection.worth_routing());
        assert!(linear(512, 3072, 3072).worth_routing());
        assert!(!linear(4096, 3072, 32).worth_routing());
        assert!(!linear(4096, 32, 3072).worth_routing());
        assert!(!linear(1, 3072, 18432).worth_routing());
        let q = Strided::contiguous(&[1, 24, 4608, 128], 3);
        let k_t = Strided::contiguous(&[1, 24, 4608, 128], 4).transposed();
        let scores = plan(q.layout(), k_t.layout()).unwrap();
        assert_eq!(scores.flops(), 2 * 24 * 4608 * 4608 * 128);
        assert!(scores.worth_routing());
    }

    #[test]
    fn layouts_blas_cannot_take_are_refused() {
        let refused = |lhs: &Strided, rhs: &Strided| plan(lhs.layout(), rhs.layout()).is_none();
        let a = Strided::contiguous(&[5, 7], 1);
        // Contracted sizes differ.
        assert!(refused(&a, &Strided::contiguous(&[6, 3], 2)));
        // No unit stride in the matrix.
        assert!(refused(
            &Strided::new(&[5, 7], &[14, 2], 3),
            &Strided::contiguous(&[7, 3], 2)
        ));
        // Rank 1, empty dimensions.
        assert!(refused(
            &Strided::contiguous(&[7], 4),
            &Strided::contiguous(&[7, 3], 2)
        ));
        assert!(refused(
            &Strided::contiguous(&[0, 7], 4),
            &Strided::contiguous(&[7, 3], 2)
        ));
        // Batch dimensions that broadcast against each other in both directions.
        assert!(refused(
            &Strided::contiguous(&[2, 1, 5, 7], 5),
            &Strided::contiguous(&[1, 3, 7, 4], 6)
        ));
        // Batch dimensions that do not broadcast at all.
        assert!(refused(
            &Strided::contiguous(&[2, 5, 7], 5),
            &Strided::contiguous(&[3, 7, 4], 6)
        ));
    }
}
