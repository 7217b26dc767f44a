//! The layout of a 2-D convolution as a vendor DNN library takes it (cuDNN's legacy API: NCHW,
//! 32-bit sizes), planned without a device so that it is tested everywhere.

use burn::tensor::Shape;
use burn::tensor::ops::ConvOptions;

/// The sizes of one 2-D convolution as cuDNN takes them.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct ConvPlan {
    /// Input `[batch, channels, height, width]`.
    pub x: [i32; 4],
    /// Filter `[out channels, in channels / groups, kernel height, kernel width]`.
    pub w: [i32; 4],
    /// Output `[batch, out channels, height, width]`.
    pub y: [i32; 4],
    /// Zeros added on each side, per spatial dimension.
    pub padding: [i32; 2],
    /// Step between outputs, per spatial dimension.
    pub stride: [i32; 2],
    /// Spacing of the kernel's taps, per spatial dimension.
    pub dilation: [i32; 2],
    /// Groups the channels split into.
    pub groups: i32,
}

impl ConvPlan {
    /// The convolution of an `x`-shaped input with a `w`-shaped filter under `options`, `None`
    /// where the shapes do not agree, the output would be empty or a size overflows an i32.
    pub(crate) fn new(x: &[usize], w: &[usize], options: &ConvOptions<2>) -> Option<Self> {
        let ([n, c, h, wd], [k, cg, r, s]) = (<[usize; 4]>::try_from(x).ok()?, w.try_into().ok()?);
        let groups = options.groups;
        if groups == 0 || c != cg * groups || k % groups != 0 {
            return None;
        }
        let out = |size: usize, i: usize, kernel: usize| {
            let span = options.dilation[i] * kernel.checked_sub(1)? + 1;
            let room = (size + 2 * options.padding[i]).checked_sub(span)?;
            Some(room / options.stride[i] + 1)
        };
        let y = [n, k, out(h, 0, r)?, out(wd, 1, s)?];
        let int = |v: usize| i32::try_from(v).ok();
        let ints = |a: [usize; 4]| Some([int(a[0])?, int(a[1])?, int(a[2])?, int(a[3])?]);
        let pair = |a: [usize; 2]| Some([int(a[0])?, int(a[1])?]);
        // Element counts must fit too: cuDNN's legacy API indexes with 32-bit integers.
        let fits = |a: [usize; 4]| int(a.iter().product()).is_some();
        if !(fits([n, c, h, wd]) && fits(y) && fits([k, cg, r, s])) {
            return None;
        }
        Some(Self {
            x: ints([n, c, h, wd])?,
            w: ints([k, cg, r, s])?,
            y: ints(y)?,
            padding: pair(options.padding)?,
            stride: pair(options.stride)?,
            dilation: pair(options.dilation)?,
            groups: int(groups)?,
        })
    }

    /// The output's shape.
    pub(crate) fn output_shape(&self) -> Shape {
        Shape::from(self.y.map(|v| v as usize).to_vec())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn options(stride: usize, padding: usize, dilation: usize, groups: usize) -> ConvOptions<2> {
        ConvOptions::new([stride; 2], [padding; 2], [dilation; 2], groups)
    }

    #[test]
    fn output_sizes_follow_the_convolution_arithmetic() {
        let shape = ConvPlan::new(&[2, 8, 9, 10], &[4, 8, 3, 3], &options(2, 1, 1, 1)).unwrap();
        assert_eq!(shape.output_shape(), Shape::new([2, 4, 5, 5]));
        let shape = ConvPlan::new(&[1, 8, 9, 9], &[8, 2, 3, 3], &options(1, 0, 2, 4)).unwrap();
        assert_eq!(shape.y, [1, 8, 5, 5]);
        assert_eq!(shape.groups, 4);
    }

    #[test]
    fn shapes_cudnn_cannot_take_are_refused() {
        // Channels that do not match the filter's under the groups.
        assert!(ConvPlan::new(&[1, 6, 8, 8], &[4, 4, 3, 3], &options(1, 1, 1, 2)).is_none());
        // A kernel larger than the padded input.
        assert!(ConvPlan::new(&[1, 1, 2, 2], &[1, 1, 5, 5], &options(1, 0, 1, 1)).is_none());
        // More elements than 32-bit indices reach.
        assert!(
            ConvPlan::new(
                &[1, 1 << 16, 1 << 8, 1 << 8],
                &[1, 1 << 16, 1, 1],
                &options(1, 0, 1, 1)
            )
            .is_none()
        );
    }
}
