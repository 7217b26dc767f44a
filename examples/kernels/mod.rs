//! The GPU examples' kernel options, from the variables `burnlora train` reads for its
//! `kernels` section: `BURNLORA_KERNELS__BLAS` (`auto`, `off`, `large`, `all`),
//! `BURNLORA_KERNELS__ATTENTION` (`fused`, `kernels`, `separate`),
//! `BURNLORA_KERNELS__ELEMENTWISE` (`fused`, `separate`),
//! `BURNLORA_KERNELS__ORDER` (`device`, `host`).

use burn_kernels::{Installed, KernelOptions};

/// Installs the options the environment sets (the rest at their defaults) for this thread, and
/// prints them; exits with a message on a value that names no choice.
pub fn install_from_env() -> Installed {
    let var = |name: &str| std::env::var(format!("BURNLORA_KERNELS__{name}")).ok();
    let fused = |name: &str, default: bool| match var(name).as_deref() {
        None => default,
        Some("fused") => true,
        Some("separate") => false,
        Some(other) => fail(name, other, "fused, separate"),
    };
    let defaults = KernelOptions::fast();
    let options = KernelOptions {
        blas: var("BLAS").map_or(defaults.blas, |v| {
            v.parse()
                .unwrap_or_else(|e| fail("BLAS", &v, &format!("{e}")))
        }),
        attention: var("ATTENTION").map_or(defaults.attention, |v| {
            v.parse()
                .unwrap_or_else(|e| fail("ATTENTION", &v, &format!("{e}")))
        }),
        fused_elementwise: fused("ELEMENTWISE", defaults.fused_elementwise),
        order: var("ORDER").map_or(defaults.order, |v| {
            v.parse()
                .unwrap_or_else(|e| fail("ORDER", &v, &format!("{e}")))
        }),
    };
    eprintln!("kernels: {options}");
    options.install()
}

fn fail(name: &str, value: &str, accepted: &str) -> ! {
    eprintln!("BURNLORA_KERNELS__{name}={value}: expected {accepted}");
    std::process::exit(2)
}
