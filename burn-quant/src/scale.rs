//! How scales are shared between the values of a tensor.

use std::fmt;
use std::str::FromStr;

use crate::error::QuantError;
use crate::format::Fp8Format;

/// Which values share one scale.
///
/// A tensor of shape `[rows, d1, d2, ..]` is seen as a matrix `[rows, cols]` with
/// `cols = d1 * d2 * ..` (the output dimension first, as in a PyTorch weight).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Granularity {
    /// No scale: values are converted as they are (a unit scale).
    None,
    /// One scale for the whole tensor.
    Tensor,
    /// One scale per output row.
    Row,
    /// One scale per block of 64 consecutive values of a row (the last block may be shorter).
    Block64,
}

impl Granularity {
    /// Every granularity, in a fixed order.
    pub const ALL: [Granularity; 4] = [
        Granularity::None,
        Granularity::Tensor,
        Granularity::Row,
        Granularity::Block64,
    ];

    /// The lowercase name used on the command line and in file metadata.
    pub const fn name(self) -> &'static str {
        match self {
            Granularity::None => "none",
            Granularity::Tensor => "tensor",
            Granularity::Row => "row",
            Granularity::Block64 => "block64",
        }
    }

    /// How the scales of a tensor of this shape are laid out.
    pub fn layout(self, shape: &[usize]) -> ScaleLayout {
        let numel: usize = shape.iter().product();
        let rows = shape.first().copied().unwrap_or(1);
        let cols = numel.checked_div(rows).unwrap_or(0);
        match self {
            Granularity::None | Granularity::Tensor => ScaleLayout {
                rows: 1,
                cols: numel,
                block_len: numel.max(1),
                blocks_per_row: 1,
            },
            Granularity::Row => ScaleLayout {
                rows,
                cols,
                block_len: cols.max(1),
                blocks_per_row: 1,
            },
            Granularity::Block64 => ScaleLayout {
                rows,
                cols,
                block_len: 64,
                blocks_per_row: cols.div_ceil(64),
            },
        }
    }

    /// The shape of the scale tensor stored beside a tensor of this shape, or `None` when no
    /// scale is stored: `[]` per tensor, `[rows, 1]` per row, `[rows, ceil(cols / 64)]` per block.
    pub fn scale_shape(self, shape: &[usize]) -> Option<Vec<usize>> {
        let layout = self.layout(shape);
        match self {
            Granularity::None => None,
            Granularity::Tensor => Some(vec![]),
            Granularity::Row | Granularity::Block64 => {
                Some(vec![layout.rows, layout.blocks_per_row])
            }
        }
    }
}

/// The scale grid of one tensor: value `i` (row-major) uses scale
/// `(i / cols) * blocks_per_row + (i % cols) / block_len`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ScaleLayout {
    /// Rows of the matrix view (1 when one scale covers the tensor).
    pub rows: usize,
    /// Values per row.
    pub cols: usize,
    /// Values per scale block within a row.
    pub block_len: usize,
    /// Scale blocks per row.
    pub blocks_per_row: usize,
}

impl ScaleLayout {
    /// The number of scales.
    pub fn count(&self) -> usize {
        self.rows * self.blocks_per_row
    }

    /// The scale index of value `i`.
    pub fn index_of(&self, i: usize) -> usize {
        (i / self.cols) * self.blocks_per_row + (i % self.cols) / self.block_len
    }
}

/// The scale that maps the largest finite magnitude of a block onto the format's maximum:
/// `amax / max`, or 1 when the block has no non-zero finite value.
pub fn scale_for(amax: f32, format: Fp8Format) -> f32 {
    let scale = amax / format.max();
    if scale > 0.0 && scale.is_finite() {
        scale
    } else {
        1.0
    }
}

impl fmt::Display for Granularity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Granularity {
    type Err = QuantError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Granularity::ALL
            .into_iter()
            .find(|g| g.name().eq_ignore_ascii_case(s))
            .ok_or_else(|| QuantError::UnknownGranularity(s.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_layout_covers_ragged_rows() {
        let layout = Granularity::Block64.layout(&[3, 2, 50]);
        assert_eq!(
            (layout.rows, layout.cols, layout.blocks_per_row),
            (3, 100, 2)
        );
        assert_eq!(layout.count(), 6);
        assert_eq!(layout.index_of(63), 0);
        assert_eq!(layout.index_of(64), 1);
        assert_eq!(layout.index_of(99), 1);
        assert_eq!(layout.index_of(100), 2);
        assert_eq!(layout.index_of(299), 5);
        assert_eq!(
            Granularity::Block64.scale_shape(&[3, 2, 50]),
            Some(vec![3, 2])
        );
    }

    #[test]
    fn row_and_tensor_layouts() {
        let row = Granularity::Row.layout(&[4, 8]);
        assert_eq!(row.count(), 4);
        assert_eq!(row.index_of(17), 2);
        let tensor = Granularity::Tensor.layout(&[4, 8]);
        assert_eq!(tensor.count(), 1);
        assert_eq!(tensor.index_of(31), 0);
        assert_eq!(Granularity::Tensor.scale_shape(&[4, 8]), Some(vec![]));
        assert_eq!(Granularity::None.scale_shape(&[4, 8]), None);
    }

    #[test]
    fn zero_block_has_unit_scale() {
        assert_eq!(scale_for(0.0, Fp8Format::E4M3), 1.0);
        assert_eq!(scale_for(896.0, Fp8Format::E4M3), 2.0);
    }
}
