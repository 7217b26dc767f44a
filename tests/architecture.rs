//! ARCHITECTURE.md states the workspace's crate graph; this compares it with what Cargo builds
//! (`cargo metadata`: normal dependencies between the workspace's crates, the umbrella package
//! left out).

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

type Graph = BTreeMap<String, Vec<String>>;

/// The graph in the `crate-graph` block: `crate -> dep, dep` per line.
fn stated(text: &str) -> Graph {
    let block = text
        .split("```text crate-graph\n")
        .nth(1)
        .and_then(|rest| rest.split("```").next())
        .expect("ARCHITECTURE.md has a ```text crate-graph block");
    block
        .lines()
        .map(|line| {
            let (name, deps) = line.split_once("->").expect("`crate -> deps`");
            let mut deps: Vec<String> = deps
                .split(',')
                .map(str::trim)
                .filter(|d| !d.is_empty())
                .map(String::from)
                .collect();
            deps.sort();
            (name.trim().to_string(), deps)
        })
        .collect()
}

/// The graph Cargo resolves for the workspace.
fn built(root: &Path) -> Graph {
    let output = Command::new(env!("CARGO"))
        .args([
            "metadata",
            "--no-deps",
            "--format-version",
            "1",
            "--offline",
        ])
        .current_dir(root)
        .output()
        .expect("cargo metadata runs");
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let metadata: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    let packages = metadata["packages"].as_array().unwrap();
    let members: Vec<&str> = packages
        .iter()
        .map(|p| p["name"].as_str().unwrap())
        .filter(|name| *name != env!("CARGO_PKG_NAME"))
        .collect();
    packages
        .iter()
        .filter(|p| members.contains(&p["name"].as_str().unwrap()))
        .map(|p| {
            let mut deps: Vec<String> = p["dependencies"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|d| d["kind"].is_null())
                .map(|d| d["name"].as_str().unwrap())
                .filter(|name| members.contains(name))
                .map(String::from)
                .collect();
            deps.sort();
            deps.dedup();
            (p["name"].as_str().unwrap().to_string(), deps)
        })
        .collect()
}

#[test]
fn the_stated_crate_graph_is_the_built_one() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(root.join("ARCHITECTURE.md")).unwrap();
    assert_eq!(
        stated(&text),
        built(root),
        "ARCHITECTURE.md's crate graph (left) is out of date"
    );
}
