//! The tiny FLUX.1 and FLUX.2 runs, bit for bit: the losses of their first steps and every
//! tensor of the LoRA each saves are compared with `fixtures/golden/tiny_flux1.json` (written
//! before the trainer's code moved) and `tiny_flux2.json` (written when FLUX.2 was added). A
//! refactoring that changes any number fails here.
//!
//! `BURNLORA_WRITE_GOLDEN=1 cargo test -p burn-lora-train --test tiny_golden` rewrites the
//! files (only for a change that is meant to change the numbers). One test in its own binary,
//! running the two one after the other: the backend's random generator is global to the
//! process.

mod common;

use std::path::Path;

use burn_lora_train::train::Resume;
use common::{example_plan, run, weights};

/// FNV-1a over the words, so that the file stays small and any changed bit shows.
fn fnv(words: impl IntoIterator<Item = u32>) -> String {
    let mut hash = 0xcbf2_9ce4_8422_2325_u64;
    for word in words {
        for byte in word.to_le_bytes() {
            hash = (hash ^ byte as u64).wrapping_mul(0x0100_0000_01b3);
        }
    }
    format!("{hash:016x}")
}

#[test]
fn the_tiny_runs_are_bit_identical_to_their_records() {
    check("config.yaml", "tiny_flux1.json");
    check("flux2.yaml", "tiny_flux2.json");
}

/// Three steps of `examples/tiny/<example>` against `fixtures/golden/<record>`.
fn check(example: &str, record_file: &str) {
    let dir = tempfile::tempdir().unwrap();
    let plan = example_plan(example, dir.path(), 3);
    let summary = run(&plan, Resume::Auto).unwrap();
    let losses: Vec<String> = summary
        .losses
        .iter()
        .map(|l| format!("{:016x}", l.to_bits()))
        .collect();
    let mut tensors: Vec<(String, String)> = weights(&summary.lora.unwrap())
        .into_iter()
        .map(|(name, role, bits)| (format!("{name} {role:?}"), fnv(bits)))
        .collect();
    tensors.sort();
    let record = serde_json::json!({
        "losses": losses,
        "tensors": tensors
            .into_iter()
            .map(|(k, v)| (k, serde_json::Value::String(v)))
            .collect::<serde_json::Map<_, _>>(),
    });
    let file = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/golden")
        .join(record_file);
    if std::env::var_os("BURNLORA_WRITE_GOLDEN").is_some() {
        std::fs::write(&file, serde_json::to_string_pretty(&record).unwrap() + "\n").unwrap();
    }
    let expected: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
    assert_eq!(
        record["losses"], expected["losses"],
        "{example}: losses (f64 bits)"
    );
    assert_eq!(
        record["tensors"], expected["tensors"],
        "{example}: LoRA tensors (FNV-1a of f32 bits)"
    );
}
