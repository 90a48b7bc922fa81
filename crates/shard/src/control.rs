//! The shard's control task: keeps one QUIC connection (mutual TLS) to the coordinator,
//! registers, relays coordinator messages to the compute thread and the thread's
//! messages back. A lost connection is retried with backoff; the weights stay loaded
//! and the coordinator re-assigns the group under a new epoch.

use std::net::SocketAddr;
use std::sync::{Arc, mpsc};
use std::time::Duration;

use tessera_comm::certs::{Credentials, Identity};
use tessera_comm::proto::{CoordinatorMsg, HeldSeq, PROTOCOL_VERSION, Register, ShardMsg};
use tessera_comm::{quic, wire};
use tessera_topology::{PeerId, Rank};
use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender, unbounded_channel};
use tracing::{debug, info, warn};

use crate::error::ShardError;
use crate::worker::Command;

/// Where and who this shard is.
#[derive(Debug)]
pub struct ControlConfig {
    pub group: String,
    pub rank: Rank,
    pub device: String,
    /// Coordinator peers to try, in order.
    pub coordinators: Vec<(PeerId, String)>,
    pub credentials: Credentials,
}

/// Backoff between connection attempts: quick at first (the coordinator may be starting
/// next to us), capped so that a restarted coordinator is found within two seconds.
const RETRY_MIN: Duration = Duration::from_millis(100);
const RETRY_MAX: Duration = Duration::from_secs(2);

/// How one connection ended.
enum Ended {
    /// Lost or closed: reconnect.
    Lost,
    /// The coordinator told this shard to exit.
    Shutdown,
    /// That peer is not the Raft leader; the leader, if it knows one.
    NotLeader(Option<PeerId>),
}

/// Runs until the coordinator sends `Shutdown` or refuses this shard. Only the Raft
/// leader of the coordinator peers takes a registration; a follower names the leader.
pub async fn run(
    config: ControlConfig,
    commands: mpsc::Sender<Command>,
    mut events: UnboundedReceiver<ShardMsg>,
) -> Result<(), ShardError> {
    let config = Arc::new(config);
    let (leaders_tx, mut leaders) = unbounded_channel();
    if config.coordinators.len() > 1 {
        for (peer, addr) in &config.coordinators {
            let standby = Standby {
                config: Arc::clone(&config),
                peer: *peer,
                addr: addr.clone(),
                leaders: leaders_tx.clone(),
            };
            tokio::spawn(standby.run());
        }
    }
    let mut delay = RETRY_MIN;
    let mut leader: Option<PeerId> = None;
    loop {
        // The latest announcement wins.
        while let Ok(peer) = leaders.try_recv() {
            leader = Some(peer);
        }
        let mut redirected = false;
        for (peer, addr) in attempt_order(&config.coordinators, leader.take()) {
            let Some(target) = resolve(addr).await else {
                warn!(peer = %peer, addr, "cannot resolve coordinator address");
                continue;
            };
            let identity = Identity::Coordinator(*peer);
            let endpoint = quic::client_endpoint_for(target, &config.credentials)?;
            let connection = match quic::connect(&endpoint, target, &identity).await {
                Ok(c) => c,
                Err(error) => {
                    warn!(peer = %peer, addr, %error, "coordinator not reachable");
                    continue;
                }
            };
            delay = RETRY_MIN;
            info!(peer = %peer, addr, "connected to coordinator");
            let link = Link {
                peer: *peer,
                connection: &connection,
            };
            match serve(&config, link, &commands, &mut events, &mut leaders).await {
                Ok(Ended::Shutdown) => return Ok(()),
                Ok(Ended::Lost) => warn!(peer = %peer, "coordinator connection lost"),
                Ok(Ended::NotLeader(hint)) => {
                    info!(peer = %peer, leader = ?hint, "not the leader");
                    if hint.is_some_and(|h| h != *peer) {
                        leader = hint;
                        redirected = true;
                        break;
                    }
                }
                Err(error) => return Err(error),
            }
        }
        if redirected {
            // Straight to the leader, after a breath (its view may be a moment old).
            tokio::time::sleep(RETRY_MIN).await;
            continue;
        }
        tokio::select! {
            () = tokio::time::sleep(delay) => delay = (delay * 2).min(RETRY_MAX),
            Some(peer) = leaders.recv() => {
                leader = Some(peer);
                delay = RETRY_MIN;
            }
        }
    }
}

/// The registered connection `serve` runs on.
struct Link<'a> {
    peer: PeerId,
    connection: &'a quinn::Connection,
}

/// Pause between attempts of a standby connection.
const STANDBY_RETRY: Duration = Duration::from_secs(1);

/// A standby connection to one coordinator peer: it says when that peer starts leading.
struct Standby {
    config: Arc<ControlConfig>,
    peer: PeerId,
    addr: String,
    leaders: UnboundedSender<PeerId>,
}

impl Standby {
    async fn run(self) {
        while !self.leaders.is_closed() {
            if let Err(error) = self.hold().await {
                debug!(peer = %self.peer, %error, "standby connection ended");
            }
            tokio::time::sleep(STANDBY_RETRY).await;
        }
    }

    async fn hold(&self) -> Result<(), ShardError> {
        let target = resolve(&self.addr)
            .await
            .ok_or_else(|| ShardError::Resolve {
                addr: self.addr.clone(),
            })?;
        let endpoint = quic::client_endpoint_for(target, &self.config.credentials)?;
        let identity = Identity::Coordinator(self.peer);
        let connection = quic::connect(&endpoint, target, &identity).await?;
        let (mut send, mut recv) = connection.open_bi().await?;
        let standby = ShardMsg::Standby(register(&self.config, Vec::new()));
        wire::write_frame(&mut send, &standby).await?;
        loop {
            match wire::read_frame::<_, CoordinatorMsg>(&mut recv, STANDBY_FRAME_BYTES).await? {
                Some(CoordinatorMsg::Leading { peer, term }) => {
                    debug!(%peer, %term, "a coordinator peer leads");
                    let _ = self.leaders.send(peer);
                }
                Some(CoordinatorMsg::Refused { error }) => {
                    return Err(ShardError::Refused {
                        message: error.message,
                    });
                }
                Some(_) => {}
                None => return Ok(()),
            }
        }
    }
}

/// The largest frame a standby connection carries (announcements are a few bytes).
const STANDBY_FRAME_BYTES: usize = 4096;

fn register(config: &ControlConfig, held: Vec<HeldSeq>) -> Register {
    Register {
        held,
        version: PROTOCOL_VERSION,
        group: config.group.clone(),
        rank: config.rank,
        pid: std::process::id(),
        device: config.device.clone(),
    }
}

/// How long a registration waits for the compute thread's report of the sequences it
/// holds: it answers after the step it is running (a step that waits on a dead rank ends
/// at the collective deadline).
const HELD_TIMEOUT: Duration = Duration::from_secs(30);

/// The journaled sequences the compute thread holds, once every plan of the old
/// connection has run; none when it does not answer in time.
async fn held(commands: &mpsc::Sender<Command>) -> Result<Vec<HeldSeq>, ShardError> {
    let (reply, answer) = tokio::sync::oneshot::channel();
    commands
        .send(Command::Held(reply))
        .map_err(|_| ShardError::ComputeStopped)?;
    match tokio::time::timeout(HELD_TIMEOUT, answer).await {
        Ok(Ok(held)) => Ok(held),
        Ok(Err(_)) => Err(ShardError::ComputeStopped),
        Err(_) => {
            warn!("the compute thread did not report its sequences in time; registering without");
            Ok(Vec::new())
        }
    }
}

/// The peers to try, the known leader first, then the others in topology order.
fn attempt_order(
    peers: &[(PeerId, String)],
    leader: Option<PeerId>,
) -> impl Iterator<Item = &(PeerId, String)> {
    let first = peers.iter().filter(move |(p, _)| Some(*p) == leader);
    first.chain(peers.iter().filter(move |(p, _)| Some(*p) != leader))
}

async fn resolve(addr: &str) -> Option<SocketAddr> {
    tokio::net::lookup_host(addr).await.ok()?.next()
}

/// One registered connection: coordinator frames go to the compute thread, its messages
/// come back. Returns `Err` only for a refusal, which retrying would not change.
async fn serve(
    config: &ControlConfig,
    link: Link<'_>,
    commands: &mpsc::Sender<Command>,
    events: &mut UnboundedReceiver<ShardMsg>,
    leaders: &mut UnboundedReceiver<PeerId>,
) -> Result<Ended, ShardError> {
    let Ok((mut send, mut recv)) = link.connection.open_bi().await else {
        return Ok(Ended::Lost);
    };
    let register = ShardMsg::Register(register(config, held(commands).await?));
    if wire::write_frame(&mut send, &register).await.is_err() {
        return Ok(Ended::Lost);
    }
    // Messages the compute thread produced for an earlier connection are stale.
    while events.try_recv().is_ok() {}
    loop {
        tokio::select! {
            frame = wire::read_frame::<_, CoordinatorMsg>(&mut recv, wire::MAX_FRAME_BYTES) => {
                let msg = match frame {
                    Ok(Some(msg)) => msg,
                    Ok(None) => return Ok(Ended::Lost),
                    Err(error) => {
                        warn!(%error, "bad frame from coordinator");
                        return Ok(Ended::Lost);
                    }
                };
                let command = match msg {
                    CoordinatorMsg::Assign(a) => {
                        info!(epoch = %a.epoch, term = %a.term, "assigned");
                        Command::Assign(a)
                    }
                    CoordinatorMsg::Step(plan) => Command::Step(plan),
                    CoordinatorMsg::NcclId { epoch, id } => Command::NcclId { epoch, id },
                    // Announcements belong on standby connections.
                    CoordinatorMsg::Drain | CoordinatorMsg::Leading { .. } => continue,
                    CoordinatorMsg::Shutdown => {
                        info!("coordinator asked this shard to exit");
                        return Ok(Ended::Shutdown);
                    }
                    CoordinatorMsg::Refused { error } => {
                        return Err(ShardError::Refused { message: error.message });
                    }
                    CoordinatorMsg::NotLeader { leader } => {
                        return Ok(Ended::NotLeader(leader));
                    }
                };
                commands.send(command).map_err(|_| ShardError::ComputeStopped)?;
            }
            Some(peer) = leaders.recv() => {
                if peer != link.peer {
                    info!(leader = %peer, "another coordinator peer leads now: moving over");
                    return Ok(Ended::NotLeader(Some(peer)));
                }
            }
            event = events.recv() => {
                let Some(event) = event else { return Err(ShardError::ComputeStopped) };
                if wire::write_frame(&mut send, &event).await.is_err() {
                    return Ok(Ended::Lost);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_known_leader_is_tried_first_then_the_rest_in_order() {
        let peers: Vec<(PeerId, String)> = (1..=3).map(|i| (PeerId(i), format!("h{i}"))).collect();
        let ids = |leader| {
            attempt_order(&peers, leader)
                .map(|(p, _)| p.0)
                .collect::<Vec<_>>()
        };
        assert_eq!(ids(None), [1, 2, 3]);
        assert_eq!(ids(Some(PeerId(2))), [2, 1, 3]);
        // A leader not in the topology (a peer added since) changes nothing here.
        assert_eq!(ids(Some(PeerId(9))), [1, 2, 3]);
    }
}
