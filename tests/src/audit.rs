//! The audit log in tests: its configuration for an in-process server or
//! agent, and its records read back once the processes have stopped (they
//! write every queued record before they exit, so stopping them is the
//! barrier).

use std::path::Path;

use ops::audit::{
    AuditArgs, AuditConfig, AuditRecord,
    record::{AgentTunnel, ServerTunnel},
};

/// `--audit-log-path=<path>`, the other flags at their defaults.
pub fn config(path: &Path) -> AuditConfig {
    AuditArgs {
        path: Some(path.to_owned()),
        max_size: 100,
        max_backup: 10,
        max_age: 0,
        batch_buffer_size: 10_000,
    }
    .config()
    .expect("audit flags")
    .expect("an audit log")
}

/// Every record in the file at `path` (none if there is no file).
pub fn records(path: &Path) -> Vec<AuditRecord> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    text.lines()
        .map(|line| {
            serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: a bad record: {line}"))
        })
        .collect()
}

/// The server records and the agent records in the file at `path`.
pub fn sides(path: &Path) -> (Vec<ServerTunnel>, Vec<AgentTunnel>) {
    let mut server = Vec::new();
    let mut agent = Vec::new();
    for record in records(path) {
        match record {
            AuditRecord::Server(record) => server.push(record),
            AuditRecord::Agent(record) => agent.push(record),
        }
    }
    (server, agent)
}
