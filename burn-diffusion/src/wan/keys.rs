//! Wan's original tensor names (Wan-Video's checkpoints, ComfyUI's repackaged files, with or
//! without `model.diffusion_model.`) and the diffusers names the model's fields follow.

use std::path::Path;

use burn_quant::Checkpoint;

use crate::weights::component_folder;

/// The prefix ComfyUI's all-in-one files put before the transformer's names.
const COMFY_PREFIX: &str = "model.diffusion_model.";

/// The diffusers name of a tensor of Wan's original layout; any other name (diffusers' own
/// among them) is kept, so that a file under diffusers' names loads too and an unknown name is
/// reported by the loader.
pub fn diffusers_name(original: &str) -> String {
    let name = original.strip_prefix(COMFY_PREFIX).unwrap_or(original);
    let top = [
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
    ];
    if name == "head.modulation" {
        return "scale_shift_table".into();
    }
    for (from, to) in top {
        if let Some(rest) = name.strip_prefix(from) {
            return format!("{to}{rest}");
        }
    }
    let Some(rest) = name.strip_prefix("blocks.") else {
        return name.to_string();
    };
    let Some((index, inner)) = rest.split_once('.') else {
        return name.to_string();
    };
    format!("blocks.{index}.{}", block_name(inner))
}

/// The diffusers name of a name inside a block.
fn block_name(inner: &str) -> String {
    if inner == "modulation" {
        return "scale_shift_table".into();
    }
    let attention = [("self_attn.", "attn1."), ("cross_attn.", "attn2.")];
    for (from, to) in attention {
        if let Some(rest) = inner.strip_prefix(from) {
            let projection = [
                ("q.", "to_q."),
                ("k.", "to_k."),
                ("v.", "to_v."),
                ("o.", "to_out.0."),
            ];
            for (from, renamed) in projection {
                if let Some(param) = rest.strip_prefix(from) {
                    return format!("{to}{renamed}{param}");
                }
            }
            return format!("{to}{rest}");
        }
    }
    // The original's norm3 is the cross-attention's norm, diffusers' norm2.
    let other = [
        ("norm3.", "norm2."),
        ("ffn.0.", "ffn.net.0.proj."),
        ("ffn.2.", "ffn.net.2."),
    ];
    for (from, to) in other {
        if let Some(rest) = inner.strip_prefix(from) {
            return format!("{to}{rest}");
        }
    }
    inner.to_string()
}

/// Whether `path` holds a Wan transformer: a diffusers folder (or its `transformer` folder)
/// whose `config.json` names `WanTransformer3DModel`, or a single file holding Wan's timestep
/// projection under either layout's name.
pub fn holds_wan(path: &Path) -> bool {
    if path.is_dir() {
        return component_folder(path, "transformer")
            .and_then(|folder| std::fs::read_to_string(folder.join("config.json")).ok())
            .is_some_and(|config| config.contains("\"WanTransformer3DModel\""));
    }
    Checkpoint::open(path).is_ok_and(|files| {
        files
            .tensors()
            .any(|t| diffusers_name(t.name) == "condition_embedder.time_proj.weight")
    })
}
