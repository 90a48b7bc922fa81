//! `tessera topology apply FILE`: makes FILE the running cluster's topology, through any
//! coordinator peer (followers forward to the leader), with an admin key. The groups and
//! models FILE adds start (their shards, started with FILE, register); the ones it drops
//! are drained (their requests finish, for up to 30 s), then their shards exit. The other
//! groups run on untouched. What stays may not change: a kept group's layout, a kept
//! model's files (`tessera model deploy` makes a new version), the coordinator peers
//! (`tessera cluster add|remove`).
//!
//! The file is checked here first (the same check as `tessera topology check`), then by
//! the leader against the topology in force and the model files. The command waits until
//! every added group serves and every dropped one is gone (`--no-wait` returns at once).

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use serde_json::json;
use tessera_topology::Topology;

use crate::cluster_cmd::AdminTarget;
use crate::http::{Client, ClientOptions};
use crate::model_cmd::{POLL, Wait};

#[derive(Debug, clap::Args)]
pub struct ApplyArgs {
    /// The topology file, at the same path on the coordinators' hosts (its relative paths
    /// resolve against its directory there).
    pub file: PathBuf,
    #[command(flatten)]
    pub target: AdminTarget,
    #[command(flatten)]
    pub wait: Wait,
}

pub fn apply(args: &ApplyArgs) -> anyhow::Result<ExitCode> {
    Topology::read(&args.file)?;
    let path = std::fs::canonicalize(&args.file)
        .with_context(|| format!("resolving {}", args.file.display()))?;
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let options = ClientOptions {
        request_timeout: Some(Duration::from_secs(60)),
        server_noun: "coordinator",
        ..ClientOptions::default()
    };
    let client = Client::new(&args.target.url, args.target.admin_key.clone(), options);
    let body = json!({ "path": path, "text": text });
    let applied = client.post_json("/v1/cluster/topology", &body)?;
    let names = |key: &str| -> Vec<String> {
        (applied[key].as_array().into_iter().flatten())
            .filter_map(|v| v.as_str().map(String::from))
            .collect()
    };
    let (added, removed) = (names("added_groups"), names("removed_groups"));
    let summary = describe(&[
        ("added groups", &added),
        ("removed groups", &removed),
        ("added models", &names("added_models")),
        ("removed models", &names("removed_models")),
    ]);
    match summary {
        None => eprintln!("nothing to change: the cluster runs this topology"),
        Some(summary) => eprintln!("topology generation {}: {summary}", applied["generation"]),
    }
    if !args.wait.no_wait {
        wait_applied(&client, &added, &removed, args.wait.timeout())?;
    }
    Ok(ExitCode::SUCCESS)
}

/// "added groups a, b; removed groups c", or `None` when every list is empty.
fn describe(lists: &[(&str, &Vec<String>)]) -> Option<String> {
    let parts: Vec<String> = (lists.iter())
        .filter(|(_, names)| !names.is_empty())
        .map(|(what, names)| format!("{what} {}", names.join(", ")))
        .collect();
    (!parts.is_empty()).then(|| parts.join("; "))
}

/// Polls the cluster until every group of `added` serves and none of `removed` is left.
fn wait_applied(
    client: &Client,
    added: &[String],
    removed: &[String],
    timeout: Duration,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + timeout;
    let mut last = String::new();
    loop {
        let cluster = client.get_json("/v1/cluster")?;
        let groups = cluster["groups"].as_array().cloned().unwrap_or_default();
        let state = |name: &str| {
            (groups.iter())
                .find(|g| g["name"] == name)
                .map(|g| g["state"].as_str().unwrap_or("?").to_string())
        };
        let waiting: Vec<String> = (added.iter())
            .filter_map(|g| match state(g) {
                Some(s) if s == "serving" => None,
                s => Some(format!("{g}: {}", s.as_deref().unwrap_or("not started"))),
            })
            .chain(
                (removed.iter())
                    .filter(|g| state(g).is_some())
                    .map(|g| format!("{g}: draining")),
            )
            .collect();
        if waiting.is_empty() {
            if !(added.is_empty() && removed.is_empty()) {
                eprintln!("every added group serves, every removed group is gone");
            }
            return Ok(());
        }
        let now = waiting.join("; ");
        if now != last {
            eprintln!("waiting: {now}");
            last = now;
        }
        if Instant::now() > deadline {
            bail!(
                "the topology is applied, but not every group got there in {} s ({last}): \
                 start the added groups' shards with the new file",
                timeout.as_secs()
            );
        }
        std::thread::sleep(POLL);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_change_reads_as_one_line() {
        let (a, none) = (vec!["a".to_string(), "b".to_string()], Vec::new());
        assert_eq!(
            describe(&[("added groups", &a), ("removed groups", &none)]).as_deref(),
            Some("added groups a, b")
        );
        assert_eq!(describe(&[("added groups", &none)]), None);
    }
}
