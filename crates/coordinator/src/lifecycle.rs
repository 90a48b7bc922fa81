//! How a coordinator peer stops: gracefully on SIGTERM, Ctrl-C or `POST
//! /v1/admin/drain`, at once when its Raft peer fails.
//!
//! A graceful stop, in order:
//! 1. **Drain** ([`crate::api::drain`]): `/ready` answers 503 and new requests get 503 with
//!    `Retry-After`; the requests in flight run on.
//! 2. **Wait** until none is in flight, for the drain's timeout at most (`--drain-timeout`);
//!    past it, what still runs is cut. Cut requests stay open in the journal, and the next
//!    leader runs them on for clients that fetch them again.
//! 3. **Hand over**: a leader names the most up-to-date other voter its successor
//!    ([`NodeHandle::hand_over`]) and waits until it leads, so the cluster does not wait
//!    an election timeout for a leader.
//! 4. **Exit**: the HTTP server closes its connections, and the Raft peer stops.
//!
//! A second signal during the wait skips to the hand-over.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tracing::{error, info, warn};

use crate::api::drain::{Drain, DrainState};
use crate::replication::node::NodeHandle;

/// How long a leader waits for its successor to lead (an election takes about 1 s).
pub const HAND_OVER_WAIT: Duration = Duration::from_secs(5);

/// How often a drain that waits logs what is still in flight.
const PROGRESS_EVERY: Duration = Duration::from_secs(5);

/// Resolves once this peer has drained and handed leadership over: the HTTP server's
/// shutdown signal.
pub async fn until_drained(drain: Arc<Drain>, node: NodeHandle) {
    let mut requested = drain.watch();
    tokio::select! {
        () = stop_signal() => {}
        _ = requested.wait_for(|s| s.draining) => {}
    }
    drain.start();
    let timeout = drain.timeout();
    info!(
        in_flight = drain.state().in_flight,
        timeout_s = timeout.as_secs_f64(),
        "draining: new requests are refused, those in flight run on"
    );
    tokio::select! {
        idle = wait_idle(drain.watch(), timeout) => match idle {
            Ok(()) => info!("drained: no request in flight"),
            Err(left) => warn!(
                in_flight = left,
                "the drain timeout passed: cutting the requests still in flight (the \
                 journal keeps them open for the next leader)"
            ),
        },
        () = stop_signal() => warn!("a second signal: stopping without waiting further"),
    }
    hand_over(&node).await;
}

/// Waits until nothing is in flight, logging progress; `Err` with the count left when
/// `timeout` passes first.
async fn wait_idle(mut state: watch::Receiver<DrainState>, timeout: Duration) -> Result<(), usize> {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let next = deadline.min(tokio::time::Instant::now() + PROGRESS_EVERY);
        let idle = tokio::time::timeout_at(next, state.wait_for(|s| s.in_flight == 0))
            .await
            .is_ok();
        if idle {
            return Ok(());
        }
        let left = state.borrow().in_flight;
        if tokio::time::Instant::now() >= deadline {
            return Err(left);
        }
        info!(in_flight = left, "draining: waiting for requests in flight");
    }
}

/// Hands leadership over when this peer leads, and waits (for [`HAND_OVER_WAIT`] at
/// most) until another peer leads.
async fn hand_over(node: &NodeHandle) {
    let Some(to) = node.hand_over().await else {
        return;
    };
    info!(to = to.0, "handing leadership over");
    let mut role = node.role();
    let led = tokio::time::timeout(HAND_OVER_WAIT, role.wait_for(|r| r.leader == Some(to))).await;
    match led {
        Ok(Ok(_)) => info!(leader = to.0, "leadership handed over"),
        _ => warn!(
            to = to.0,
            "the successor did not lead within {HAND_OVER_WAIT:?}: stopping anyway (the \
             others elect a leader)"
        ),
    }
}

/// SIGTERM or Ctrl-C.
pub async fn stop_signal() {
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending().await,
        }
    };
    tokio::select! {
        () = terminate => info!("SIGTERM: stopping"),
        _ = tokio::signal::ctrl_c() => info!("interrupted: stopping"),
    }
}

/// The exit status of a peer whose Raft stopped (sysexits' EX_SOFTWARE).
pub const RAFT_STOPPED_EXIT: i32 = 70;

/// Exits the process when its Raft peer stops on its own (its store failed): a peer
/// without Raft must not live on answering requests, and a supervisor restarts it from
/// what its data dir holds.
pub async fn fail_stop(node: NodeHandle) {
    let mut failure = node.failure();
    let Ok(reason) = failure.wait_for(Option::is_some).await.map(|r| r.clone()) else {
        return;
    };
    let reason = reason.unwrap_or_default();
    error!(reason, "the raft peer stopped: exiting");
    eprintln!(
        "error: this coordinator peer's Raft stopped ({reason}); exiting so that it restarts \
         from its data dir"
    );
    std::process::exit(RAFT_STOPPED_EXIT);
}
