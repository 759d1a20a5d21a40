//! Certificates for the test process, and TLS for frontend clients.

use std::{
    path::{Path, PathBuf},
    sync::{Arc, OnceLock},
};

use ops::tls;

/// Certificates for one test process, written to a temporary directory.
pub struct Pki {
    /// Where the files are.
    pub dir: tempfile::TempDir,
}

impl Pki {
    /// The process-wide PKI (made once).
    pub fn get() -> &'static Self {
        static PKI: OnceLock<Pki> = OnceLock::new();
        PKI.get_or_init(Self::make)
    }

    /// A fresh PKI in a new temporary directory, removed on drop.
    pub fn fresh() -> Self {
        Self::make()
    }

    /// A fresh PKI in a new temporary directory.
    fn make() -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        certs::ClusterPki::generate(&[])
            .expect("generating certificates")
            .write_to(dir.path())
            .expect("writing certificates");
        Self { dir }
    }

    /// Path of a file written by `make-certs` (`cluster.crt`, `agent-ca.crt`, …).
    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// A second, unrelated PKI (for "wrong CA" tests).
    pub fn other() -> &'static Self {
        static PKI: OnceLock<Pki> = OnceLock::new();
        PKI.get_or_init(Self::make)
    }
}

/// The agent listener's files, as `make-certs` names them.
pub const SERVER_FILES: [&str; 3] = ["cluster.crt", "cluster.key", "agent-ca.crt"];
/// An agent's files (mTLS), as `make-certs` names them.
pub const AGENT_FILES: [&str; 3] = ["agent-ca.crt", "proxy-agent.crt", "proxy-agent.key"];

/// Puts the files `names` of the directory `from` into `to` (created if
/// missing) as kubelet updates a Secret volume: each file whole, by rename.
pub fn install(from: &Path, to: &Path, names: &[&str]) {
    std::fs::create_dir_all(to).expect("creating the directory");
    for name in names {
        let staged = to.join(format!(".{name}.new"));
        std::fs::copy(from.join(name), &staged).expect("copying a PKI file");
        std::fs::rename(&staged, to.join(name)).expect("renaming a PKI file");
    }
}

/// TLS for a frontend client: trusts the test frontend CA and presents the
/// client certificate of `pki` (another PKI's to test refusal).
pub fn frontend_client_tls(pki: &Pki) -> Arc<rustls::ClientConfig> {
    tls::client_config(
        &Pki::get().path("frontend-ca.crt"),
        Some((&pki.path("proxy-client.crt"), &pki.path("proxy-client.key"))),
        &[],
    )
    .expect("frontend client TLS")
}
