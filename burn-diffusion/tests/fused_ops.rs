//! The fused elementwise ops (`BURN_LORA_FUSED=1`) against the separate ops they replace: GELU
//! (tanh), layer norm and the q/k RMS norm with the rotary embedding, on `Autodiff<Offload<Flex>>`
//! (where burn-offload records each as one autodiff op with Flex's CPU kernels) and on
//! `Autodiff<Flex>` (the separate ops), outputs and input gradients, in f32.

use burn::backend::{Autodiff, Flex};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Distribution, Tensor, TensorData, Tolerance};
use burn_diffusion::blocks::{Rope, gelu_tanh, layer_norm};
use burn_offload::{Offload, fused_elementwise_calls};

type Fused = Autodiff<Offload<Flex>>;
type Separate = Autodiff<Flex>;

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

/// Runs `op` both ways and compares; the fused side must have run one fused op.
fn compare<const D: usize>(
    name: &str,
    input: TensorData,
    fused: impl Fn(Tensor<Fused, D>) -> Tensor<Fused, D>,
    separate: impl Fn(Tensor<Separate, D>) -> Tensor<Separate, D>,
) {
    let r = data(&input.shape);
    let calls = fused_elementwise_calls();
    let [y, dx] = run(&input, &r, fused);
    assert!(
        fused_elementwise_calls() > calls,
        "{name}: the fused op did not run"
    );
    let [want_y, want_dx] = run(&input, &r, separate);
    let tolerance = Tolerance::absolute(2e-5).set_relative(2e-5);
    y.assert_approx_eq::<f32>(&want_y, tolerance);
    dx.assert_approx_eq::<f32>(&want_dx, tolerance);
    eprintln!("{name}: output and gradient match");
}

fn rope<B: Backend>(tokens: usize) -> Rope<B> {
    let positions: Vec<f64> = (0..tokens)
        .flat_map(|i| [0.0, (i / 3) as f64, (i % 3) as f64])
        .collect();
    Rope::new(&positions, &[4, 6, 6], 10_000.0, &Default::default())
}

#[test]
fn fused_ops_match_the_separate_ops() {
    // SAFETY: this binary's only test sets the variable before anything reads the environment.
    unsafe { std::env::set_var("BURN_LORA_FUSED", "1") };

    compare::<3>("GELU (tanh)", data(&[2, 5, 33]), gelu_tanh, gelu_tanh);
    compare::<3>(
        "layer norm",
        data(&[2, 5, 300]),
        |x| layer_norm(x, 1e-6),
        |x| layer_norm(x, 1e-6),
    );
    let (tokens, dim) = (7, 16);
    let scale = data(&[dim]);
    let (pe_fused, pe_separate) = (rope::<Fused>(tokens), rope::<Separate>(tokens));
    compare::<4>(
        "q/k RMS norm + rotary embedding",
        data(&[2, 3, tokens, dim]),
        |x| normalized(&pe_fused, x, &scale),
        |x| normalized(&pe_separate, x, &scale),
    );
}

/// `pe.apply_normalized` with the scale `scale`.
fn normalized<B: Backend>(pe: &Rope<B>, x: Tensor<B, 4>, scale: &TensorData) -> Tensor<B, 4> {
    pe.apply_normalized(
        x,
        Tensor::from_data(scale.clone(), &Default::default()),
        1e-6,
    )
}
