//! What `deploy/` ships that the tests run as shipped: the agents'
//! recommended destination policy, the `policy` key of the ConfigMap in
//! `deploy/konnectivity-agent-policy.yaml`.

use std::{
    path::{Path, PathBuf},
    sync::LazyLock,
};

/// The ConfigMap's file, and the path the agent DaemonSets give
/// `--destination-policy-file` (its mount and key).
pub const POLICY_MANIFEST: &str = "konnectivity-agent-policy.yaml";
/// Where the DaemonSets mount the ConfigMap's `policy` key.
pub const POLICY_PATH: &str = "/etc/konnectivity-policy/policy";

/// `deploy/`.
pub fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy")
}

/// The `policy: |` block of the ConfigMap, unindented: the file the
/// kubelet writes into the agent's volume.
///
/// # Panics
/// If the manifest has no such block.
pub fn recommended_policy() -> String {
    let text = std::fs::read_to_string(dir().join(POLICY_MANIFEST)).expect("the policy manifest");
    let mut lines = text.lines().skip_while(|l| l.trim() != "policy: |");
    let key = lines.next().expect("a `policy: |` key in the ConfigMap");
    let key_indent = key.len() - key.trim_start().len();
    let block: Vec<&str> = lines
        .take_while(|l| l.trim().is_empty() || l.len() - l.trim_start().len() > key_indent)
        .collect();
    let indent = block
        .iter()
        .filter(|l| !l.trim().is_empty())
        .map(|l| l.len() - l.trim_start().len())
        .min()
        .expect("a non-empty policy");
    let mut policy: String = block
        .iter()
        .map(|l| format!("{}\n", l.get(indent..).unwrap_or_default()))
        .collect();
    // `|` keeps one final newline.
    while policy.ends_with("\n\n") {
        policy.pop();
    }
    policy
}

/// [`recommended_policy`] written to a file of this test process, as the
/// agent's volume holds it.
pub fn recommended_policy_file() -> &'static Path {
    static FILE: LazyLock<(tempfile::TempDir, PathBuf)> = LazyLock::new(|| {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("policy");
        std::fs::write(&path, recommended_policy()).expect("writing the policy");
        (dir, path)
    });
    &FILE.1
}
