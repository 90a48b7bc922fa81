use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tessera_comm::proto::{FinishReason, Sampling};

use super::*;

fn request(prompt: &[u32]) -> GenerateRequest {
    GenerateRequest {
        model: "m".into(),
        prompt: prompt.to_vec(),
        max_tokens: 16,
        sampling: Sampling::default(),
        stop_token_ids: vec![2],
        stop: Vec::new(),
        priority: 0,
    }
}

fn accept(id: &str, at_ms: u64) -> Command {
    Command::Accept {
        id: id.into(),
        request: request(&[1, 2, 3]),
        at_ms,
    }
}

fn progress(id: &str, offset: u32, tokens: &[u32]) -> Command {
    Command::Progress {
        id: id.into(),
        offset,
        tokens: tokens.to_vec(),
    }
}

fn finish(id: &str, at_ms: u64) -> Command {
    Command::Finish {
        id: id.into(),
        reason: Some(FinishReason::Stop),
        at_ms,
    }
}

/// Applies `commands` as entries 1, 2, ...; returns the outcomes.
fn run(state: &mut ClusterState, commands: &[Command]) -> Vec<Outcome> {
    let first = state.applied + 1;
    commands
        .iter()
        .enumerate()
        .map(|(i, c)| state.apply(first + i as u64, c))
        .collect()
}

#[test]
fn the_journal_records_acceptance_progress_and_completion() {
    let mut s = ClusterState::default();
    let outcomes = run(
        &mut s,
        &[
            accept("cmpl-a", 10),
            accept("cmpl-b", 11),
            progress("cmpl-a", 0, &[7, 8]),
            // A retried checkpoint overlapping what is recorded adds only the new token.
            progress("cmpl-a", 1, &[8, 9]),
            accept("cmpl-a", 12),
            finish("cmpl-b", 20),
        ],
    );
    assert_eq!(outcomes[4], Outcome::Duplicate);
    assert!(outcomes.iter().take(4).all(|o| *o == Outcome::Applied));
    assert_eq!(s.journal["cmpl-a"].sent, [7, 8, 9]);
    assert_eq!(s.journal["cmpl-a"].accepted_index, 1);
    let open: Vec<&str> = s.unfinished().iter().map(|(id, _)| id.as_str()).collect();
    assert_eq!(open, ["cmpl-a"]);
}

#[test]
fn progress_never_leaves_a_gap_or_rewrites_a_token() {
    let mut s = ClusterState::default();
    run(&mut s, &[accept("r", 0), progress("r", 0, &[1, 2, 3])]);
    let gap = s.apply(3, &progress("r", 5, &[6]));
    assert_eq!(gap, Outcome::BadProgress { recorded: 3 });
    let rewrite = s.apply(4, &progress("r", 2, &[9, 4]));
    assert_eq!(rewrite, Outcome::BadProgress { recorded: 3 });
    assert_eq!(s.journal["r"].sent, [1, 2, 3]);
    assert_eq!(
        s.apply(5, &progress("nobody", 0, &[1])),
        Outcome::UnknownRequest
    );
}

#[test]
fn epochs_only_move_forward() {
    let mut s = ClusterState::default();
    let up = |epoch, rank| Command::ShardUp {
        group: "g".into(),
        rank,
        epoch,
        host: "h".into(),
        pid: 100 + rank,
    };
    let fence = |epoch| Command::Fence {
        group: "g".into(),
        epoch,
    };
    let outcomes = run(
        &mut s,
        &[up(1, 0), up(1, 1), fence(2), up(1, 0), fence(2), up(2, 1)],
    );
    assert_eq!(outcomes[3], Outcome::StaleEpoch { current: 2 });
    assert_eq!(outcomes[4], Outcome::StaleEpoch { current: 2 });
    let g = &s.groups["g"];
    assert_eq!(g.epoch, 2);
    // The fence dropped the epoch-1 shards; only rank 1 registered again.
    assert_eq!(g.shards.keys().copied().collect::<Vec<_>>(), [1]);
}

#[test]
fn expiry_drops_only_requests_finished_before_the_cutoff() {
    let mut s = ClusterState::default();
    run(
        &mut s,
        &[
            accept("old", 0),
            accept("new", 0),
            accept("open", 0),
            finish("old", 100),
            finish("new", 500),
            Command::Expire { before_ms: 200 },
        ],
    );
    let ids: Vec<&str> = s.journal.keys().map(String::as_str).collect();
    assert_eq!(ids, ["new", "open"]);
}

#[test]
fn a_replayed_entry_changes_nothing() {
    let mut s = ClusterState::default();
    run(&mut s, &[accept("r", 0), progress("r", 0, &[1])]);
    let before = s.clone();
    assert_eq!(s.apply(2, &progress("r", 1, &[2])), Outcome::Applied);
    assert_eq!(s, before);
}

fn random_command(rng: &mut StdRng) -> Command {
    let id = format!("r{}", rng.random_range(0..6));
    match rng.random_range(0..8) {
        0 => accept(&id, rng.random_range(0..1000)),
        7 => Command::Model {
            name: format!("m{}", rng.random_range(0..2)),
            record: ModelRecord {
                path: format!("/models/{}", rng.random_range(0..3)),
                groups: vec!["g".into()],
            },
        },
        1 | 2 => {
            let offset = rng.random_range(0..6);
            let tokens: Vec<u32> = (offset..offset + rng.random_range(0..4)).collect();
            progress(&id, offset, &tokens)
        }
        3 => finish(&id, rng.random_range(0..1000)),
        4 if rng.random_bool(0.5) => Command::Expire {
            before_ms: rng.random_range(0..1000),
        },
        4 if rng.random_bool(0.7) => Command::Prune {
            finished_before_ms: rng.random_range(0..1000),
            open_before_ms: rng.random_range(0..300),
            max_bytes: rng.random_range(0..3000),
            running: vec![format!("r{}", rng.random_range(0..6))],
        },
        4 => Command::Reopen { id },
        6 if rng.random_bool(0.2) => Command::Topology {
            generation: 1,
            path: "/t/topology.toml".into(),
            text: format!("# {}", rng.random_range(0..3)),
            models: BTreeMap::from([(
                format!("m{}", rng.random_range(0..2)),
                ModelRecord {
                    path: "/models/0".into(),
                    groups: vec!["g".into()],
                },
            )]),
        },
        5 => Command::Fence {
            group: "g".into(),
            epoch: rng.random_range(0..5),
        },
        _ => Command::ShardUp {
            group: "g".into(),
            rank: rng.random_range(0..3),
            epoch: rng.random_range(0..5),
            host: "h".into(),
            pid: 1,
        },
    }
}

#[test]
fn random_logs_keep_the_invariants_and_snapshots_restore_exactly() {
    for seed in 0..200 {
        let mut rng = StdRng::seed_from_u64(seed);
        let mut s = ClusterState::default();
        let mut epoch = 0;
        for index in 1..=60 {
            let command = random_command(&mut rng);
            let before = s.clone();
            let outcome = s.apply(index, &command);
            if outcome != Outcome::Applied {
                let mut unchanged = before.clone();
                unchanged.applied = index;
                assert_eq!(s, unchanged, "seed {seed}: {outcome:?} changed the state");
            }
            // Epochs never go back; checkpointed tokens are never lost or rewritten.
            let now = s.groups.get("g").map_or(0, |g| g.epoch);
            assert!(now >= epoch, "seed {seed}");
            epoch = now;
            for (id, j) in &before.journal {
                if let Some(after) = s.journal.get(id) {
                    assert!(after.sent.starts_with(&j.sent), "seed {seed}: {id}");
                }
            }
            // Progress tokens equal their offsets here, so any gap or rewrite shows.
            for j in s.journal.values() {
                assert!(j.sent.iter().enumerate().all(|(i, t)| *t == i as u32));
            }
            // The journal's running count is its count from scratch.
            assert_eq!(
                s.journal_usage(),
                JournalUsage::of(&s.journal),
                "seed {seed}"
            );
            if let Command::Prune { max_bytes, .. } = command {
                let usage = s.journal_usage();
                assert!(
                    usage.bytes <= max_bytes.max(usage.open_bytes),
                    "seed {seed}: {usage:?} after pruning to {max_bytes}"
                );
            }
            // A peer restored from a snapshot is the same state.
            let restored = ClusterState::restore(&s.snapshot().unwrap()).unwrap();
            assert_eq!(restored, s, "seed {seed}");
            assert_eq!(restored.journal_usage(), s.journal_usage(), "seed {seed}");
        }
    }
}

#[test]
fn garbage_snapshots_are_refused() {
    assert!(ClusterState::restore(&[0xff; 64]).is_err());
    assert_eq!(ClusterState::restore(&[]).unwrap(), ClusterState::default());
    let oversized = vec![0u8; MAX_SNAPSHOT_BYTES + 1];
    assert!(ClusterState::restore(&oversized).is_err());
}

fn finish_at(id: &str, at_ms: u64) -> Command {
    finish(id, at_ms)
}

fn prune(finished_before_ms: u64, open_before_ms: u64, max_bytes: u64) -> Command {
    Command::Prune {
        finished_before_ms,
        open_before_ms,
        max_bytes,
        running: Vec::new(),
    }
}

fn ids(s: &ClusterState) -> Vec<&str> {
    s.journal.keys().map(String::as_str).collect()
}

/// An open request is counted at its largest (prompt, stop ids and `max_tokens`) from its
/// acceptance on; once finished, at what it holds.
#[test]
fn the_journal_counts_open_requests_at_their_largest() {
    let mut s = ClusterState::default();
    run(&mut s, &[accept("a", 0)]);
    let open = s.journal_usage();
    // 3 prompt tokens, 1 stop id, 16 max_tokens; "a" and "m".
    assert_eq!(open.bytes, journal::ENTRY_OVERHEAD_BYTES + 4 * 20 + 2);
    assert_eq!(
        (open.entries, open.open, open.open_bytes),
        (1, 1, open.bytes)
    );
    run(&mut s, &[progress("a", 0, &[5, 6, 7])]);
    assert_eq!(
        s.journal_usage(),
        open,
        "progress within max_tokens adds nothing"
    );
    run(&mut s, &[finish_at("a", 10)]);
    let done = s.journal_usage();
    assert_eq!(done.bytes, journal::ENTRY_OVERHEAD_BYTES + 4 * 7 + 2);
    assert_eq!((done.open, done.open_bytes), (0, 0));
    assert_eq!(done.finished_bytes(), done.bytes);
}

#[test]
fn pruning_drops_finished_requests_earliest_first_and_never_open_ones() {
    let mut s = ClusterState::default();
    run(
        &mut s,
        &[
            accept("f1", 0),
            accept("f2", 0),
            accept("f3", 0),
            accept("open", 0),
            finish_at("f2", 100),
            finish_at("f1", 200),
            finish_at("f3", 300),
        ],
    );
    let each = s.journal["f1"].bytes("f1");
    let open = s.journal_usage().open_bytes;
    // Room for the open request and one finished one: f2 (finished first), then f1 go.
    run(&mut s, &[prune(0, 0, open + each)]);
    assert_eq!(ids(&s), ["f3", "open"]);
    // Asking for less than the open requests hold drops every finished one, no more.
    run(&mut s, &[prune(0, 0, 0)]);
    assert_eq!(ids(&s), ["open"]);
    assert_eq!(s.journal_usage(), JournalUsage::of(&s.journal));
}

#[test]
fn pruning_drops_requests_past_their_retention_or_time_to_live() {
    let mut s = ClusterState::default();
    run(
        &mut s,
        &[
            accept("done-old", 0),
            accept("done-new", 0),
            accept("open-old", 50),
            accept("open-new", 150),
            finish_at("done-old", 100),
            finish_at("done-new", 500),
            prune(200, 100, u64::MAX),
        ],
    );
    assert_eq!(ids(&s), ["done-new", "open-new"]);
    // A request the leader names as running stays, however old.
    let keep = Command::Prune {
        finished_before_ms: 0,
        open_before_ms: 1_000,
        max_bytes: u64::MAX,
        running: vec!["open-new".into()],
    };
    run(&mut s, &[keep]);
    assert_eq!(ids(&s), ["done-new", "open-new"]);
}

/// A snapshot of a journal larger than one wire frame encodes, and restores to the same
/// state (before, a snapshot had to fit a frame, and a larger one stopped every peer).
#[test]
fn a_snapshot_larger_than_a_frame_restores() {
    let mut s = ClusterState::default();
    // 4,096 token ids above 65,535 take 5 bytes each: 20 KiB per request.
    let prompt: Vec<u32> = (0..4096).map(|i| 100_000 + i).collect();
    let commands: Vec<Command> = (0..1000)
        .map(|i| Command::Accept {
            id: format!("cmpl-{i}"),
            request: request(&prompt),
            at_ms: i,
        })
        .collect();
    run(&mut s, &commands);
    let bytes = s.snapshot().expect("encodes");
    assert!(bytes.len() > wire::MAX_FRAME_BYTES, "{}", bytes.len());
    let restored = ClusterState::restore(&bytes).expect("restores");
    assert_eq!(restored.journal_usage(), s.journal_usage());
    assert_eq!(restored, s);
}

/// A request that ended without a reason (cancelled, failed) can be reopened, and is then
/// counted as open again; one that is open or finished with a reason cannot.
#[test]
fn only_an_end_without_a_reason_can_be_reopened() {
    let end = |id: &str, reason| Command::Finish {
        id: id.into(),
        reason,
        at_ms: 10,
    };
    let reopen = |id: &str| Command::Reopen { id: id.into() };
    let mut s = ClusterState::default();
    let outcomes = run(
        &mut s,
        &[
            accept("cut", 0),
            accept("done", 0),
            accept("open", 0),
            end("cut", None),
            end("done", Some(FinishReason::Stop)),
            reopen("cut"),
            reopen("done"),
            reopen("open"),
            reopen("nowhere"),
        ],
    );
    assert_eq!(outcomes[5], Outcome::Applied);
    assert_eq!(outcomes[6], Outcome::NotReopenable);
    assert_eq!(outcomes[7], Outcome::NotReopenable);
    assert_eq!(outcomes[8], Outcome::UnknownRequest);
    assert_eq!(s.journal["cut"].finished, None);
    assert_eq!(s.journal_usage().open, 2);
    assert_eq!(s.journal_usage(), JournalUsage::of(&s.journal));
}

#[test]
fn an_applied_topology_replaces_the_models_and_forgets_what_it_drops() {
    let record = |path: &str, groups: &[&str]| ModelRecord {
        path: path.into(),
        groups: groups.iter().map(|g| g.to_string()).collect(),
    };
    let model = |name: &str, record: ModelRecord| Command::Model {
        name: name.into(),
        record,
    };
    let fence = |group: &str| Command::Fence {
        group: group.into(),
        epoch: 1,
    };
    let deploy = Command::Rollout(RolloutCommand::Deploy {
        model: "old".into(),
        path: "/old-2".into(),
        canary: None,
        at_ms: 1,
    });
    let apply = |generation: u64, models: &[(&str, ModelRecord)]| Command::Topology {
        generation,
        path: "/t/topology.toml".into(),
        text: "# text".into(),
        models: (models.iter())
            .map(|(n, r)| (n.to_string(), r.clone()))
            .collect(),
    };
    let mut s = ClusterState::default();
    let outcomes = run(
        &mut s,
        &[
            model("old", record("/old", &["a"])),
            model("kept", record("/kept", &["b"])),
            fence("a"),
            fence("b"),
            deploy,
            apply(
                1,
                &[
                    ("kept", record("/kept", &["b"])),
                    ("new", record("/new", &["c"])),
                ],
            ),
            model("old", record("/old", &["a"])),
        ],
    );
    assert!(
        outcomes[..6].iter().all(|o| *o == Outcome::Applied),
        "{outcomes:?}"
    );
    assert!(
        matches!(&outcomes[6], Outcome::Refused { reason } if reason.contains("applied topology")),
        "a leader's file no longer records models: {outcomes:?}"
    );
    assert_eq!(s.models.keys().collect::<Vec<_>>(), ["kept", "new"]);
    assert!(
        s.rollouts.is_empty(),
        "the dropped model's versions go with it"
    );
    assert_eq!(
        s.groups.keys().collect::<Vec<_>>(),
        ["b"],
        "group a is forgotten"
    );
    let applied = s.summary().topology.expect("the summary carries it");
    assert_eq!((applied.generation, applied.text.as_str()), (1, "# text"));
    let outcomes = run(
        &mut s,
        &[
            apply(1, &[]),
            apply(2, &[("kept", record("/kept", &["b"]))]),
        ],
    );
    assert!(
        matches!(&outcomes[0], Outcome::Refused { reason } if reason.contains("apply yours again")),
        "checked against an older topology: {outcomes:?}"
    );
    assert_eq!(outcomes[1], Outcome::Applied);
    assert_eq!(s.topology.as_ref().unwrap().generation, 2);
    assert_eq!(s.models.keys().collect::<Vec<_>>(), ["kept"]);
}
