//! `tessera group drain|resume NAME`: takes one tensor-parallel group out of routing for
//! maintenance, and puts it back, through any coordinator peer (followers forward to the
//! leader). A drained group takes no new request; those it runs or holds queued finish.
//! `drain` waits until the group is idle (nothing running or waiting), printing what is
//! left, so the shards can then be stopped without failing a request. The drain is
//! replicated: a new leader keeps the group drained until `resume`.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::bail;
use serde_json::{Value, json};

use crate::cluster_cmd::AdminTarget;
use crate::http::{Client, ClientOptions};

#[derive(Debug, clap::Args)]
pub struct GroupArgs {
    #[command(subcommand)]
    pub command: GroupCommand,
    #[command(flatten)]
    pub target: AdminTarget,
}

#[derive(Debug, clap::Subcommand)]
pub enum GroupCommand {
    /// Take a group out of routing and wait until it is idle.
    Drain {
        /// The group, as the topology names it.
        name: String,
        /// Return once the drain is committed, without waiting for the group to be idle.
        #[arg(long)]
        no_wait: bool,
        /// Give up waiting after this many seconds (the group stays drained).
        #[arg(long, value_name = "SECONDS", default_value_t = 600)]
        timeout: u64,
    },
    /// Put a drained group back into routing.
    Resume {
        /// The group, as the topology names it.
        name: String,
    },
}

/// How often a draining group's load is asked for.
const POLL: Duration = Duration::from_millis(500);

pub fn run(args: &GroupArgs) -> anyhow::Result<ExitCode> {
    let options = ClientOptions {
        request_timeout: Some(Duration::from_secs(30)),
        server_noun: "coordinator",
        ..ClientOptions::default()
    };
    let client = Client::new(&args.target.url, args.target.admin_key.clone(), options);
    match &args.command {
        GroupCommand::Resume { name } => {
            let status = client.post_json(&path(name, "resume"), &json!({}))?;
            eprintln!("group {name} serves again ({})", load(&status));
            Ok(ExitCode::SUCCESS)
        }
        GroupCommand::Drain {
            name,
            no_wait,
            timeout,
        } => {
            let status = client.post_json(&path(name, "drain"), &json!({}))?;
            eprintln!(
                "group {name} drained: it takes no new request ({})",
                load(&status)
            );
            if *no_wait {
                return Ok(ExitCode::SUCCESS);
            }
            wait_idle(&client, name, Duration::from_secs(*timeout))?;
            Ok(ExitCode::SUCCESS)
        }
    }
}

fn path(group: &str, action: &str) -> String {
    format!("/v1/cluster/groups/{group}/{action}")
}

/// Polls `/v1/cluster` until `group` runs and holds nothing.
fn wait_idle(client: &Client, group: &str, timeout: Duration) -> anyhow::Result<()> {
    let deadline = Instant::now() + timeout;
    let mut last = String::new();
    loop {
        let cluster = client.get_json("/v1/cluster")?;
        let Some(status) = cluster["groups"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|g| g["name"] == group)
        else {
            bail!("{} no longer lists group {group}", client.base());
        };
        if status["drained"] != true {
            bail!("group {group} was resumed while this drain waited");
        }
        if idle(status) {
            eprintln!("group {group} is idle: its shards can be stopped");
            return Ok(());
        }
        let now = load(status);
        if now != last {
            eprintln!("{now}");
            last = now;
        }
        if Instant::now() > deadline {
            bail!(
                "group {group} is still busy after {} s ({last}); it stays drained",
                timeout.as_secs()
            );
        }
        std::thread::sleep(POLL);
    }
}

fn idle(status: &Value) -> bool {
    status["running"] == 0 && status["waiting"] == 0
}

fn load(status: &Value) -> String {
    format!(
        "{} running, {} waiting",
        status["running"].as_u64().unwrap_or(0),
        status["waiting"].as_u64().unwrap_or(0)
    )
}
