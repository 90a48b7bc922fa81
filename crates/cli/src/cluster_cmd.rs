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

use anyhow::{anyhow, bail};
use serde_json::{Value, json};

use crate::remote::{base_url, error_message};

#[derive(Debug, clap::Args)]
pub struct ClusterArgs {
    #[command(subcommand)]
    pub command: ClusterCommand,
    /// Any coordinator peer's HTTP API.
    #[arg(
        long,
        global = true,
        env = "TESSERA_URL",
        default_value = "http://127.0.0.1:8000"
    )]
    pub url: String,
    /// The API key [default: $TESSERA_API_KEY, then $OPENAI_API_KEY].
    #[arg(long, global = true, env = "TESSERA_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
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
    let client = Client::new(args);
    let peers = match &args.command {
        ClusterCommand::List => client.get("/v1/cluster")?,
        ClusterCommand::Add(new) => client.add(new)?,
        ClusterCommand::Remove { id } => client.remove(*id)?,
        ClusterCommand::Replace { old, new } => {
            client.add(new)?;
            client.remove(*old)?
        }
    };
    std::io::stdout()
        .lock()
        .write_all(table(&peers).as_bytes())?;
    Ok(ExitCode::SUCCESS)
}

struct Client {
    base: String,
    agent: ureq::Agent,
    authorization: Option<String>,
}

impl Client {
    fn new(args: &ClusterArgs) -> Client {
        Client {
            base: base_url(&args.url),
            agent: ureq::Agent::config_builder()
                .http_status_as_error(false)
                .timeout_global(Some(TIMEOUT))
                .build()
                .into(),
            authorization: args
                .api_key
                .clone()
                .or_else(|| std::env::var("OPENAI_API_KEY").ok())
                .filter(|k| !k.is_empty())
                .map(|k| format!("Bearer {k}")),
        }
    }

    fn add(&self, new: &NewPeer) -> anyhow::Result<Value> {
        let body = json!({"id": new.id, "http": new.http, "quic": new.quic});
        self.send("POST", "/v1/cluster/peers", Some(&body))
    }

    fn remove(&self, id: u64) -> anyhow::Result<Value> {
        self.send("DELETE", &format!("/v1/cluster/peers/{id}"), None)
    }

    fn get(&self, path: &str) -> anyhow::Result<Value> {
        self.send("GET", path, None)
    }

    fn send(&self, method: &str, path: &str, body: Option<&Value>) -> anyhow::Result<Value> {
        let url = format!("{}{path}", self.base);
        let auth = self.authorization.as_deref();
        let result = match (method, body) {
            ("POST", Some(body)) => with_auth(self.agent.post(&url), auth).send_json(body),
            ("DELETE", _) => with_auth(self.agent.delete(&url), auth).call(),
            _ => with_auth(self.agent.get(&url), auth).call(),
        };
        let mut response = result.map_err(|e| {
            anyhow!(
                "cannot reach the coordinator at {} ({method} {url}): {e}",
                self.base
            )
        })?;
        let status = response.status().as_u16();
        let answer: Value = response.body_mut().read_json().map_err(|e| {
            anyhow!("{method} {url} answered {status} with a body that is not JSON: {e}")
        })?;
        if status != 200 {
            bail!(
                "{method} {url} answered {status}: {}",
                error_message(&answer)
            );
        }
        Ok(answer)
    }
}

fn with_auth<B>(request: ureq::RequestBuilder<B>, auth: Option<&str>) -> ureq::RequestBuilder<B> {
    match auth {
        Some(a) => request.header("Authorization", a),
        None => request,
    }
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
