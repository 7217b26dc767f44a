//! Where the CUDA kernels that CubeCL compiles and autotunes are kept between runs.
//!
//! A fresh process compiles every kernel it meets and times the candidates of each matmul,
//! convolution and reduction shape: minutes for FLUX-sized models. CubeCL stores the autotune
//! results on disk by default, but not the compiled kernels; this turns that on too, under
//! `target/` when run inside a Cargo project and the user's cache folder (`~/.cache/cubecl`)
//! otherwise. A `cubecl.toml` in the working folder or above still decides when it sets a cache.

use cubecl::config::cache::CacheConfig;
use cubecl::config::{CubeClRuntimeConfig, RuntimeConfig};
use cubecl_common::config::logger::LogCrateLevel;

/// Turns on the on-disk kernel cache and sends CubeCL's autotune reports to the log (where
/// `report` counts them for the progress lines); call before any CUDA work. Logs where the
/// caches are.
pub fn persist() {
    let mut config = CubeClRuntimeConfig::from_current_dir().override_from_env();
    config
        .autotune
        .logger
        .log
        .get_or_insert(LogCrateLevel::Info);
    let compiled = config
        .compilation
        .cache
        .get_or_insert(CacheConfig::Target)
        .root();
    let tuned = config.autotune.cache.root();
    tracing::info!(
        "kernel caches: compiled in {}, autotune results in {} (the first steps on a new machine compile and tune kernels, which takes minutes)",
        compiled.display(),
        tuned.display()
    );
    CubeClRuntimeConfig::set(config);
}
