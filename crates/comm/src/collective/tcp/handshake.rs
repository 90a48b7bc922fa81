//! The handshake of one ring connection, between the rank that dialed (the connector, rank
//! `r`) and the rank that accepted (the acceptor, rank `r + 1`). Four messages, each of a
//! fixed size:
//!
//! 1. connector → acceptor: its [`Hello`] (with a fresh nonce);
//! 2. acceptor → connector: its hello, sent as soon as the first one starts with the magic,
//!    even one of the wrong version or rank, so that the connector can say why it failed;
//! 3. connector → acceptor: the connector's proof over both hellos ([`JoinKey::prove`]);
//! 4. acceptor → connector: the acceptor's proof, only once the connector's verified.
//!
//! So the acceptor shows nothing derived from the token to a connector that has not proven
//! it holds the token first. The proofs and checks are in `hello`; the rounds of dialing
//! and accepting in `join`. Every read and write gives up at the connection's own deadline,
//! so a peer that sends nothing, or a byte at a time, holds the connection no longer.

use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use super::hello::{HELLO_BYTES, Hello, JoinKey, PROOF_BYTES, Refusal, Role};
use super::millis;

/// A connection during its handshake: fixed-size messages each way.
pub(super) trait Channel {
    fn send(&mut self, bytes: &[u8]) -> Result<(), Refusal>;
    /// Fills `buf` or fails; a connection that ends first is [`Refusal::Closed`].
    fn receive(&mut self, buf: &mut [u8]) -> Result<(), Refusal>;
}

/// A TCP connection whose handshake must finish by `until`.
#[derive(Debug)]
pub(super) struct Timed<'a> {
    stream: &'a TcpStream,
    started: Instant,
    until: Instant,
}

impl Timed<'_> {
    pub(super) fn new(stream: &TcpStream, started: Instant, until: Instant) -> Timed<'_> {
        Timed {
            stream,
            started,
            until,
        }
    }

    /// The time left, or the refusal of a connection that used it all.
    fn wait(&self) -> Result<Duration, Refusal> {
        self.until
            .checked_duration_since(Instant::now())
            .filter(|d| !d.is_zero())
            .ok_or(Refusal::Stalled {
                waited_ms: millis(self.started.elapsed()),
            })
    }

    fn failed(&self, e: io::Error) -> Refusal {
        match e.kind() {
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => Refusal::Stalled {
                waited_ms: millis(self.started.elapsed()),
            },
            io::ErrorKind::UnexpectedEof
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::BrokenPipe => Refusal::Closed,
            _ => Refusal::Io {
                message: e.to_string(),
            },
        }
    }
}

impl Channel for Timed<'_> {
    fn send(&mut self, bytes: &[u8]) -> Result<(), Refusal> {
        // Messages are under 50 bytes: one write into an empty send buffer.
        let wait = self.wait()?;
        self.stream
            .set_write_timeout(Some(wait))
            .map_err(|e| self.failed(e))?;
        self.stream.write_all(bytes).map_err(|e| self.failed(e))
    }

    fn receive(&mut self, buf: &mut [u8]) -> Result<(), Refusal> {
        let mut got = 0;
        while got < buf.len() {
            // Each read waits only for what is left of the connection's time.
            let wait = self.wait()?;
            self.stream
                .set_read_timeout(Some(wait))
                .map_err(|e| self.failed(e))?;
            match self.stream.read(&mut buf[got..]) {
                Ok(0) => return Err(Refusal::Closed),
                Ok(n) => got += n,
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock
                            | io::ErrorKind::TimedOut
                            | io::ErrorKind::Interrupted
                    ) => {}
                Err(e) => return Err(self.failed(e)),
            }
        }
        Ok(())
    }
}

fn receive_hello(channel: &mut impl Channel) -> Result<Hello, Refusal> {
    let mut h = [0u8; HELLO_BYTES];
    channel.receive(&mut h)?;
    Hello::decode(&h)
}

fn receive_proof(channel: &mut impl Channel) -> Result<[u8; PROOF_BYTES], Refusal> {
    let mut proof = [0u8; PROOF_BYTES];
    channel.receive(&mut proof)?;
    Ok(proof)
}

/// The connector's side: `mine` is this rank's hello, `next` the rank it dialed.
pub(super) fn as_connector(
    channel: &mut impl Channel,
    key: &JoinKey,
    mine: &Hello,
    next: u32,
) -> Result<(), Refusal> {
    channel.send(&mine.encode())?;
    let theirs = receive_hello(channel)?;
    theirs.expect(next, mine.world)?;
    channel.send(&key.prove(Role::Connector, mine, &theirs))?;
    let proof = receive_proof(channel)?;
    key.verify(Role::Acceptor, mine, &theirs, &proof)
}

/// The acceptor's side: `mine` is this rank's hello, `prev` the rank it waits for.
pub(super) fn as_acceptor(
    channel: &mut impl Channel,
    key: &JoinKey,
    mine: &Hello,
    prev: u32,
) -> Result<(), Refusal> {
    let theirs = receive_hello(channel)?;
    channel.send(&mine.encode())?;
    theirs.expect(prev, mine.world)?;
    let proof = receive_proof(channel)?;
    key.verify(Role::Connector, &theirs, mine, &proof)?;
    channel.send(&key.prove(Role::Acceptor, &theirs, mine))
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc::{Receiver, Sender, channel};

    use super::*;
    use crate::collective::GroupToken;

    /// One end of an in-memory connection; a dropped end closes it.
    struct Pipe {
        tx: Sender<Vec<u8>>,
        rx: Receiver<Vec<u8>>,
        pending: Vec<u8>,
    }

    fn pipe() -> (Pipe, Pipe) {
        let ((a_tx, a_rx), (b_tx, b_rx)) = (channel(), channel());
        let end = |tx, rx| Pipe {
            tx,
            rx,
            pending: Vec::new(),
        };
        (end(a_tx, b_rx), end(b_tx, a_rx))
    }

    impl Channel for Pipe {
        fn send(&mut self, bytes: &[u8]) -> Result<(), Refusal> {
            self.tx.send(bytes.to_vec()).map_err(|_| Refusal::Closed)
        }

        fn receive(&mut self, buf: &mut [u8]) -> Result<(), Refusal> {
            while self.pending.len() < buf.len() {
                let more = self.rx.recv().map_err(|_| Refusal::Closed)?;
                self.pending.extend(more);
            }
            buf.copy_from_slice(&self.pending[..buf.len()]);
            self.pending.drain(..buf.len());
            Ok(())
        }
    }

    fn run(
        connector_token: u8,
        acceptor_token: u8,
        connector_rank: u32,
    ) -> (Result<(), Refusal>, Result<(), Refusal>) {
        let peers = vec!["a:1".to_string(), "b:2".to_string()];
        let (mut c, mut a) = pipe();
        let c_key = JoinKey::new(&GroupToken([connector_token; 32]), &peers);
        let a_key = JoinKey::new(&GroupToken([acceptor_token; 32]), &peers);
        let acceptor = std::thread::spawn(move || {
            let result = as_acceptor(&mut a, &a_key, &Hello::fresh(1, 2).unwrap(), 0);
            drop(a);
            result
        });
        let mine = Hello::fresh(connector_rank, 2).unwrap();
        let connector = as_connector(&mut c, &c_key, &mine, 1);
        drop(c);
        (connector, acceptor.join().unwrap())
    }

    #[test]
    fn the_same_token_authenticates_both_ends() {
        assert_eq!(run(4, 4, 0), (Ok(()), Ok(())));
    }

    #[test]
    fn another_token_is_refused_by_both_ends() {
        // The acceptor refuses the connector's proof and closes without proving its own.
        assert_eq!(run(4, 5, 0), (Err(Refusal::Closed), Err(Refusal::BadProof)));
    }

    #[test]
    fn a_wrong_rank_is_refused_before_any_proof() {
        let (connector, acceptor) = run(4, 4, 1);
        assert_eq!(connector, Err(Refusal::Closed));
        assert_eq!(
            acceptor,
            Err(Refusal::Rank {
                theirs: 1,
                expected: 0
            })
        );
    }
}
