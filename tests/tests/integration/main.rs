//! The end-to-end suite: one test binary, one module per area. Each case
//! drives real processes or in-process servers and agents on loopback
//! (`integration_tests` holds the harness); nextest runs each test in its
//! own process, so a case still cannot disturb another.

#![allow(clippy::unwrap_used)] // tests: a panic is a failure report

mod admission;
mod agent_protocol;
mod agent_proxy;
mod anp_surface;
mod answered_then_gone;
mod audit_log;
mod cert_rotation;
mod certified_identifiers;
mod cli;
mod connection_cap;
mod data_path;
mod data_path_modules;
mod destination_policy;
mod dial_retries;
mod docs_args;
mod drain;
mod endpoints;
mod faults;
mod flags_reference;
mod flow_control;
mod flow_versions;
mod go_interop;
mod grpc_mode;
mod heap_profile;
mod http_connect_mode;
mod keepalive;
mod lease_stub;
mod leases;
mod manifests;
mod memory_budget;
mod metrics;
mod metrics_reference;
mod module_cycles;
mod monitoring;
mod mutation_survivors;
mod otel_traces;
mod proxy_client;
mod python_interop;
mod recommended_policy;
mod resumption;
mod robustness;
mod secrets;
mod servers;
mod shared_stream;
mod tcp_frontend;
mod token_auth;
mod type_names;
