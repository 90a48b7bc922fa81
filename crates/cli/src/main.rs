//! `tessera`: the command-line front end of Tessera.
//!
//! - `tessera up`: start the processes of a topology on this host and supervise them.
//! - `tessera generate`: run a model in this process (prompt, chat or token ids), or ask a
//!   running server with `--url`.
//! - `tessera bench`: load a running OpenAI-compatible server (ours or another) and report
//!   latencies and throughput.
//! - `tessera topology check`: validate a topology file and print the plan; `topology
//!   apply`: make it the running cluster's (groups and models added and removed).
//! - `tessera certs init`: make a cluster's CA and certificates; `certs issue`: one more
//!   from that CA.
//! - `tessera cluster`: list, add or remove coordinator peers; `tessera drain`: drain one
//!   peer before maintenance.

#![forbid(unsafe_code)]

use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod bench;
mod certs_cmd;
mod cluster_cmd;
mod drain_cmd;
mod generate;
mod group_cmd;
mod http;
mod model_cmd;
mod remote;
mod topology_apply;
mod topology_cmd;
mod up;

/// Tessera: tensor-parallel LLM serving.
#[derive(Debug, Parser)]
#[command(name = "tessera", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Start the processes of a topology on this host (or the SmolLM2 demo) and supervise
    /// them until Ctrl-C.
    Up(up::UpArgs),
    /// Generate text with a model in this process, or with a running server (--url).
    Generate(generate::GenerateArgs),
    /// Load an OpenAI-compatible server with requests and report TTFT, inter-token
    /// latency, end-to-end latency and throughput.
    Bench(Box<bench::BenchArgs>),
    /// Work with topology files.
    #[command(subcommand)]
    Topology(TopologyCommand),
    /// Work with the cluster's certificates.
    #[command(subcommand)]
    Certs(CertsCommand),
    /// List the coordinator peers of a running cluster, or add, remove or replace one.
    Cluster(cluster_cmd::ClusterArgs),
    /// Drain one coordinator peer: refuse new requests, let those in flight finish, hand
    /// leadership over, exit (as SIGTERM does).
    Drain(drain_cmd::DrainArgs),
    /// Take a tensor-parallel group out of routing for maintenance (`drain`, waiting until
    /// it is idle), or put it back (`resume`).
    Group(group_cmd::GroupArgs),
    /// A model's versions: deploy one (as a canary or on every group), promote the
    /// canary, roll back, or show them.
    Model(model_cmd::ModelArgs),
}

#[derive(Debug, Subcommand)]
enum TopologyCommand {
    /// Validate a topology file and print each group's plan, or every error found.
    Check(topology_cmd::CheckArgs),
    /// Make a topology file the running cluster's: start the groups and models it adds,
    /// drain and stop the ones it drops, leave the others untouched.
    Apply(topology_apply::ApplyArgs),
}

#[derive(Debug, Subcommand)]
enum CertsCommand {
    /// Create the cluster CA and one certificate per coordinator peer and shard.
    Init(certs_cmd::InitArgs),
    /// Issue one more certificate from an existing cluster CA (a peer or shard added
    /// later).
    Issue(certs_cmd::IssueArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let log = std::env::var("TESSERA_LOG").ok();
    tessera_comm::logging::init(log.as_deref(), "warn");
    let result = match &cli.command {
        Command::Up(args) => up::run(args),
        Command::Generate(args) => generate::run(args),
        Command::Bench(args) => bench::run(args),
        Command::Topology(TopologyCommand::Check(args)) => topology_cmd::check(args),
        Command::Topology(TopologyCommand::Apply(args)) => topology_apply::apply(args),
        Command::Certs(CertsCommand::Init(args)) => certs_cmd::init(args),
        Command::Certs(CertsCommand::Issue(args)) => certs_cmd::issue(args),
        Command::Cluster(args) => cluster_cmd::run(args),
        Command::Drain(args) => drain_cmd::run(args),
        Command::Group(args) => group_cmd::run(args),
        Command::Model(args) => model_cmd::run(args),
    };
    match result {
        Ok(code) => code,
        Err(error) => {
            eprintln!("error: {error:#}");
            ExitCode::FAILURE
        }
    }
}
