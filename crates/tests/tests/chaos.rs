//! Chaos and soak (issue 17, item 9): three coordinator peers and two shard groups of the
//! demo model under a steady mixed load — streamed and not, greedy and sampled, short and
//! long prompts, clients that leave in the middle of a stream, every request with an
//! `Idempotency-Key` — while a seeded schedule kills the leader or a follower (kill -9, then
//! a restart from its data dir), kills a shard (`tessera up` restarts it), SIGSTOPs a peer
//! or a shard, cuts a peer off the network (network namespaces, as root) and stalls a
//! peer's disk (a `sleep` on its persist failpoint; only with a coordinator built with the
//! feature `failpoints`, which `scripts/chaos.sh` builds and passes in
//! `TESSERA_CHAOS_COORDINATOR`). Clients retry their key on another peer after a broken
//! connection and resume broken streams with `Last-Event-ID`.
//!
//! It ends with a ledger (printed, and written as JSON to `TESSERA_CHAOS_LEDGER` or
//! `target/chaos-ledger.json`): requests sent, accepted, completed, failed by reason, and
//! lost — accepted but neither finished nor told of an error. The test fails if any is lost
//! or never answered, or if a greedy completion that needed a retry or a resume differs from
//! a clean run of its prompt.
//!
//! `TESSERA_CHAOS_SECONDS` (180), `TESSERA_CHAOS_SEED` (from the clock; printed),
//! `TESSERA_CHAOS_CLIENTS` (4); `TESSERA_CHAOS_NO_RETRY=1` makes clients that give up when
//! their connection breaks, to see the test fail.

use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use serde_json::json;
use tessera_tests::chaos::client::{self, MODEL, Outcome, Prompt, Spec};
use tessera_tests::chaos::ledger::{Applied, Growth, Ledger, Sample};
use tessera_tests::chaos::schedule::{Fault, Planned, Rng, Role, Schedule};
use tessera_tests::netns::{self, Net};
use tessera_tests::up::Up;
use tessera_tests::{
    Cluster, GroupSpec, bin, demo_model, free_port, get, leader_seen_by, metric, open_fds,
    peers_topology_text, post, repo, rss, shard_pid, token_ids,
};

const GROUPS: [&str; 2] = ["grp-a", "grp-b"];
const HOSTS: [&str; 3] = ["c1", "c2", "c3"];

fn env<T: std::str::FromStr>(name: &str) -> Option<T> {
    std::env::var(name).ok().and_then(|v| v.parse().ok())
}

/// The cluster under test and what the faults need of it.
struct Rig {
    cluster: Cluster,
    /// `tessera up` for the shards' host: it restarts a killed shard.
    shards: Up,
    urls: Vec<String>,
    coordinator: PathBuf,
    /// The coordinator binary watches a failpoints file (feature `failpoints`).
    failpoints: bool,
    restarts: [usize; 3],
    /// Last, so that the processes are gone before their namespaces.
    net: Option<Net>,
}

impl Rig {
    fn start(model: &Path) -> Rig {
        let net = Net::create_or_skip(&HOSTS, 17);
        // Each peer on a host of its own (a namespace; loopback without them), the shards
        // on `local` (the root namespace, on the bridge).
        let address = |h: &str| net.as_ref().map_or("127.0.0.1".into(), |n| n.addr(h));
        let mut hosts: Vec<(&str, String)> = HOSTS.iter().map(|h| (*h, address(h))).collect();
        let peers: Vec<(&str, String, String)> = hosts
            .iter()
            .map(|(h, a)| {
                (
                    *h,
                    format!("{a}:{}", free_port()),
                    format!("{a}:{}", free_port()),
                )
            })
            .collect();
        let local = net.as_ref().map_or("127.0.0.1".into(), Net::bridge_addr);
        hosts.push(("local", local));
        let hosts: Vec<(&str, &str)> = hosts.iter().map(|(h, a)| (*h, a.as_str())).collect();
        let groups: Vec<GroupSpec> = GROUPS
            .iter()
            .map(|g| {
                let mut spec = GroupSpec::local(g, MODEL, model, 1);
                spec.kv_memory = "128MiB".into();
                spec
            })
            .collect();
        let text = peers_topology_text(&peers, &hosts, &groups);
        let mut cluster = Cluster::prepare(&text, &peers[0].2).expect("topology and certificates");
        if let Some(net) = &net {
            let namespaces: Vec<(String, String)> = (1..=3)
                .map(|i| (format!("coordinator-{i}"), net.ns(HOSTS[i - 1])))
                .collect();
            cluster.wrap = netns::wrap(namespaces);
        }
        let coordinator = std::env::var_os("TESSERA_CHAOS_COORDINATOR")
            .map_or_else(|| bin("tessera-coordinator"), PathBuf::from);
        let urls: Vec<String> = peers.iter().map(|p| format!("http://{}", p.2)).collect();
        let shards = Up::start_host(&cluster.topology, &cluster.certs, "local", &urls[0], &[]);
        let mut rig = Rig {
            cluster,
            shards,
            urls,
            coordinator,
            failpoints: false,
            restarts: [0; 3],
            net,
        };
        for id in 1..=3 {
            rig.start_peer(id);
        }
        rig.wait_serving(Duration::from_secs(120));
        let log = std::fs::read_to_string(&rig.cluster.proc("coordinator-1").log);
        rig.failpoints = log.is_ok_and(|l| l.contains("failpoints: watching"));
        rig
    }

    fn start_peer(&mut self, id: usize) {
        let file = self.failpoints_file(id);
        std::fs::write(&file, "").expect("failpoints file");
        let file = file.display().to_string();
        let env = [("TESSERA_FAILPOINTS_FILE", file.as_str())];
        self.cluster
            .start_coordinator_peer_with(id, &self.coordinator, &env)
            .expect("a coordinator peer starts");
    }

    fn failpoints_file(&self, id: usize) -> PathBuf {
        self.cluster.dir.path().join(format!("failpoints-{id}"))
    }

    fn logs(&self) -> String {
        format!(
            "{}\n---- tessera up (shards)\n{}",
            self.cluster.logs(),
            self.shards.log()
        )
    }

    /// Waits until every peer agrees on a leader and every group serves.
    fn wait_serving(&self, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(leader) = self.leader()
                && let Ok((200, view)) = get(&format!("{}/v1/cluster", self.urls[leader - 1]))
                && let Some(groups) = view["groups"].as_array()
                && groups.len() == GROUPS.len()
                && groups.iter().all(|g| g["state"] == "serving")
            {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the cluster did not serve within {timeout:?}\n{}",
                self.logs()
            );
            thread::sleep(Duration::from_millis(250));
        }
    }

    /// The leader at least two peers agree on, asked for up to 20 s.
    fn leader(&self) -> Option<usize> {
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            let seen: Vec<u64> = self
                .urls
                .iter()
                .filter_map(|u| leader_seen_by(u).map(|(l, _)| l))
                .collect();
            if let Some(&l) = seen
                .iter()
                .find(|l| seen.iter().filter(|s| s == l).count() >= 2)
            {
                return Some(l as usize);
            }
            thread::sleep(Duration::from_millis(200));
        }
        None
    }

    /// The peer `role` names now.
    fn peer(&self, role: Role) -> Option<usize> {
        let leader = self.leader()?;
        match role {
            Role::Leader => Some(leader),
            Role::Follower { pick } => {
                let followers: Vec<usize> = (1..=3).filter(|&id| id != leader).collect();
                Some(followers[pick as usize % followers.len()])
            }
        }
    }

    fn shard(&self, group: usize) -> Option<i32> {
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if let Some(pid) = shard_pid(&self.shards.topology, GROUPS[group], 0) {
                return Some(pid);
            }
            thread::sleep(Duration::from_millis(200));
        }
        None
    }

    /// Applies one fault, holds it, heals it: what was done.
    fn apply(&mut self, planned: &Planned) -> String {
        let hold = planned.hold;
        let role = match planned.fault {
            Fault::KillPeer(r)
            | Fault::StopPeer(r)
            | Fault::PartitionPeer(r)
            | Fault::DiskStall(r) => Some(r),
            Fault::KillShard(_) | Fault::StopShard(_) => None,
        };
        let peer = match role {
            Some(role) => match self.peer(role) {
                Some(id) => id,
                None => return "skipped: no leader agreed on within 20 s".into(),
            },
            None => 0,
        };
        let name = format!("coordinator-{peer}");
        match planned.fault {
            Fault::KillPeer(_) => {
                self.cluster.signal(&name, Signal::SIGKILL);
                let _ = self.cluster.proc(&name).child.wait();
                thread::sleep(hold);
                self.start_peer(peer);
                self.restarts[peer - 1] += 1;
                format!("killed peer {peer}, restarted it")
            }
            Fault::StopPeer(_) => {
                self.cluster.signal(&name, Signal::SIGSTOP);
                thread::sleep(hold);
                self.cluster.signal(&name, Signal::SIGCONT);
                format!("stopped peer {peer}, continued it")
            }
            Fault::PartitionPeer(_) => {
                let Some(net) = &self.net else {
                    return "SKIPPED: no network namespaces (needs root)".into();
                };
                let host = HOSTS[peer - 1];
                net.cut(host).expect("cut the link");
                thread::sleep(hold);
                net.heal(host).expect("heal the link");
                format!("cut peer {peer} off, healed it")
            }
            Fault::DiskStall(_) => {
                if !self.failpoints {
                    return "SKIPPED: the coordinator has no failpoints (build it with the \
                            feature; scripts/chaos.sh does)"
                        .into();
                }
                let file = self.failpoints_file(peer);
                std::fs::write(&file, "raft::before_persist=sleep(1000)").expect("failpoints");
                thread::sleep(hold);
                std::fs::write(&file, "").expect("failpoints");
                format!("stalled peer {peer}'s persists, healed them")
            }
            Fault::KillShard(g) => match self.shard(g) {
                Some(pid) => {
                    let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
                    format!("killed shard {}/0 (pid {pid})", GROUPS[g])
                }
                None => format!("skipped: no shard {}/0 running", GROUPS[g]),
            },
            Fault::StopShard(g) => match self.shard(g) {
                Some(pid) => {
                    let _ = kill(Pid::from_raw(pid), Signal::SIGSTOP);
                    thread::sleep(hold);
                    let _ = kill(Pid::from_raw(pid), Signal::SIGCONT);
                    format!("stopped shard {}/0 (pid {pid}), continued it", GROUPS[g])
                }
                None => format!("skipped: no shard {}/0 running", GROUPS[g]),
            },
        }
    }

    /// Every process's resources now: the peers (with their journal), then the shards.
    fn sample(&mut self) -> Vec<(String, Sample)> {
        let mut samples = Vec::new();
        for id in 1..=3 {
            let name = format!("coordinator-{id}");
            let pid = self.cluster.proc(&name).child.id() as i32;
            let url = &self.urls[id - 1];
            let gauge = |name| metric(url, name, "").unwrap_or(f64::NAN);
            samples.push((
                name,
                Sample {
                    pid,
                    rss: rss(pid),
                    fds: open_fds(pid),
                    journal_bytes: gauge("tessera_journal_bytes"),
                    journal_entries: gauge("tessera_journal_entries"),
                },
            ));
        }
        for (g, group) in GROUPS.iter().enumerate() {
            let pid = self.shard(g).unwrap_or_default();
            let sample = Sample {
                pid,
                rss: rss(pid),
                fds: open_fds(pid),
                ..Sample::default()
            };
            samples.push((format!("{group}/0"), sample));
        }
        samples
    }

    /// Greedy tokens of every prompt, one request at a time on an unloaded cluster.
    fn clean(&self, prompts: &[Prompt]) -> Vec<Vec<u32>> {
        prompts
            .iter()
            .map(|p| {
                let body = json!({
                    "model": MODEL, "prompt": p.tokens, "max_tokens": p.max_tokens,
                    "temperature": 0, "ignore_eos": true, "return_token_ids": true,
                });
                let (status, answer) = post(&format!("{}/v1/completions", self.urls[0]), &body)
                    .unwrap_or_else(|e| panic!("{e:#}\n{}", self.logs()));
                assert_eq!(status, 200, "{answer}\n{}", self.logs());
                token_ids(&answer).expect("token ids")
            })
            .collect()
    }
}

/// One client: requests one after another until `stop`.
fn client(
    urls: &[String],
    n: usize,
    seed: u64,
    prompts: &[Prompt],
    stop: &AtomicBool,
    resilient: bool,
) -> Vec<Outcome> {
    let mut rng = Rng::new(seed.wrapping_add(1 + n as u64));
    let mut outcomes = Vec::new();
    while !stop.load(Ordering::Relaxed) {
        let key = format!("chaos-{seed}-{n}-{}", outcomes.len());
        let spec = Spec::draw(&mut rng, prompts.len(), key);
        let outcome = client::run(
            urls,
            n + outcomes.len(),
            &spec,
            &prompts[spec.prompt],
            resilient,
        );
        if !matches!(
            outcome.end,
            client::End::Completed { .. } | client::End::Left
        ) {
            eprintln!(
                "chaos: {} ended {:?} after {:?}",
                spec.key, outcome.end, outcome.took
            );
        }
        outcomes.push(outcome);
        thread::sleep(Duration::from_millis(rng.below(300)));
    }
    outcomes
}

#[test]
fn chaos_under_mixed_load_loses_no_request() {
    let Some(model) = demo_model() else {
        return;
    };
    let seconds: u64 = env("TESSERA_CHAOS_SECONDS").unwrap_or(180);
    let seed: u64 = env("TESSERA_CHAOS_SEED").unwrap_or_else(|| {
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
        now.map_or(1, |d| d.as_secs())
    });
    let clients: usize = env("TESSERA_CHAOS_CLIENTS").unwrap_or(4);
    let resilient = std::env::var("TESSERA_CHAOS_NO_RETRY").as_deref() != Ok("1");
    let schedule = Schedule::new(seed, seconds, GROUPS.len());
    eprintln!("{schedule}");

    let started = Instant::now();
    let mut rig = Rig::start(&model);
    eprintln!(
        "chaos: cluster up in {:?}; peers {:?}; partitions {}; disk stalls {}",
        started.elapsed(),
        rig.urls,
        if rig.net.is_some() {
            "by network namespaces"
        } else {
            "SKIPPED (no namespaces)"
        },
        if rig.failpoints {
            "by failpoints"
        } else {
            "SKIPPED (no failpoints in the coordinator)"
        },
    );
    let prompts = client::prompts(seed);
    let clean = rig.clean(&prompts);
    let before = rig.sample();

    let stop = AtomicBool::new(false);
    let outcomes = Mutex::new(Vec::new());
    let urls = rig.urls.clone();
    let load_start = Instant::now();
    let applied = thread::scope(|s| {
        for n in 0..clients {
            let (urls, prompts, stop, outcomes) = (&urls, &prompts, &stop, &outcomes);
            s.spawn(move || {
                let mine = client(urls, n, seed, prompts, stop, resilient);
                outcomes.lock().expect("outcomes").extend(mine);
            });
        }
        let mut applied = Vec::new();
        for planned in &schedule.faults {
            if let Some(wait) = (load_start + planned.at).checked_duration_since(Instant::now()) {
                thread::sleep(wait);
            }
            let at_s = load_start.elapsed().as_secs_f64();
            let note = rig.apply(planned);
            eprintln!("chaos: t+{at_s:.1}s {}: {note}", planned.fault.kind());
            applied.push(Applied {
                at_s,
                kind: planned.fault.kind(),
                note,
            });
        }
        if let Some(rest) = Duration::from_secs(seconds).checked_sub(load_start.elapsed()) {
            thread::sleep(rest);
        }
        stop.store(true, Ordering::Relaxed);
        applied
    });
    eprintln!("chaos: load stopped after {:?}", load_start.elapsed());
    rig.wait_serving(Duration::from_secs(60));
    let after = rig.sample();

    let outcomes = outcomes.into_inner().expect("outcomes");
    let mut ledger = Ledger::tally(seed, seconds, &outcomes, &clean);
    ledger.faults = applied;
    let shard_kills = |g: &str| {
        ledger
            .faults
            .iter()
            .filter(|f| f.kind == "kill-shard" && f.note.contains(&format!("shard {g}/0 ")))
            .count()
    };
    ledger.processes = before
        .into_iter()
        .zip(after)
        .enumerate()
        .map(|(i, ((name, start), (_, end)))| Growth {
            restarts: if i < 3 {
                rig.restarts[i]
            } else {
                shard_kills(GROUPS[i - 3])
            },
            name,
            start,
            end,
        })
        .collect();
    let json = ledger.to_json();
    let path = std::env::var_os("TESSERA_CHAOS_LEDGER")
        .map_or_else(|| repo().join("target/chaos-ledger.json"), PathBuf::from);
    if let Some(dir) = path.parent() {
        let _ = std::fs::create_dir_all(dir);
    }
    let text = serde_json::to_string_pretty(&json).expect("ledger JSON");
    std::fs::write(&path, &text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    eprintln!("{}ledger written to {}", ledger.summary(), path.display());
    eprintln!("chaos: the whole run took {:?}", started.elapsed());

    assert!(
        ledger.lost.is_empty() && ledger.unanswered.is_empty(),
        "{} lost, {} never answered (seed {seed}):\n{}\n{}\n{}",
        ledger.lost.len(),
        ledger.unanswered.len(),
        ledger.lost.join("\n"),
        ledger.unanswered.join("\n"),
        rig.logs()
    );
    assert!(
        ledger.greedy_differ.1.is_empty(),
        "greedy completions after a retry or resume differ from the clean run (seed {seed}):\n{}",
        ledger.greedy_differ.1.join("\n")
    );
    assert!(ledger.completed > 0, "nothing completed\n{}", rig.logs());
}
