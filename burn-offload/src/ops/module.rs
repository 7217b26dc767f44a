//! `ModuleOps`: the linear ops and the 2-D convolution (forward and input gradient) stream
//! their weight; they go through burn-kernels' `products` (the vendor BLAS and DNN library);
//! everything else is forwarded to the inner backend (a streamed weight met there is
//! materialized).

use burn::tensor::TensorMetadata;
use burn::tensor::ops::{
    AttentionModuleOptions, BoolTensor, ConvOptions, ConvTransposeOptions, DeformConv2dBackward,
    DeformConvOptions, FloatTensor, IntTensor, InterpolateOptions, MaxPool1dBackward,
    MaxPool1dWithIndices, MaxPool2dBackward, MaxPool2dWithIndices, ModuleOps, UnfoldOptions,
};
use burn_kernels::{ConvGrad, KernelOptions, products};

use super::{
    forward, keep, lift, lift_deform_backward, lift_pair, lift_pool1d, lift_pool1d_backward,
    lift_pool2d, lift_pool2d_backward, lower, lower_opt,
};
use crate::backend::{Offload, OffloadTensor, PrefetchPolicy};
use crate::target::StreamTarget;

/// FLOP of a linear op whose activation (input, or output gradient) is `activation` and whose
/// weight has shape `weight`: each activation element meets the weight's other dimension.
pub(crate) fn linear_flops(
    activation: &OffloadTensor<impl StreamTarget>,
    weight: &[usize],
    along: usize,
) -> f64 {
    2.0 * activation.shape().num_elements() as f64 * weight[along] as f64
}

impl<B: StreamTarget, P: PrefetchPolicy> ModuleOps<Self> for Offload<B, P> {
    fn linear(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
    ) -> FloatTensor<Self> {
        let options = KernelOptions::current();
        let bias = lower_opt(bias);
        let Some(streamed) = weight.as_streamed() else {
            return lift(products::linear::<B>(
                lower(x),
                lower(weight),
                bias,
                &options,
            ));
        };
        // Burn's layout: weight [d_input, d_output].
        let flops = linear_flops(&x, &streamed.weight.shape, 1);
        let x = lower(x);
        lift(
            streamed
                .engine
                .with_weight(&streamed.weight, flops, P::depth, |w| {
                    products::linear::<B>(x, w, bias, &options)
                }),
        )
    }

    fn linear_x_backward(
        weight: FloatTensor<Self>,
        output_grad: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        let options = KernelOptions::current();
        let Some(streamed) = weight.as_streamed() else {
            return lift(products::linear_x_backward::<B>(
                lower(weight),
                lower(output_grad),
                &options,
            ));
        };
        let flops = linear_flops(&output_grad, &streamed.weight.shape, 0);
        let grad = lower(output_grad);
        lift(
            streamed
                .engine
                .with_weight(&streamed.weight, flops, P::depth, |w| {
                    products::linear_x_backward::<B>(w, grad, &options)
                }),
        )
    }

    fn linear_weight_backward(
        x: FloatTensor<Self>,
        output_grad: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        lift(products::linear_weight_backward::<B>(
            lower(x),
            lower(output_grad),
            &KernelOptions::current(),
        ))
    }

    fn conv2d(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: Option<FloatTensor<Self>>,
        options: ConvOptions<2>,
    ) -> FloatTensor<Self> {
        let kernel_options = KernelOptions::current();
        let (x, bias) = (lower(x), lower_opt(bias));
        let Some(streamed) = weight.as_streamed() else {
            return lift(products::conv2d::<B>(
                x,
                lower(weight),
                bias,
                options,
                &kernel_options,
            ));
        };
        let flops = conv2d_flops(&x.shape().dims::<4>(), &streamed.weight.shape, &options);
        lift(
            streamed
                .engine
                .with_weight(&streamed.weight, flops, P::depth, |w| {
                    products::conv2d::<B>(x, w, bias, options, &kernel_options)
                }),
        )
    }

    fn conv2d_x_backward(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        output_grad: FloatTensor<Self>,
        options: ConvOptions<2>,
    ) -> FloatTensor<Self> {
        let Some(streamed) = weight.as_streamed() else {
            return conv2d_backward::<B>(x, weight, output_grad, options, ConvGrad::Input);
        };
        let kernel_options = KernelOptions::current();
        let flops = conv2d_flops(&x.shape().dims::<4>(), &streamed.weight.shape, &options);
        let (x, grad) = (lower(x), lower(output_grad));
        lift(
            streamed
                .engine
                .with_weight(&streamed.weight, flops, P::depth, |w| {
                    products::conv2d_backward::<B>(
                        x,
                        w,
                        grad,
                        options,
                        ConvGrad::Input,
                        &kernel_options,
                    )
                }),
        )
    }

    fn conv2d_weight_backward(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        output_grad: FloatTensor<Self>,
        options: ConvOptions<2>,
    ) -> FloatTensor<Self> {
        conv2d_backward::<B>(x, weight, output_grad, options, ConvGrad::Weight)
    }

    forward! {
        lift fn embedding(
            lower weights: FloatTensor<Self>,
            keep indices: IntTensor<Self>,
        ) -> FloatTensor<Self>;
        lift fn embedding_backward(
            lower weights: FloatTensor<Self>,
            lower output_grad: FloatTensor<Self>,
            keep indices: IntTensor<Self>,
        ) -> FloatTensor<Self>;
        lift fn linear_bias_backward(lower output_grad: FloatTensor<Self>) -> FloatTensor<Self>;
        lift fn conv1d(
            lower x: FloatTensor<Self>,
            lower weight: FloatTensor<Self>,
            lower_opt bias: Option<FloatTensor<Self>>,
            keep options: ConvOptions<1>,
        ) -> FloatTensor<Self>;
        lift fn conv1d_x_backward(
            lower x: FloatTensor<Self>,
            lower weight: FloatTensor<Self>,
            lower output_grad: FloatTensor<Self>,
            keep options: ConvOptions<1>,
        ) -> FloatTensor<Self>;
        lift fn conv1d_weight_backward(
            lower x: FloatTensor<Self>,
            lower weight: FloatTensor<Self>,
            lower output_grad: FloatTensor<Self>,
            keep options: ConvOptions<1>,
        ) -> FloatTensor<Self>;
        lift fn conv1d_bias_backward(
            lower x: FloatTensor<Self>,
            lower bias: FloatTensor<Self>,
            lower output_grad: FloatTensor<Self>,
        ) -> FloatTensor<Self>;
        lift fn conv2d_bias_backward(
            lower x: FloatTensor<Self>,
            lower bias: FloatTensor<Self>,
            lower output_grad: FloatTensor<Self>,
        ) -> FloatTensor<Self>;
        lift fn deform_conv2d(
            lower x: FloatTensor<Self>,
            lower offset: FloatTensor<Self>,
            lower weight: FloatTensor<Self>,
            lower_opt mask: Option<FloatTensor<Self>>,
            lower_opt bias: Option<FloatTensor<Self>>,
            keep options: DeformConvOptions<2>,
        ) -> FloatTensor<Self>;
        lift_deform_backward fn deform_conv2d_backward(
            lower x: FloatTensor<Self>,
            lower offset: FloatTensor<Self>,
            lower weight: FloatTensor<Self>,
            lower_opt mask: Option<FloatTensor<Self>>,
            lower_opt bias: Option<FloatTensor<Self>>,
            lower output_grad: FloatTensor<Self>,
            keep options: DeformConvOptions<2>,
        ) -> DeformConv2dBackward<Self>;
        lift fn conv3d(
            lower x: FloatTensor<Self>,
            lower weight: FloatTensor<Self>,
            lower_opt bias: Option<FloatTensor<Self>>,
            keep options: ConvOptions<3>,
        ) -> FloatTensor<Self>;
        lift fn conv3d_x_backward(
            lower x: FloatTensor<Self>,
            lower weight: FloatTensor<Self>,
            lower output_grad: FloatTensor<Self>,
            keep options: ConvOptions<3>,
        ) -> FloatTensor<Self>;
        lift fn conv3d_weight_backward(
            lower x: FloatTensor<Self>,
            lower weight: FloatTensor<Self>,
            lower output_grad: FloatTensor<Self>,
            keep options: ConvOptions<3>,
        ) -> FloatTensor<Self>;
        lift fn conv3d_bias_backward(
            lower x: FloatTensor<Self>,
            lower bias: FloatTensor<Self>,
            lower output_grad: FloatTensor<Self>,
        ) -> FloatTensor<Self>;
        lift fn conv_transpose1d(
            lower x: FloatTensor<Self>,
            lower weight: FloatTensor<Self>,
            lower_opt bias: Option<FloatTensor<Self>>,
            keep options: ConvTransposeOptions<1>,
        ) -> FloatTensor<Self>;
        lift fn conv_transpose1d_x_backward(
            lower weight: FloatTensor<Self>,
            lower output_grad: FloatTensor<Self>,
            keep options: ConvTransposeOptions<1>,
        ) -> FloatTensor<Self>;
        lift fn conv_transpose1d_weight_backward(
            lower x: FloatTensor<Self>,
            lower weight: FloatTensor<Self>,
            lower output_grad: FloatTensor<Self>,
            keep options: ConvTransposeOptions<1>,
        ) -> FloatTensor<Self>;
        lift fn conv_transpose1d_bias_backward(
            lower x: FloatTensor<Self>,
            lower bias: FloatTensor<Self>,
            lower output_grad: FloatTensor<Self>,
        ) -> FloatTensor<Self>;
        lift fn conv_transpose2d(
            lower x: FloatTensor<Self>,
            lower weight: FloatTensor<Self>,
            lower_opt bias: Option<FloatTensor<Self>>,
            keep options: ConvTransposeOptions<2>,
        ) -> FloatTensor<Self>;
        lift fn conv_transpose2d_x_backward(
            lower weight: FloatTensor<Self>,
            lower output_grad: FloatTensor<Self>,
            keep options: ConvTransposeOptions<2>,
        ) -> FloatTensor<Self>;
        lift fn conv_transpose2d_weight_backward(
            lower x: FloatTensor<Self>,
            lower weight: FloatTensor<Self>,
            lower output_grad: FloatTensor<Self>,
            keep options: ConvTransposeOptions<2>,
        ) -> FloatTensor<Self>;
        lift fn conv_transpose2d_bias_backward(
            lower x: FloatTensor<Self>,
            lower bias: FloatTensor<Self>,
            lower output_grad: FloatTensor<Self>,
        ) -> FloatTensor<Self>;
        lift fn conv_transpose3d(
            lower x: FloatTensor<Self>,
            lower weight: FloatTensor<Self>,
            lower_opt bias: Option<FloatTensor<Self>>,
            keep options: ConvTransposeOptions<3>,
        ) -> FloatTensor<Self>;
        lift fn conv_transpose3d_x_backward(
            lower weight: FloatTensor<Self>,
            lower output_grad: FloatTensor<Self>,
            keep options: ConvTransposeOptions<3>,
        ) -> FloatTensor<Self>;
        lift fn conv_transpose3d_weight_backward(
            lower x: FloatTensor<Self>,
            lower weight: FloatTensor<Self>,
            lower output_grad: FloatTensor<Self>,
            keep options: ConvTransposeOptions<3>,
        ) -> FloatTensor<Self>;
        lift fn conv_transpose3d_bias_backward(
            lower x: FloatTensor<Self>,
            lower bias: FloatTensor<Self>,
            lower output_grad: FloatTensor<Self>,
        ) -> FloatTensor<Self>;
        lift fn unfold4d(
            lower x: FloatTensor<Self>,
            keep kernel_size: [usize; 2],
            keep options: UnfoldOptions,
        ) -> FloatTensor<Self>;
        lift fn avg_pool1d(
            lower x: FloatTensor<Self>,
            keep kernel_size: usize,
            keep stride: usize,
            keep padding: usize,
            keep count_include_pad: bool,
            keep ceil_mode: bool,
        ) -> FloatTensor<Self>;
        lift fn avg_pool1d_backward(
            lower x: FloatTensor<Self>,
            lower grad: FloatTensor<Self>,
            keep kernel_size: usize,
            keep stride: usize,
            keep padding: usize,
            keep count_include_pad: bool,
            keep ceil_mode: bool,
        ) -> FloatTensor<Self>;
        lift fn avg_pool2d(
            lower x: FloatTensor<Self>,
            keep kernel_size: [usize; 2],
            keep stride: [usize; 2],
            keep padding: [usize; 2],
            keep count_include_pad: bool,
            keep ceil_mode: bool,
        ) -> FloatTensor<Self>;
        lift fn avg_pool2d_backward(
            lower x: FloatTensor<Self>,
            lower grad: FloatTensor<Self>,
            keep kernel_size: [usize; 2],
            keep stride: [usize; 2],
            keep padding: [usize; 2],
            keep count_include_pad: bool,
            keep ceil_mode: bool,
        ) -> FloatTensor<Self>;
        lift fn adaptive_avg_pool2d(
            lower x: FloatTensor<Self>,
            keep output_size: [usize; 2],
        ) -> FloatTensor<Self>;
        lift fn adaptive_avg_pool2d_backward(
            lower x: FloatTensor<Self>,
            lower grad: FloatTensor<Self>,
        ) -> FloatTensor<Self>;
        lift fn adaptive_avg_pool1d(
            lower x: FloatTensor<Self>,
            keep output_size: usize,
        ) -> FloatTensor<Self>;
        lift fn adaptive_avg_pool1d_backward(
            lower x: FloatTensor<Self>,
            lower grad: FloatTensor<Self>,
        ) -> FloatTensor<Self>;
        lift fn max_pool1d(
            lower x: FloatTensor<Self>,
            keep kernel_size: usize,
            keep stride: usize,
            keep padding: usize,
            keep dilation: usize,
            keep ceil_mode: bool,
        ) -> FloatTensor<Self>;
        lift_pool1d fn max_pool1d_with_indices(
            lower x: FloatTensor<Self>,
            keep kernel_size: usize,
            keep stride: usize,
            keep padding: usize,
            keep dilation: usize,
            keep ceil_mode: bool,
        ) -> MaxPool1dWithIndices<Self>;
        #[allow(clippy::too_many_arguments)]
        lift_pool1d_backward fn max_pool1d_with_indices_backward(
            lower x: FloatTensor<Self>,
            keep kernel_size: usize,
            keep stride: usize,
            keep padding: usize,
            keep dilation: usize,
            keep ceil_mode: bool,
            lower output_grad: FloatTensor<Self>,
            keep indices: IntTensor<Self>,
        ) -> MaxPool1dBackward<Self>;
        lift fn max_pool2d(
            lower x: FloatTensor<Self>,
            keep kernel_size: [usize; 2],
            keep stride: [usize; 2],
            keep padding: [usize; 2],
            keep dilation: [usize; 2],
            keep ceil_mode: bool,
        ) -> FloatTensor<Self>;
        lift_pool2d fn max_pool2d_with_indices(
            lower x: FloatTensor<Self>,
            keep kernel_size: [usize; 2],
            keep stride: [usize; 2],
            keep padding: [usize; 2],
            keep dilation: [usize; 2],
            keep ceil_mode: bool,
        ) -> MaxPool2dWithIndices<Self>;
        #[allow(clippy::too_many_arguments)]
        lift_pool2d_backward fn max_pool2d_with_indices_backward(
            lower x: FloatTensor<Self>,
            keep kernel_size: [usize; 2],
            keep stride: [usize; 2],
            keep padding: [usize; 2],
            keep dilation: [usize; 2],
            keep ceil_mode: bool,
            lower output_grad: FloatTensor<Self>,
            keep indices: IntTensor<Self>,
        ) -> MaxPool2dBackward<Self>;
        lift fn interpolate(
            lower x: FloatTensor<Self>,
            keep output_size: [usize; 2],
            keep options: InterpolateOptions,
        ) -> FloatTensor<Self>;
        lift fn interpolate_backward(
            lower x: FloatTensor<Self>,
            lower grad: FloatTensor<Self>,
            keep output_size: [usize; 2],
            keep options: InterpolateOptions,
        ) -> FloatTensor<Self>;
        lift fn attention(
            lower query: FloatTensor<Self>,
            lower key: FloatTensor<Self>,
            lower value: FloatTensor<Self>,
            keep mask: Option<BoolTensor<Self>>,
            lower_opt attn_bias: Option<FloatTensor<Self>>,
            keep options: AttentionModuleOptions,
        ) -> FloatTensor<Self>;
        lift fn layer_norm(
            lower tensor: FloatTensor<Self>,
            lower gamma: FloatTensor<Self>,
            lower_opt beta: Option<FloatTensor<Self>>,
            keep epsilon: f64,
        ) -> FloatTensor<Self>;
        lift fn ctc_loss(
            lower log_probs: FloatTensor<Self>,
            keep targets: IntTensor<Self>,
            keep input_lengths: IntTensor<Self>,
            keep target_lengths: IntTensor<Self>,
            keep blank: usize,
        ) -> FloatTensor<Self>;
        keep fn has_ctc_loss_backward() -> bool;
        lift fn ctc_loss_backward(
            lower log_probs: FloatTensor<Self>,
            keep targets: IntTensor<Self>,
            keep input_lengths: IntTensor<Self>,
            keep target_lengths: IntTensor<Self>,
            lower grad_loss: FloatTensor<Self>,
            keep blank: usize,
        ) -> FloatTensor<Self>;
        lift_pair fn rfft(
            lower signal: FloatTensor<Self>,
            keep dim: usize,
            keep n: Option<usize>,
        ) -> (FloatTensor<Self>, FloatTensor<Self>);
        lift fn irfft(
            lower spectrum_re: FloatTensor<Self>,
            lower spectrum_im: FloatTensor<Self>,
            keep dim: usize,
            keep n: Option<usize>,
        ) -> FloatTensor<Self>;
    }
}

/// FLOP of a 2-D convolution of an input of shape `x` (`[n, c, h, w]`) with a weight of shape
/// `weight` (`[c_out, c / groups, kh, kw]`) under `options`: each output element meets one
/// kernel window of its group's input channels (its input gradient costs the same).
fn conv2d_flops(x: &[usize], weight: &[usize], options: &ConvOptions<2>) -> f64 {
    let out = |size: usize, axis: usize| {
        let reach = options.dilation[axis] * (weight[2 + axis] - 1) + 1;
        (size + 2 * options.padding[axis]).saturating_sub(reach) / options.stride[axis] + 1
    };
    let outputs = x[0] * weight[0] * out(x[2], 0) * out(x[3], 1);
    2.0 * outputs as f64 * (weight[1] * weight[2] * weight[3]) as f64
}

/// `wanted` of a convolution's gradients on the inner backend ([`products::conv2d_backward`]).
fn conv2d_backward<B: StreamTarget>(
    x: OffloadTensor<B>,
    weight: OffloadTensor<B>,
    output_grad: OffloadTensor<B>,
    options: ConvOptions<2>,
    wanted: ConvGrad,
) -> OffloadTensor<B> {
    lift(products::conv2d_backward::<B>(
        lower(x),
        lower(weight),
        lower(output_grad),
        options,
        wanted,
        &KernelOptions::current(),
    ))
}
