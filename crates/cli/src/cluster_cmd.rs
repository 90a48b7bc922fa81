//! `tessera cluster`: the coordinator peers of a running cluster, through any peer's API
//! (followers forward to the leader). `list` prints them; `add`, `remove` and `replace`
//! change the Raft group's membership one peer at a time.
//!
//! Adding a peer: list it in the topology, give it a certificate of the cluster CA, start
//! `tessera-coordinator --join` on its host, then `tessera cluster add`. The leader sends
//! it the log (or a snapshot) and it votes from then on.

use std::io::Write as _;
use std::process::ExitCode;
use std::time::Duration;

use serde_json::{Value, json};

use crate::http::{self, Client, ClientOptions};

#[derive(Debug, clap::Args)]
pub struct ClusterArgs {
    #[command(subcommand)]
    pub command: ClusterCommand,
    #[command(flatten)]
    pub target: AdminTarget,
    /// The API key [default: $TESSERA_API_KEY, then $OPENAI_API_KEY].
    #[arg(long, global = true, env = "TESSERA_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
}

/// A running cluster, through any coordinator peer, and the key that may change it
/// (`tessera cluster`, `tessera group`).
#[derive(Debug, clap::Args)]
pub struct AdminTarget {
    /// Any coordinator peer's HTTP API (followers forward to the leader).
    #[arg(
        long,
        global = true,
        env = "TESSERA_URL",
        default_value = "http://127.0.0.1:8000"
    )]
    pub url: String,
    /// An admin key (the coordinator's `--admin-key`): changes to the cluster need one
    /// where the coordinators have API keys. Used instead of the API key when given.
    #[arg(long, global = true, env = "TESSERA_ADMIN_KEY", hide_env_values = true)]
    pub admin_key: Option<String>,
}

#[derive(Debug, clap::Subcommand)]
pub enum ClusterCommand {
    /// Every coordinator peer: id, HTTP address, role, term, pid.
    List,
    /// Add a voter (started with `tessera-coordinator --join`).
    Add(NewPeer),
    /// Remove a voter.
    Remove {
        /// The peer's id.
        #[arg(long)]
        id: u64,
    },
    /// Add a new voter, then remove an old one.
    Replace {
        /// The peer to remove once the new one is in.
        #[arg(long)]
        old: u64,
        #[command(flatten)]
        new: NewPeer,
    },
}

#[derive(Debug, clap::Args)]
pub struct NewPeer {
    /// The new peer's id (unused by any other peer).
    #[arg(long)]
    pub id: u64,
    /// Its HTTP API address (`host:port`).
    #[arg(long)]
    pub http: String,
    /// Its QUIC address (`host:port`), where the other peers reach it.
    #[arg(long)]
    pub quic: String,
}

/// Membership changes wait for the commit; a new peer may need to catch up first.
const TIMEOUT: Duration = Duration::from_secs(30);

pub fn run(args: &ClusterArgs) -> anyhow::Result<ExitCode> {
    let options = ClientOptions {
        request_timeout: Some(TIMEOUT),
        server_noun: "coordinator",
        ..ClientOptions::default()
    };
    let key = args
        .target
        .admin_key
        .clone()
        .or_else(|| http::api_key(args.api_key.as_deref()));
    let client = Client::new(&args.target.url, key, options);
    let peers = match &args.command {
        ClusterCommand::List => client.get_json("/v1/cluster")?,
        ClusterCommand::Add(new) => add(&client, new)?,
        ClusterCommand::Remove { id } => remove(&client, *id)?,
        ClusterCommand::Replace { old, new } => {
            add(&client, new)?;
            remove(&client, *old)?
        }
    };
    std::io::stdout()
        .lock()
        .write_all(table(&peers).as_bytes())?;
    Ok(ExitCode::SUCCESS)
}

/// Adds `new` as a voter once the leader has committed it; the answer lists the peers.
fn add(client: &Client, new: &NewPeer) -> anyhow::Result<Value> {
    let body = json!({"id": new.id, "http": new.http, "quic": new.quic});
    client.post_json("/v1/cluster/peers", &body)
}

/// Removes voter `id` once the leader has committed it; the answer lists the peers.
fn remove(client: &Client, id: u64) -> anyhow::Result<Value> {
    client.delete_json(&format!("/v1/cluster/peers/{id}"))
}

/// The peers of a `/v1/cluster` answer as a table.
fn table(answer: &Value) -> String {
    let mut out = String::from("id  role      term  pid      http\n");
    for p in answer["peers"].as_array().into_iter().flatten() {
        out += &format!(
            "{:<3} {:<9} {:<5} {:<8} {}\n",
            p["id"],
            p["role"].as_str().unwrap_or("?"),
            p["term"],
            p["pid"].as_u64().map_or("-".to_string(), |p| p.to_string()),
            p["http"].as_str().unwrap_or(""),
        );
    }
    out
}
