//! Wan's original tensor names (Wan-Video's checkpoints, ComfyUI's repackaged files, with or
//! without `model.diffusion_model.`) and the diffusers names the model's fields follow.

use std::path::Path;

use burn_quant::Checkpoint;
use serde::Deserialize;

use crate::weights::{component_folder, read_json};

/// The prefix ComfyUI's all-in-one files put before the transformer's names.
const COMFY_PREFIX: &str = "model.diffusion_model.";

/// Original prefixes outside the blocks and their diffusers names.
const TOP: [(&str, &str); 7] = [
    (
        "time_embedding.0.",
        "condition_embedder.time_embedder.linear_1.",
    ),
    (
        "time_embedding.2.",
        "condition_embedder.time_embedder.linear_2.",
    ),
    (
        "text_embedding.0.",
        "condition_embedder.text_embedder.linear_1.",
    ),
    (
        "text_embedding.2.",
        "condition_embedder.text_embedder.linear_2.",
    ),
    ("time_projection.1.", "condition_embedder.time_proj."),
    ("head.head.", "proj_out."),
    ("head.modulation", "scale_shift_table"),
];

/// Original prefixes inside a block and their diffusers names (the original's `norm3` is the
/// cross-attention's norm, diffusers' `norm2`).
const BLOCK: [(&str, &str); 4] = [
    ("norm3.", "norm2."),
    ("ffn.0.", "ffn.net.0.proj."),
    ("ffn.2.", "ffn.net.2."),
    ("modulation", "scale_shift_table"),
];

/// The two attentions of a block.
const ATTENTIONS: [(&str, &str); 2] = [("self_attn.", "attn1."), ("cross_attn.", "attn2.")];

/// An attention's projections.
const PROJECTIONS: [(&str, &str); 4] = [
    ("q.", "to_q."),
    ("k.", "to_k."),
    ("v.", "to_v."),
    ("o.", "to_out.0."),
];

/// `name` with the first prefix of `table` it starts with replaced by that prefix's new name.
fn renamed(name: &str, table: &[(&str, &str)]) -> Option<String> {
    table
        .iter()
        .find_map(|(from, to)| name.strip_prefix(from).map(|rest| format!("{to}{rest}")))
}

/// The diffusers name of a tensor of Wan's original layout; any other name (diffusers' own
/// among them) is kept, so that a file under diffusers' names loads too and an unknown name is
/// reported by the loader.
pub fn diffusers_name(original: &str) -> String {
    let name = original.strip_prefix(COMFY_PREFIX).unwrap_or(original);
    if let Some(name) = renamed(name, &TOP) {
        return name;
    }
    let Some((index, inner)) = name
        .strip_prefix("blocks.")
        .and_then(|rest| rest.split_once('.'))
    else {
        return name.to_string();
    };
    let inner = match ATTENTIONS
        .iter()
        .find_map(|(from, to)| inner.strip_prefix(from).map(|rest| (to, rest)))
    {
        Some((attention, rest)) => {
            format!(
                "{attention}{}",
                renamed(rest, &PROJECTIONS).unwrap_or(rest.into())
            )
        }
        None => renamed(inner, &BLOCK).unwrap_or(inner.into()),
    };
    format!("blocks.{index}.{inner}")
}

/// The class name in a diffusers `config.json`.
#[derive(Deserialize)]
struct ClassName {
    #[serde(rename = "_class_name")]
    class_name: String,
}

/// Whether `path` holds a Wan transformer: a diffusers folder (or its `transformer` folder)
/// whose `config.json` names `WanTransformer3DModel`, or a single file holding Wan's timestep
/// projection under either layout's name.
pub fn holds_wan(path: &Path) -> bool {
    if path.is_dir() {
        return component_folder(path, "transformer")
            .and_then(|folder| read_json::<ClassName>(&folder.join("config.json")).ok())
            .is_some_and(|config| config.class_name == "WanTransformer3DModel");
    }
    Checkpoint::open(path).is_ok_and(|files| {
        files
            .tensors()
            .any(|t| diffusers_name(t.name) == "condition_embedder.time_proj.weight")
    })
}
