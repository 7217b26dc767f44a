//! The blocks' fused elementwise ops against the separate ops they replace: GELU (tanh), layer
//! norm and the q/k RMS norm with the rotary embedding on `Autodiff<Flex>` (resident, no
//! decorator: burn-kernels records each as one autodiff op with Flex's CPU kernels), and on
//! `Autodiff<Offload<Flex>>` (the decorator forwards to the same kernels), against the same
//! blocks with the fused paths switched off, outputs and input gradients, in f32.

use burn::backend::{Autodiff, Flex};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Distribution, Tensor, TensorData, Tolerance};
use burn_diffusion::blocks::{Rope, gelu_tanh, layer_norm};
use burn_kernels::{KernelOptions, Kernels, counters};
use burn_offload::Offload;

/// Values drawn uniformly from [-4, 4), shaped `shape`; the same data goes to both backends.
fn data(shape: &[usize]) -> TensorData {
    let n: usize = shape.iter().product();
    let values =
        Tensor::<Flex, 1>::random([n], Distribution::Uniform(-4.0, 4.0), &Default::default());
    TensorData::new(values.into_data().to_vec::<f32>().unwrap(), shape.to_vec())
}

/// `f`'s output on `input` and the gradient of `Σ r ∘ f(input)`, on `B` (`f` keeps the shape).
fn run<B: AutodiffBackend, const D: usize>(
    input: &TensorData,
    r: &TensorData,
    f: impl Fn(Tensor<B, D>) -> Tensor<B, D>,
) -> [TensorData; 2] {
    let device = Default::default();
    let x = Tensor::<B, D>::from_data(input.clone(), &device).require_grad();
    let out = f(x.clone());
    let r = Tensor::<B, D>::from_data(r.clone(), &device);
    let grads = (out.clone() * r).sum().backward();
    [
        out.into_data(),
        x.grad(&grads).expect("a gradient").into_data(),
    ]
}

/// Runs `op` fused and with the fused paths off, and compares; the fused side must have run one
/// fused op, the other none.
fn compare<B: AutodiffBackend + Kernels, const D: usize>(
    name: &str,
    input: TensorData,
    op: impl Fn(Tensor<B, D>) -> Tensor<B, D>,
) {
    let r = data(&input.shape);
    let before = counters();
    let [y, dx] = run(&input, &r, &op);
    assert_eq!(
        counters().since(before).fused_elementwise,
        1,
        "{name}: fused"
    );
    let _separate = KernelOptions::separate_ops().install();
    let before = counters();
    let [want_y, want_dx] = run(&input, &r, &op);
    assert_eq!(
        counters().since(before).fused_elementwise,
        0,
        "{name}: separate"
    );
    let tolerance = Tolerance::absolute(2e-5).set_relative(2e-5);
    y.assert_approx_eq::<f32>(&want_y, tolerance);
    dx.assert_approx_eq::<f32>(&want_dx, tolerance);
    eprintln!("{name}: output and gradient match");
}

fn rope<B: Kernels>(tokens: usize) -> Rope<B> {
    let positions: Vec<f64> = (0..tokens)
        .flat_map(|i| [0.0, (i / 3) as f64, (i % 3) as f64])
        .collect();
    Rope::new(&positions, &[4, 6, 6], 10_000.0, &Default::default())
}

fn compare_all<B: AutodiffBackend + Kernels>() {
    compare::<B, 3>("GELU (tanh)", data(&[2, 5, 33]), gelu_tanh);
    compare::<B, 3>("layer norm", data(&[2, 5, 300]), |x| layer_norm(x, 1e-6));
    let (tokens, dim) = (7, 16);
    let scale = data(&[dim]);
    let pe = rope::<B>(tokens);
    compare::<B, 4>(
        "q/k RMS norm + rotary embedding",
        data(&[2, 3, tokens, dim]),
        |x| normalized(&pe, x, &scale),
    );
}

#[test]
fn fused_ops_match_the_separate_ops_resident() {
    compare_all::<Autodiff<Flex>>();
}

#[test]
fn fused_ops_match_the_separate_ops_through_the_decorator() {
    compare_all::<Autodiff<Offload<Flex>>>();
}

/// `pe.apply_normalized` with the scale `scale`.
fn normalized<B: Kernels>(pe: &Rope<B>, x: Tensor<B, 4>, scale: &TensorData) -> Tensor<B, 4> {
    pe.apply_normalized(
        x,
        Tensor::from_data(scale.clone(), &Default::default()),
        1e-6,
    )
}
