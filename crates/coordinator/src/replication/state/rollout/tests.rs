use super::*;

fn groups() -> Vec<String> {
    vec!["a".into(), "b".into(), "c".into()]
}

fn initial() -> Rollout {
    Rollout::initial(&ModelRecord {
        path: "/m/v1".into(),
        groups: groups(),
    })
}

fn deploy(path: &str, canary: Option<(u8, &[&str])>) -> RolloutCommand {
    RolloutCommand::Deploy {
        model: "m".into(),
        path: path.into(),
        canary: canary.map(|(p, g)| (p, g.iter().map(|s| s.to_string()).collect())),
        at_ms: 5,
    }
}

fn rollback(to: Option<u32>) -> RolloutCommand {
    RolloutCommand::Rollback {
        model: "m".into(),
        to,
        reason: "asked".into(),
        at_ms: 9,
    }
}

const PROMOTE: fn() -> RolloutCommand = || RolloutCommand::Promote {
    model: "m".into(),
    at_ms: 7,
};

#[test]
fn a_canary_serves_its_groups_until_promoted_then_everywhere() {
    let mut r = initial();
    r.apply(&deploy("/m/v2", Some((10, &["c"]))), &groups())
        .unwrap();
    assert_eq!(
        (r.version_for("a"), r.version_for("c")),
        (1, 2),
        "the canary's group serves it, the others the stable version"
    );
    assert_eq!(r.canary.as_ref().unwrap().percent, 10);
    r.apply(&PROMOTE(), &groups()).unwrap();
    assert_eq!((r.stable, r.previous, r.canary.clone()), (2, Some(1), None));
    assert!(groups().iter().all(|g| r.version_for(g) == 2));
    // A plain rollback returns to the version stable before.
    r.apply(&rollback(None), &groups()).unwrap();
    assert_eq!((r.stable, r.previous), (1, Some(2)));
    assert!(
        r.events
            .last()
            .unwrap()
            .what
            .contains("rolled back to version 1")
    );
}

#[test]
fn a_rolled_back_canary_leaves_the_stable_version_everywhere() {
    let mut r = initial();
    r.apply(&deploy("/m/v2", Some((50, &["b", "c"]))), &groups())
        .unwrap();
    r.apply(&rollback(None), &groups()).unwrap();
    assert_eq!((r.stable, r.canary.clone()), (1, None));
    assert!(groups().iter().all(|g| r.version_for(g) == 1));
    // Version 2 stays known, and the next deploy is version 3.
    r.apply(&deploy("/m/v3", None), &groups()).unwrap();
    assert_eq!((r.stable, r.previous), (3, Some(1)));
    assert_eq!(r.version(2).unwrap().path, "/m/v2");
}

#[test]
fn only_three_versions_stay_known_and_the_ones_in_use_are_never_dropped() {
    let mut r = initial();
    for v in 2..=6 {
        r.apply(&deploy(&format!("/m/v{v}"), None), &groups())
            .unwrap();
    }
    let known: Vec<u32> = r.versions.iter().map(|v| v.version).collect();
    assert_eq!(known, [4, 5, 6]);
    assert_eq!((r.stable, r.previous), (6, Some(5)));
    // Back to 4, then a canary: 4 (stable), 6 (previous) and 7 (canary) are in use.
    r.apply(&rollback(Some(4)), &groups()).unwrap();
    r.apply(&deploy("/m/v7", Some((5, &["a"]))), &groups())
        .unwrap();
    let known: Vec<u32> = r.versions.iter().map(|v| v.version).collect();
    assert_eq!(known, [4, 6, 7]);
    let error = r.apply(
        &RolloutCommand::Promote {
            model: "m".into(),
            at_ms: 1,
        },
        &groups(),
    );
    assert!(error.is_ok());
    assert_eq!((r.stable, r.previous), (7, Some(4)));
}

#[test]
fn bad_rollouts_are_refused_with_what_to_change_and_change_nothing() {
    let mut r = initial();
    let cases: Vec<(RolloutCommand, &str)> = vec![
        (deploy("/x", Some((101, &["a"]))), "outside 0 to 100"),
        (
            deploy("/x", Some((10, &["zz"]))),
            "group `zz` does not serve this model",
        ),
        (deploy("/x", Some((10, &[]))), "at least one group"),
        (
            deploy("/x", Some((10, &["a", "b", "c"]))),
            "leaves none to serve",
        ),
        (PROMOTE(), "no canary to promote"),
        (rollback(None), "no earlier version"),
        (rollback(Some(1)), "already stable"),
        (
            rollback(Some(9)),
            "version 9 is not known: the known versions are 1",
        ),
    ];
    for (command, expected) in cases {
        let before = r.clone();
        let refusal = r.apply(&command, &groups()).unwrap_err();
        assert!(refusal.0.contains(expected), "{command:?}: {refusal}");
        assert_eq!(r, before, "{command:?} changed the state");
    }
    // Two rollouts of one model at once: the second is refused.
    r.apply(&deploy("/m/v2", Some((10, &["a"]))), &groups())
        .unwrap();
    let before = r.clone();
    let refusal = r.apply(&deploy("/m/v3", None), &groups()).unwrap_err();
    assert!(
        refusal.0.contains("version 2 is still a canary"),
        "{refusal}"
    );
    let refusal = r.apply(&rollback(Some(2)), &groups()).unwrap_err();
    assert!(
        refusal.0.contains("returns to the stable version 1"),
        "{refusal}"
    );
    assert_eq!(r, before);
}

#[test]
fn events_are_bounded() {
    let mut r = initial();
    for _ in 0..10 {
        r.apply(&deploy("/m/v", Some((1, &["a"]))), &groups())
            .unwrap();
        r.apply(&rollback(None), &groups()).unwrap();
    }
    assert_eq!(r.events.len(), KEPT_EVENTS);
    assert!(r.versions.len() <= KEPT_VERSIONS);
}
