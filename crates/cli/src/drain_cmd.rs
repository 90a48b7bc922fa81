//! `tessera drain`: drains one coordinator peer before maintenance, as SIGTERM does, for
//! a peer this host cannot signal. The peer refuses new requests (503 with `Retry-After`;
//! its `/ready` turns 503), lets those in flight end (for its `--drain-timeout` at most),
//! hands leadership over if it leads, and exits. The command follows it until it has
//! stopped, printing what is still in flight.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::bail;
use serde_json::{Value, json};

use crate::http::{Client, ClientOptions};

#[derive(Debug, clap::Args)]
pub struct DrainArgs {
    /// The HTTP API of the coordinator peer to drain (this peer, not the leader: requests
    /// are not forwarded).
    #[arg(long, env = "TESSERA_URL", default_value = "http://127.0.0.1:8000")]
    pub url: String,
    /// An admin key (the coordinator's `--admin-key`), needed where it has API keys.
    #[arg(long, env = "TESSERA_ADMIN_KEY", hide_env_values = true)]
    pub admin_key: Option<String>,
    /// Start the drain and return, without waiting for the peer to stop.
    #[arg(long)]
    pub no_wait: bool,
}

/// How often the drain's progress is asked for.
const POLL: Duration = Duration::from_millis(500);

/// Time past the peer's drain timeout for its hand-over and exit.
const EXIT_GRACE: Duration = Duration::from_secs(15);

pub fn run(args: &DrainArgs) -> anyhow::Result<ExitCode> {
    let options = ClientOptions {
        request_timeout: Some(Duration::from_secs(10)),
        server_noun: "coordinator peer",
        ..ClientOptions::default()
    };
    let client = Client::new(&args.url, args.admin_key.clone(), options);
    let started = client.post_json("/v1/admin/drain", &json!({}))?;
    let timeout = Duration::try_from_secs_f64(started["timeout_s"].as_f64().unwrap_or(30.0))
        .unwrap_or(Duration::from_secs(30));
    eprintln!(
        "draining {}: {} requests in flight; they have {} s to finish",
        client.base(),
        in_flight(&started),
        timeout.as_secs_f64()
    );
    if args.no_wait {
        return Ok(ExitCode::SUCCESS);
    }
    let deadline = Instant::now() + timeout + EXIT_GRACE;
    let mut last = in_flight(&started);
    loop {
        std::thread::sleep(POLL);
        let Some(state) = client.get_json_if_up("/v1/admin/drain")? else {
            eprintln!("the peer has stopped");
            return Ok(ExitCode::SUCCESS);
        };
        let now = in_flight(&state);
        if now != last {
            eprintln!("{now} requests in flight");
            last = now;
        }
        if Instant::now() > deadline {
            bail!(
                "{} still answers {} s after the drain started (its drain timeout is {} s): \
                 see its log",
                client.base(),
                (timeout + EXIT_GRACE).as_secs(),
                timeout.as_secs_f64()
            );
        }
    }
}

fn in_flight(state: &Value) -> u64 {
    state["in_flight"].as_u64().unwrap_or(0)
}
