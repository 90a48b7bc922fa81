//! `tessera`: the command-line front end of Tessera.
//!
//! - `tessera generate`: run a model in this process (prompt, chat or token ids).
//! - `tessera topology check`: validate a topology file and print the plan.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod generate;
mod topology_cmd;

/// Tessera: tensor-parallel LLM serving.
#[derive(Debug, Parser)]
#[command(name = "tessera", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Generate text with a model in this process.
    Generate(generate::GenerateArgs),
    /// Work with topology files.
    #[command(subcommand)]
    Topology(TopologyCommand),
}

#[derive(Debug, Subcommand)]
enum TopologyCommand {
    /// Validate a topology file and print each group's plan, or every error found.
    Check(topology_cmd::CheckArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("TESSERA_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let result = match &cli.command {
        Command::Generate(args) => generate::run(args),
        Command::Topology(TopologyCommand::Check(args)) => topology_cmd::check(args),
    };
    match result {
        Ok(code) => code,
        Err(error) => {
            eprintln!("error: {error:#}");
            ExitCode::FAILURE
        }
    }
}
