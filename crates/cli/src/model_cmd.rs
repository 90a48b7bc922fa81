//! `tessera model deploy|status|promote|rollback NAME`: a model's versions, through any
//! coordinator peer (followers forward to the leader), with an admin key.
//! - `deploy --path PATH [--canary PERCENT] [--groups G,…]`: a new version, as a canary on
//!   the groups named (by default the model's last group) given PERCENT of the requests,
//!   or, without `--canary` and `--groups`, stable on every group, group by group;
//! - `promote`: the canary becomes stable on every group;
//! - `rollback [--to VERSION]`: the canary is taken out, or an earlier version (by
//!   default the previous stable one) becomes stable again.
//!
//! The changes are replicated; the groups then move to their version one at a time,
//! each out of routing while its requests finish and its shards load. Each command but
//! `status` waits until every group serves its version (`--no-wait` returns at once).

use std::fmt::Write as _;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use std::io::Write as _;

use anyhow::{Context, bail};
use serde_json::{Value, json};

use crate::cluster_cmd::AdminTarget;
use crate::http::{Client, ClientOptions};

#[derive(Debug, clap::Args)]
pub struct ModelArgs {
    #[command(subcommand)]
    pub command: ModelCommand,
    #[command(flatten)]
    pub target: AdminTarget,
}

#[derive(Debug, clap::Subcommand)]
pub enum ModelCommand {
    /// Deploy a new version of a model: as a canary, or on every group.
    Deploy {
        /// The model, as the topology names it.
        name: String,
        /// The new version's files (a GGUF file or a HuggingFace directory), at the same
        /// path on the coordinator's and the groups' hosts.
        #[arg(long)]
        path: String,
        /// Send this percent (0 to 100) of the model's requests to the new version.
        #[arg(long, value_name = "PERCENT")]
        canary: Option<i64>,
        /// The groups that serve the canary (comma-separated; by default the model's last).
        #[arg(long, value_delimiter = ',')]
        groups: Vec<String>,
        #[command(flatten)]
        wait: Wait,
    },
    /// Show a model's versions, canary, groups and last rollout events.
    Status {
        /// The model, as the topology names it.
        name: String,
    },
    /// Make the canary the stable version on every group.
    Promote {
        /// The model, as the topology names it.
        name: String,
        #[command(flatten)]
        wait: Wait,
    },
    /// Take the canary out, or return to an earlier version.
    Rollback {
        /// The model, as the topology names it.
        name: String,
        /// The version to return to (by default the stable one from a canary, or the
        /// previous stable version).
        #[arg(long, value_name = "VERSION")]
        to: Option<u32>,
        #[command(flatten)]
        wait: Wait,
    },
}

/// Whether, and how long, a command waits for the groups to serve their versions.
#[derive(Debug, clap::Args)]
pub struct Wait {
    /// Return once the change is committed, without waiting for the groups.
    #[arg(long)]
    pub no_wait: bool,
    /// Give up waiting after this many seconds (the change stays).
    #[arg(long, value_name = "SECONDS", default_value_t = 900)]
    timeout: u64,
}

impl Wait {
    pub fn timeout(&self) -> Duration {
        Duration::from_secs(self.timeout)
    }
}

/// How often the groups' versions are asked for.
pub const POLL: Duration = Duration::from_millis(500);

pub fn run(args: &ModelArgs) -> anyhow::Result<ExitCode> {
    let options = ClientOptions {
        request_timeout: Some(Duration::from_secs(60)),
        server_noun: "coordinator",
        ..ClientOptions::default()
    };
    let client = Client::new(&args.target.url, args.target.admin_key.clone(), options);
    let (name, status, wait) = match &args.command {
        ModelCommand::Status { name } => {
            let status = client.get_json(&path(name, ""))?;
            std::io::stdout()
                .write_all(describe(&status).as_bytes())
                .context("writing to stdout")?;
            return Ok(ExitCode::SUCCESS);
        }
        ModelCommand::Deploy {
            name,
            path: files,
            canary,
            groups,
            wait,
        } => {
            let body = json!({ "path": files, "canary_percent": canary, "groups": groups });
            (name, client.post_json(&path(name, "/deploy"), &body)?, wait)
        }
        ModelCommand::Promote { name, wait } => (
            name,
            client.post_json(&path(name, "/promote"), &json!({}))?,
            wait,
        ),
        ModelCommand::Rollback { name, to, wait } => {
            let body = json!({ "to": to });
            (
                name,
                client.post_json(&path(name, "/rollback"), &body)?,
                wait,
            )
        }
    };
    if let Some(event) = status["events"].as_array().and_then(|e| e.last()) {
        eprintln!("{}", event["what"].as_str().unwrap_or_default());
    }
    if !wait.no_wait {
        wait_moved(&client, name, wait.timeout())?;
    }
    Ok(ExitCode::SUCCESS)
}

fn path(model: &str, action: &str) -> String {
    format!("/v1/cluster/models/{model}{action}")
}

/// Polls the model's status until every group serves its target version.
fn wait_moved(client: &Client, model: &str, timeout: Duration) -> anyhow::Result<()> {
    let deadline = Instant::now() + timeout;
    let mut last = String::new();
    loop {
        let status = client.get_json(&path(model, ""))?;
        let groups = status["groups"].as_array().cloned().unwrap_or_default();
        let moved = |g: &Value| g["version"] == g["target"] && g["switching"] == false;
        if groups.iter().all(moved) {
            eprintln!("every group of {model} serves its version");
            return Ok(());
        }
        let now = groups_line(&groups);
        if now != last {
            eprintln!("{now}");
            last = now;
        }
        if Instant::now() > deadline {
            bail!(
                "the groups of {model} did not all reach their version in {} s ({last})",
                timeout.as_secs()
            );
        }
        std::thread::sleep(POLL);
    }
}

/// One line: each group's version, target and state.
fn groups_line(groups: &[Value]) -> String {
    let each: Vec<String> = groups
        .iter()
        .map(|g| {
            let switching = if g["switching"] == true {
                ", switching"
            } else {
                ""
            };
            format!(
                "{}: version {} → {} ({}{switching})",
                g["name"].as_str().unwrap_or("?"),
                g["version"],
                g["target"],
                g["state"].as_str().unwrap_or("?")
            )
        })
        .collect();
    each.join("; ")
}

/// `tessera model status`'s text.
fn describe(status: &Value) -> String {
    let mut out = String::new();
    let _ = write!(
        out,
        "model {}: stable version {}",
        status["model"].as_str().unwrap_or("?"),
        status["stable"]
    );
    if let Some(previous) = status["previous"].as_u64() {
        let _ = write!(out, " (previous {previous})");
    }
    let canary = &status["canary"];
    if !canary.is_null() {
        let groups: Vec<&str> = (canary["groups"].as_array().into_iter().flatten())
            .filter_map(Value::as_str)
            .collect();
        let _ = write!(
            out,
            "; canary version {} at {}% on {}",
            canary["version"],
            canary["percent"],
            groups.join(", ")
        );
    }
    out.push_str("\nversions:\n");
    for v in status["versions"].as_array().into_iter().flatten() {
        let _ = writeln!(
            out,
            "  {:>3}  {}",
            v["version"],
            v["path"].as_str().unwrap_or("?")
        );
    }
    out.push_str("groups:\n");
    for g in status["groups"].as_array().into_iter().flatten() {
        let _ = writeln!(out, "  {}", groups_line(std::slice::from_ref(g)));
    }
    let events = status["events"].as_array().cloned().unwrap_or_default();
    if !events.is_empty() {
        out.push_str("events (oldest first):\n");
        for e in &events {
            let _ = writeln!(
                out,
                "  {}  {}",
                e["at_ms"],
                e["what"].as_str().unwrap_or("?")
            );
        }
    }
    out
}
