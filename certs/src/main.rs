//! `make-certs`: writes the frontend and agent PKIs of a Konnectivity deployment.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use clap::Parser;

use certs::{ClusterPki, KeyAlgorithm};

/// Makes the CAs, server and client certificates for proxy-server, proxy-agent
/// and kube-apiserver's egress selector.
#[derive(Debug, Parser)]
#[command(name = "make-certs", version)]
struct Args {
    /// Directory to write the certificates and keys into; created if missing.
    #[arg(long, default_value = "./certs/out")]
    out_dir: PathBuf,
    /// Extra DNS name or IP address the proxy-server is reached by; repeatable.
    /// localhost, 127.0.0.1, ::1 and the konnectivity-server Service names are
    /// always included.
    #[arg(long = "san", value_name = "NAME")]
    sans: Vec<String>,
    /// Keys of every CA and certificate: ecdsa-p256, or rsa-2048 as kubeadm
    /// makes them (each full TLS handshake then costs the server an RSA
    /// signature).
    #[arg(long, value_enum, default_value_t = KeyAlgorithm::EcdsaP256)]
    key_algorithm: KeyAlgorithm,
}

fn main() -> ExitCode {
    match run(Args::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("make-certs: {err:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: Args) -> anyhow::Result<()> {
    let pki = ClusterPki::generate_with(&args.sans, args.key_algorithm)
        .with_context(|| format!("generating certificates for --san {:?}", args.sans))?;
    let written = pki
        .write_to(&args.out_dir)
        .with_context(|| format!("writing --out-dir {}", args.out_dir.display()))?;
    for path in written {
        println!("{}", path.display());
    }
    Ok(())
}
