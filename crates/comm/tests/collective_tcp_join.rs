//! Joining the TCP ring while others connect to a rank's port first: connections that send
//! garbage, close at once, prove another token or stall are refused and dropped, the group
//! still forms and reduces correctly; a peer of another protocol version is named.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::thread;
use std::time::{Duration, Instant};

use tessera_comm::collective::Op;
use tessera_comm::collective::tcp::TcpRing;
use tessera_comm::{Collective, CollectiveError, GroupToken};
use tessera_topology::Rank;

use common::{MARGIN, SHORT, config, input, loopback_peers, spawn_rank};

/// The join's deadline in the tests that must form a group: far above the three seconds a
/// stalled connection may hold its place, so only a join that waits on it fails.
const JOIN: Duration = Duration::from_secs(10);
const TOKEN: GroupToken = GroupToken([3; 32]);

/// Connects to `addr` once something listens there.
fn dial(addr: &str) -> TcpStream {
    let until = Instant::now() + JOIN;
    loop {
        match TcpStream::connect(addr) {
            Ok(stream) => return stream,
            Err(_) if Instant::now() < until => thread::sleep(Duration::from_millis(5)),
            Err(e) => panic!("{addr} never listened: {e}"),
        }
    }
}

/// Waits until the rank at the other end closes `stream`, having refused it.
fn closed_by_peer(mut stream: TcpStream) {
    stream
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let mut rest = Vec::new();
    // A reset (the peer closed with our bytes unread) is a close too.
    let _ = stream.read_to_end(&mut rest);
}

/// Starts rank 1 of a ring of 2, runs `rogue` against its address (rank 1 has nothing else
/// to accept meanwhile), then starts rank 0: both must join and all-reduce correctly.
/// Returns what `rogue` returned, after the group formed.
fn joins_despite<R>(rogue: impl FnOnce(&[String]) -> R) -> R {
    let peers = loopback_peers(2);
    let rank1 = spawn_rank(1, &peers, &TOKEN, config(JOIN));
    let held = rogue(&peers);
    let rank0 = spawn_rank(0, &peers, &TOKEN, config(JOIN));
    let rings = [rank0, rank1].map(|h| h.join().unwrap().expect("joins despite the rogue"));
    let len = 1001;
    let workers = rings.map(|mut ring| {
        thread::spawn(move || {
            let mut data = input(ring.rank().0 as usize, len);
            ring.all_reduce_sum(&mut data).unwrap();
            data
        })
    });
    let sums = workers.map(|h| h.join().unwrap());
    let expected: Vec<f32> = input(0, len)
        .iter()
        .zip(input(1, len))
        .map(|(a, b)| a + b)
        .collect();
    assert_eq!(sums, [expected.clone(), expected]);
    held
}

#[test]
fn garbage_and_early_closes_do_not_stop_the_join() {
    joins_despite(|peers| {
        let mut garbage = dial(&peers[1]);
        garbage
            .write_all(b"GET / HTTP/1.1\r\nHost: tessera\r\n\r\n0123456789abcdef0123456789")
            .unwrap();
        closed_by_peer(garbage);
        drop(dial(&peers[1]));
        // A hello cut short.
        let mut short = dial(&peers[1]);
        short.write_all(&0x5452_4e47u32.to_le_bytes()).unwrap();
        drop(short);
    });
}

#[test]
fn a_peer_with_another_token_does_not_stop_the_join() {
    joins_despite(|peers| {
        // A full rank 0 of another group (or epoch): its hello is well formed, its proof
        // is wrong. It is refused too, and gives its address back at its deadline.
        let rogue = TcpRing::connect(Rank(0), peers, &GroupToken([9; 32]), config(SHORT));
        assert!(
            matches!(
                &rogue,
                Err(CollectiveError::Unauthenticated {
                    op: Op::Connect,
                    peer: Rank(1),
                    ..
                })
            ),
            "{rogue:?}"
        );
    });
}

#[test]
fn stalled_connections_do_not_stop_the_join() {
    let stalled = joins_despite(|peers| {
        let stalled: Vec<TcpStream> = (0..3).map(|_| dial(&peers[1])).collect();
        // Queued ahead of rank 0's connection.
        thread::sleep(Duration::from_millis(50));
        stalled
    });
    // The join shut them down once rank 0 was authenticated, well before their timeout.
    let started = Instant::now();
    for stream in stalled {
        closed_by_peer(stream);
    }
    assert!(started.elapsed() < MARGIN, "{:?}", started.elapsed());
}

#[test]
fn a_peer_of_another_version_is_refused_by_name() {
    let peers = loopback_peers(2);
    let started = Instant::now();
    let rank1 = spawn_rank(1, &peers, &TOKEN, config(SHORT));
    // Version 1's hello: magic, version, rank, world, then the token itself.
    let mut old = dial(&peers[1]);
    let mut hello = Vec::new();
    for word in [0x5452_4e47u32, 1, 0, 2] {
        hello.extend_from_slice(&word.to_le_bytes());
    }
    hello.extend_from_slice(&TOKEN.0);
    old.write_all(&hello).unwrap();
    // The answer is a hello of the same size that names the current version.
    let mut answer = [0u8; 48];
    old.read_exact(&mut answer).unwrap();
    assert_eq!(answer[..4], 0x5452_4e47u32.to_le_bytes());
    assert_eq!(answer[4..8], 2u32.to_le_bytes());
    let result = rank1.join().unwrap();
    assert!(
        matches!(
            &result,
            Err(CollectiveError::Unauthenticated { op: Op::Connect, peer: Rank(0), reason })
                if reason.contains("speaks ring protocol version 1")
        ),
        "{result:?}"
    );
    assert!(started.elapsed() < SHORT + MARGIN);
}
